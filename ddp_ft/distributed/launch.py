"""Refuse ``accelerate launch`` settings the recipe would silently override, before the model loads.

``num_processes`` is not exported, so only the config file shows its mismatch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

_ENGINES = {
    "ACCELERATE_USE_FSDP": "FSDP",
    "ACCELERATE_USE_DEEPSPEED": "DEEPSPEED",
    "ACCELERATE_USE_MEGATRON_LM": "MEGATRON_LM",
}
_DATA_PARALLEL = ("NO", "MULTI_GPU", "MULTI_CPU")
# Makes HF and TRL trainers see CPU processes.
TRAINER_CPU_FIX = "TrainingArguments(use_cpu=True) (SFTConfig(use_cpu=True) for TRL)"
_EXAMPLES = "accelerate_configs/2gpu.yaml (GPUs) or accelerate_configs/2cpu_gloo.yaml (CPU processes)"


def _true(value: str | None) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "y", "on")


def allowed_mixed_precision(cuda: bool, chosen: str | None = None) -> tuple[str, ...]:
    """The ``mixed_precision`` values the recipe honours: 'no', or what it does anyway.

    Args:
        cuda (bool): CUDA is available.
        chosen (str | None): the run's own autocast. Default: unknown.
    """
    if chosen is not None:
        return ("no",) if chosen == "no" else ("no", chosen)
    return ("no", "bf16", "fp16") if cuda else ("no",)


def _check_mixed_precision(value: str, cuda: bool, where: str, chosen: str | None = None) -> None:
    allowed = allowed_mixed_precision(cuda, chosen)
    if value.lower() not in allowed:
        device = "CUDA" if cuda else "the CPU"
        raise ValueError(
            f"accelerate config mixed_precision={value!r} ({where}): the recipe sets the precision itself from "
            f"--compute-dtype (auto: bf16 autocast on GPUs of compute capability >= 8.0, fp16 with a loss scaler "
            f"on older ones, float32 on the CPU), so on {device} it would be ignored or differ from "
            f"scripts/train.py. Set mixed_precision to one of {list(allowed)}, or choose --compute-dtype."
        )


def check_accelerate_launch(
    environ: Mapping[str, str] | None = None, cuda: bool | None = None, chosen: str | None = None
) -> None:
    """Refuse exported Accelerate settings the recipe cannot honour.

    Args:
        environ (Mapping[str, str] | None): the environment. Default: ``os.environ``.
        cuda (bool | None): whether CUDA is available. Default: ``torch.cuda.is_available()``.
        chosen (str | None): the run's autocast, ``Precision.mixed_precision``. Default: unknown.

    Raises:
        ValueError: for another engine, ``mixed_precision`` or ``use_cpu`` with CUDA.
    """
    environ = os.environ if environ is None else environ
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    for variable, engine in _ENGINES.items():
        if _true(environ.get(variable)):
            raise ValueError(
                f"accelerate config distributed_type={engine} ({variable}={environ[variable]}): ddp_ft trains "
                f"data-parallel with BucketedDDP only, so the {engine} engine would take the model over. Launch with "
                f"distributed_type MULTI_GPU or 'NO', e.g. {_EXAMPLES}."
            )
    if "ACCELERATE_MIXED_PRECISION" in environ:
        _check_mixed_precision(environ["ACCELERATE_MIXED_PRECISION"], cuda, "ACCELERATE_MIXED_PRECISION", chosen)
    if cuda and _true(environ.get("ACCELERATE_USE_CPU")):
        raise ValueError(
            "accelerate config use_cpu=true (ACCELERATE_USE_CPU) while CUDA is available: the Trainer would run on "
            "the CPU and ddp_ft puts the model on the GPU. Set use_cpu: false, or hide the GPUs "
            "(CUDA_VISIBLE_DEVICES=)."
        )


def check_accelerate_config(path: str | Path, cuda: bool = False) -> None:
    """Refuse an Accelerate config file that would launch another run than it says.

    Args:
        path (str | Path): the file given to ``accelerate launch --config_file``.
        cuda (bool): check ``mixed_precision`` as for a CUDA machine. Default: False.

    Raises:
        ValueError: for another engine, ``mixed_precision`` or a ``num_processes`` it would not launch.

    Example:
        >>> check_accelerate_config("accelerate_configs/2gpu.yaml", cuda=True)
    """
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    kind = str(getattr(config.distributed_type, "value", config.distributed_type))
    processes, machines = int(config.num_processes), int(config.num_machines or 1)
    where = f"in {path}"
    if kind not in _DATA_PARALLEL:
        raise ValueError(
            f"accelerate config distributed_type={kind} {where}: ddp_ft trains data-parallel with BucketedDDP only. "
            f"Use one of {list(_DATA_PARALLEL)}, e.g. {_EXAMPLES}."
        )
    _check_mixed_precision(str(getattr(config.mixed_precision, "value", config.mixed_precision)), cuda, where)
    if processes > 1 and (kind == "NO" or config.use_cpu):
        why = "distributed_type 'NO'" if kind == "NO" else "use_cpu: true"
        raise ValueError(
            f"accelerate config num_processes={processes} {where}: with {why} accelerate launch starts one process "
            f"and ignores num_processes. For several processes use distributed_type MULTI_GPU with use_cpu: false "
            f"(without CUDA they run on the CPU over gloo), e.g. {_EXAMPLES}."
        )
    if kind != "NO" and processes < 2:
        raise ValueError(
            f"accelerate config num_processes={processes} {where}: distributed_type {kind} needs at least 2; for one "
            "process use accelerate_configs/single.yaml (distributed_type 'NO')."
        )
    if processes % machines:
        raise ValueError(
            f"accelerate config num_processes={processes} {where} is not divisible by num_machines={machines}: "
            f"accelerate launch would start {processes // machines} per machine, {processes // machines * machines} "
            "in all. Give num_processes as machines x processes per machine."
        )


if __name__ == "__main__":  # python -m ddp_ft.distributed.launch CONFIG.yaml [--cuda]
    import sys

    check_accelerate_config(sys.argv[1], cuda="--cuda" in sys.argv[2:])
    print(f"{sys.argv[1]}: ddp_ft can honour this accelerate config")


# World-size variables of torchrun, Accelerate and mpirun.
_WORLD_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_alone(environ: Mapping[str, str] | None = None) -> str | None:
    """Why ``accelerate launch`` started this process alone though asked for several, or None.

    Its single-process launcher sets ``MASTER_PORT`` but no world size only when asked for several.
    A user's own ``MASTER_PORT`` leaves the same trace, so this warns.

    Args:
        environ (Mapping[str, str] | None): the environment. Default: ``os.environ``.

    Returns:
        str | None: the warning, or None without the trace.
    """
    environ = os.environ if environ is None else environ
    alone = "ACCELERATE_USE_CPU" in environ and "MASTER_PORT" in environ
    if not alone or any(variable in environ for variable in _WORLD_VARIABLES):
        return None
    return (
        "accelerate launch started this process alone, though it was asked for several (it exported MASTER_ADDR/"
        "MASTER_PORT, which its single-process launcher does for --num_processes > 1): --cpu, use_cpu: true and "
        "distributed_type 'NO' start one process whatever num_processes says, so this run trains on one process. "
        "For N CPU processes: accelerate launch --multi_gpu --num_processes N script.py (without CUDA they run on the "
        "CPU over gloo; the script passes cpu=True / use_cpu=True), or --config_file accelerate_configs/2cpu_gloo.yaml. "
        "If you meant one process, unset MASTER_PORT."
    )


def check_world_seen(seen: int, fix: str, environ: Mapping[str, str] | None = None) -> None:
    """Refuse a launched process that sees a world of one and would train alone.

    Without CUDA, Accelerate builds a single-process state unless told ``cpu=True``.

    Args:
        seen (int): processes the Accelerator or ``TrainingArguments`` see.
        fix (str): the setting named in the error, e.g. ``cpu=True``.
        environ (Mapping[str, str] | None): the environment. Default: ``os.environ``.

    Raises:
        RuntimeError: if ``WORLD_SIZE`` > 1 and ``seen`` is 1.
    """
    environ = os.environ if environ is None else environ
    try:
        launched = int(environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return  # init_distributed refuses it
    if launched > 1 and seen == 1:
        rank = environ.get("RANK", "?")
        raise RuntimeError(
            f"This process was launched as rank {rank} of WORLD_SIZE={launched}, but Accelerate sees a single "
            f"process: the {launched} processes would each train alone on the whole data set, not data-parallel. "
            f"On a machine without CUDA pass {fix}. To train on one process, launch one (python script.py, or "
            "accelerate launch with num_processes: 1)."
        )
