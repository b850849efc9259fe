"""What a run derives from its settings, computed once into a frozen :class:`Resolved`.

Settings are never written to after parsing. Three steps, each returning a new value:

1. :func:`resolve_run`, before anything is touched: checks that need only settings and world size.
2. :func:`resolve_run_packing`, once the model's config is at hand.
3. :func:`probe_run_micro_batch`, once the model is built, for ``--micro-batch auto`` on CUDA.

On CUDA, ``auto`` fills the GPU and compiles the decoder layers, since a small eager step leaves it idle
(``docs/performance.md``). On the CPU, ``auto`` keeps micro-batch 1 and eager layers. ``run_config.yaml``
records what ran.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..ddp.autotune import AUTO
from ..distributed import DistInfo
from ..distributed.launch import check_accelerate_launch
from .batch import gradient_accumulation_steps
from .config import RunSettings
from .data import batch_width, packing_problem, resolve_packing
from .model.compilation import Blocker, compile_blockers, refuse_blockers
from .model.kernels import check_kernel_settings
from .model.memory import MicroBatchChoice, Qwen3Shape, auto_micro_batch
from .model.precision import Precision
from .model.probe import MicroBatchProbe, device_share_bytes, probe_micro_batch
from .model.qlora import EMBEDDED_MODEL, check_device_map, set_checkpointing
from .perf_traps import sized_by_probe

logger = logging.getLogger(__name__)

COMPILE_WHY = (
    "regional compilation of the decoder layers, much faster at a full micro-batch on a GPU (docs/performance.md)"
)


@dataclass(frozen=True)
class Resolved:
    """What the run trains with, derived once from its settings.

    Args:
        micro_batch (int): samples per forward per rank.
        accumulation (int): micro-batches per rank per optimizer step.
        compile (bool): decoder layers compiled before the wrap.
        precision (Precision): compute dtype, autocast and loss scaling.
        device_map (dict | str): this rank's ``from_pretrained`` device map.
        micro_batch_why (str): where the micro-batch came from.
        compile_why (str): why compilation is on or off.
        probe_pending (bool): ``micro_batch`` is a guess until the probe runs. Default: False
        probe (MicroBatchProbe | None): the probe's measurement. Default: None
        packing (bool | None): rows packed without padding; None until resolved. Default: None
        packing_why (str): why packing is on or off. Default: ""
        checkpointing (bool): activation checkpointing on. Default: True
        checkpointing_why (str): why it is on or off. Default: ""
        attention (str | None): the layers' ``attn_implementation``. Default: None
        attention_why (str): why. Default: ""
    """

    micro_batch: int
    accumulation: int
    compile: bool
    precision: Precision
    device_map: dict[str, int | str] | str
    micro_batch_why: str
    compile_why: str
    probe_pending: bool = False
    probe: MicroBatchProbe | None = None
    packing: bool | None = None
    packing_why: str = ""
    checkpointing: bool = True
    checkpointing_why: str = ""
    attention: str | None = None
    attention_why: str = ""

    def as_config(self) -> dict[str, dict[str, object]]:
        """The resolved values by settings section, for ``run_config.yaml``."""
        data = {} if self.packing is None else {"data": {"packing": self.packing}}
        model = {
            "compile": self.compile,
            "gradient_checkpointing": self.checkpointing,
            "attention": self.attention or AUTO,
        }
        return {"model": model, "train": {"micro_batch": self.micro_batch}, **data}


class DeviceDefaults(NamedTuple):
    """``compile`` and ``micro_batch`` after the device's defaults."""

    compile: bool
    compile_why: str
    micro_batch: int | str
    micro_batch_why: str


def resolve_device_defaults(
    settings: RunSettings, info: DistInfo, blockers: Callable[..., list[Blocker]] = compile_blockers
) -> DeviceDefaults:
    """Resolve ``compile: auto``, and ``micro_batch: auto`` off CUDA.

    Args:
        settings (RunSettings): the run's settings.
        info (DistInfo): this rank.
        blockers (Callable): finds what breaks compilation; injectable for tests.

    Returns:
        DeviceDefaults: compile and micro-batch, each with why.

    Raises:
        ValueError: ``--compile`` where compilation is known to break.
    """
    model, lora, train = settings.model, settings.lora, settings.train
    say = logger.info if info.is_main_process else logger.debug
    compile_, compile_why = model.compile, "--no-compile (compile: false)"
    if model.compile in (True, AUTO):
        found = blockers(
            info.device,
            four_bit=model.load_in_4bit,
            lora_dropout=lora.lora_dropout,
            checkpointing=model.gradient_checkpointing is not False,  # auto may keep it on
        )
        if model.compile is True:
            refuse_blockers(found, "--compile (compile: true)")
            compile_why = "--compile (compile: true)"
        elif info.device.type != "cuda":
            compile_ = False
            compile_why = (
                f"auto on {info.device.type}: compiling costs each process tens of seconds; --compile turns it on"
            )
            say("compile: off (%s)", compile_why)
        elif found:
            compile_ = False
            compile_why = "though the default on CUDA is on: " + "; ".join(f"{b.reason} ({b.fix})" for b in found)
            if info.is_main_process:
                logger.warning("compile: off, %s", compile_why)
        else:
            compile_ = True
            compile_why = f"auto on CUDA: {COMPILE_WHY}; --no-compile turns it off"
            say("compile: on (%s)", compile_why)
    micro_batch, micro_why = train.micro_batch, f"--micro-batch {train.micro_batch}"
    if train.micro_batch == AUTO and info.device.type != "cuda":
        micro_batch = 1
        micro_why = (
            f"auto on {info.device.type}: the host's memory is shared, with no GPU to fill; --micro-batch N sets it"
        )
        say("micro-batch: 1 (%s)", micro_why)
    return DeviceDefaults(compile_, compile_why, micro_batch, micro_why)


def resolve_run(settings: RunSettings, info: DistInfo) -> Resolved:
    """Every check that needs only the settings and the world size.

    On a GPU ``--micro-batch auto`` becomes a first guess, and ``probe_pending`` is set.

    Returns:
        Resolved: everything but packing.

    Raises:
        ValueError: a setting this run cannot honour, naming the setting to change.

    Example:
        >>> resolved = resolve_run(settings, info)
    """
    precision = settings.model.precision(info.device)  # refuses emulated bf16
    check_accelerate_launch(chosen=precision.mixed_precision)
    defaults = resolve_device_defaults(settings, info)
    check_kernel_settings(settings.model.liger, False, info.device)
    micro_batch, micro_why, pending = defaults.micro_batch, defaults.micro_batch_why, False
    if micro_batch == AUTO:
        guess = resolve_micro_batch(settings, info)
        micro_batch, pending = (guess.micro_batch if guess is not None else 1), True
        micro_why = guess.describe() if guess is not None else "--micro-batch auto: a first guess of 1, then the probe"
    accumulation = gradient_accumulation_steps(settings.train.effective_batch, micro_batch, info.world_size)
    device_map = settings.model.device_map or {"": info.device.index if info.device.type == "cuda" else "cpu"}
    check_device_map(device_map, info.world_size)
    checkpointing, checkpointing_why = _checkpointing(settings, pending)
    return Resolved(
        micro_batch=micro_batch,
        accumulation=accumulation,
        compile=defaults.compile,
        precision=precision,
        device_map=device_map,
        micro_batch_why=micro_why,
        compile_why=defaults.compile_why,
        probe_pending=pending,
        checkpointing=checkpointing,
        checkpointing_why=checkpointing_why,
    )


def _checkpointing(settings: RunSettings, probe_pending: bool) -> tuple[bool, str]:
    """``gradient_checkpointing`` before the build; ``auto`` starts on."""
    value = settings.model.gradient_checkpointing
    if value != AUTO:
        return bool(value), "gradient_checkpointing: true" if value else "--no-gradient-checkpointing"
    if probe_pending:
        return True, "auto: on until the probe measures whether the whole per-rank batch fits without it"
    return True, "auto: on (without --micro-batch auto nothing measures whether the run fits without it)"


def resolve_micro_batch(
    settings: RunSettings, info: DistInfo, shape: Qwen3Shape | None = None, device_bytes: int | None = None
) -> MicroBatchChoice | None:
    """``--micro-batch auto``'s first guess by arithmetic, before the model loads.

    The probe on the built model decides later; the arithmetic knows eager Qwen3 shapes only. Under a process
    group every rank uses the smallest device, so all choose the same.

    Args:
        settings (RunSettings): the run's settings.
        info (DistInfo): this rank.
        shape (Qwen3Shape | None): the model's sizes. Default: from its ``config.json``
        device_bytes (int | None): device memory. Default: this rank's share of its GPU

    Returns:
        MicroBatchChoice | None: the guess; None when the model is not Qwen3-shaped.

    Raises:
        ValueError: off CUDA without ``device_bytes``, or micro-batch 1 does not fit.
    """
    if device_bytes is None:
        if info.device.type != "cuda":
            raise ValueError(
                f"--micro-batch auto fills a GPU's memory; this run is on {info.device.type}, whose memory is the "
                "host's: give --micro-batch a number (default 1)."
            )
        device_bytes, _ = device_share_bytes(info)
        if info.is_distributed and dist.is_initialized():  # one choice for all ranks
            smallest = torch.tensor([device_bytes], dtype=torch.int64, device=info.device)
            dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
            device_bytes = int(smallest.item())
    if shape is None:
        name = settings.model.model_name_or_path
        if name == EMBEDDED_MODEL:
            return None
        from transformers import AutoConfig

        try:
            shape = Qwen3Shape.from_config(AutoConfig.from_pretrained(name))
        except AttributeError:  # not Qwen3-shaped
            return None
    precision = settings.model.precision(info.device)
    choice = auto_micro_batch(
        shape,
        batch_width(settings.data.max_seq_len),  # the widest micro-batch
        settings.train.effective_batch,
        info.world_size,
        device_bytes,
        compute_dtype=precision.name,
        upcast_frozen_weights=settings.model.upcast_frozen_weights,
        lora_r=settings.lora.lora_r,
        double_quant=settings.model.double_quant,
    )
    if info.is_main_process:
        logger.info("%s", choice.describe())
    return choice


def resolve_run_packing(resolved: Resolved, settings: RunSettings, info: DistInfo, model_path: str) -> Resolved:
    """``--packing`` resolved for this device and model.

    Reads the model's config only, to refuse attention that would mix packed sequences before anything loads.

    Returns:
        Resolved: ``resolved`` with ``packing`` and ``packing_why``.

    Raises:
        ValueError: ``--packing true`` for a model whose attention would mix sequences.
    """
    packing = settings.data.packing
    problem = None
    if packing is True or (packing == AUTO and info.device.type == "cuda"):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path)
        config.use_cache = False  # as load_qlora_model sets it
        problem = packing_problem(config)
    chosen, reason = resolve_packing(packing, info.device.type, problem)
    if info.is_main_process:
        logger.info("packing %s (%s)", "on" if chosen else "off", reason)
    return replace(resolved, packing=chosen, packing_why=reason)


def probe_run_micro_batch(
    model: torch.nn.Module, settings: RunSettings, info: DistInfo, resolved: Resolved, **overrides: object
) -> Resolved:
    """``--micro-batch auto``'s decision, probed on the built model.

    Call it on every rank, after compilation and before the DDP wrap.

    Args:
        model (torch.nn.Module): the unwrapped model.
        settings (RunSettings): the run's settings.
        info (DistInfo): this rank.
        resolved (Resolved): the run's, with ``probe_pending``.
        **overrides: passed to ``probe_micro_batch``, for tests.

    Returns:
        Resolved: the probe's micro-batch and accumulation.

    Raises:
        ValueError: micro-batch 1 does not fit on some rank.
    """
    probe = _probe(model, settings, info, resolved, overrides)
    sized_by_probe(model)  # the idle check's profiled step would advise nothing
    if info.is_main_process and probe.micro_batch != resolved.micro_batch:
        logger.info(
            "--micro-batch auto: the probe's %d replaces the first guess %d", probe.micro_batch, resolved.micro_batch
        )
    checkpointing, checkpointing_why = resolved.checkpointing, resolved.checkpointing_why
    if settings.model.gradient_checkpointing == AUTO and checkpointing:
        probe, checkpointing, checkpointing_why = _checkpointing_if_needed(
            model, settings, info, resolved, probe, overrides
        )
    return replace(
        resolved,
        micro_batch=probe.micro_batch,
        accumulation=probe.accumulation,
        micro_batch_why=probe.describe(),
        probe_pending=False,
        probe=probe,
        checkpointing=checkpointing,
        checkpointing_why=checkpointing_why,
    )


def _probe(model, settings: RunSettings, info: DistInfo, resolved: Resolved, overrides: dict) -> MicroBatchProbe:
    return probe_micro_batch(
        model,
        seq_len=batch_width(settings.data.max_seq_len),  # the widest micro-batch
        effective_batch=settings.train.effective_batch,
        info=info,
        precision=resolved.precision,
        **overrides,
    )


def _checkpointing_if_needed(
    model, settings: RunSettings, info: DistInfo, resolved: Resolved, probe: MicroBatchProbe, overrides: dict
) -> tuple[MicroBatchProbe, bool, str]:
    """Turn checkpointing off when the whole per-rank batch fits without it."""
    say = logger.info if info.is_main_process else logger.debug
    if probe.accumulation != 1:
        why = f"auto: on, the micro-batch it allows ({probe.micro_batch}) is below the per-rank batch"
        say("gradient checkpointing: %s", why.removeprefix("auto: "))
        return probe, True, why
    set_checkpointing(model, False)
    try:
        bare = _probe(model, settings, info, resolved, overrides)
    except ValueError:
        bare = None
    if bare is not None and bare.accumulation == 1:
        why = (
            f"auto: off, micro-batch {bare.micro_batch} fits without it (expected {bare.expected_peak / 1e9:.1f} GB "
            f"of a {bare.budget / 1e9:.1f} GB budget), so nothing is recomputed; --gradient-checkpointing true keeps it"
        )
        say("gradient checkpointing: %s", why.removeprefix("auto: "))
        return bare, False, why
    set_checkpointing(model, True, settings.model.use_reentrant)
    why = f"auto: on, micro-batch {probe.micro_batch} fits only with it"
    say("gradient checkpointing: %s", why.removeprefix("auto: "))
    return probe, True, why
