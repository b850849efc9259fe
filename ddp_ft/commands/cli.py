"""``ddp-ft``: one command over ddp_ft's entry points, installed with the package (``[project.scripts]``).

    ddp-ft train --nproc 2 --preset tiny --max-steps 4                # the plain loop, torchrun started for you
    ddp-ft recipe --nproc 2 --preset tiny                             # the HF Trainer path
    ddp-ft doctor --nproc 2                                           # preflight: launch, devices, versions, comm
    ddp-ft compare runs/single runs/ddp --out runs/compare
    ddp-ft forecast runs/single --nproc 2 --link nvlink               # BucketedDDP on 2 GPUs, from a 1-process run
    ddp-ft merge runs/tiny --out models/tiny                          # adapter + base: one model to serve

Each subcommand dispatches to the module holding its body. With ``--nproc N`` it checks the flags here first,
so a wrong setting fails before any worker starts. Then it runs torch's elastic agent in this process.
Under a launcher already, it runs in the launched process.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from . import quiet_upstream_notices
from .launcher import console, launch

THREADS_ENV = "OMP_NUM_THREADS"


@dataclass(frozen=True)
class Subcommand:
    """A ``ddp-ft`` subcommand.

    Args:
        help (str): its line in ``ddp-ft --help``.
        module (str): the module run under torchrun (``-m``), holding ``main``.
        nproc (int): processes when ``--nproc`` is not given; 0: the subcommand does not launch.
        min_nproc (int): the fewest processes it runs on.
    """

    help: str
    module: str
    nproc: int = 1
    min_nproc: int = 1


SUBCOMMANDS = {
    "train": Subcommand(
        "Fine-tune with the plain PyTorch loop and BucketedDDP (scripts/train.py).", "ddp_ft.commands.train"
    ),
    "recipe": Subcommand(
        "Fine-tune with the HF Trainer (or TRL's SFTTrainer) and BucketedDDP (recipes/qwen_ami.py).",
        "ddp_ft.commands.recipe",
    ),
    "compare": Subcommand(
        "Compare a 1-device run with a DDP run: table, plot, JSON (scripts/compare.py).", "ddp_ft.commands.compare", 0
    ),
    "forecast": Subcommand(
        "Forecast BucketedDDP on N processes from a finished 1-process run: table, JSON (links measured or preset).",
        "ddp_ft.commands.forecast",
        0,
    ),
    "merge": Subcommand(
        "Merge a run's LoRA adapter into its base: a standalone model and tokenizer to serve.",
        "ddp_ft.commands.merge",
        0,
    ),
    "generate": Subcommand(
        "Generate with a trained adapter or merged model, prompts formatted as its training formatted them.",
        "ddp_ft.commands.generate",
        0,
    ),
    "doctor": Subcommand(
        "Preflight under the launcher: world size, devices, backend, precision, versions, all-reduce; exit 1 on failure.",
        "ddp_ft.commands.doctor",
    ),
    "ladder": Subcommand(
        "Measure the DDP ladder, naive all-reduce to BucketedDDP (scripts/ladder.py).",
        "ddp_ft.tools.ladder.ladder_cli",
        2,
        2,
    ),
    "bucket-sweep": Subcommand(
        "Measure BucketedDDP over bucket_cap_mb settings (scripts/bucket_sweep.py).",
        "ddp_ft.tools.ladder.sweep_cli",
        2,
        2,
    ),
    "bench-comm": Subcommand(
        "Measure all-reduce time and bus bandwidth, backend vs ring (scripts/bench_comm.py).",
        "ddp_ft.tools.ladder.bench_comm_cli",
        2,
        2,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """``ddp-ft``'s own parser: the subcommand's name; its flags are the subcommand's (``ddp-ft NAME --help``)."""
    parser = argparse.ArgumentParser(
        prog="ddp-ft",
        description="QLoRA fine-tuning with BucketedDDP: train, check and measure. `ddp-ft NAME --help` lists a "
        "subcommand's settings.",
    )
    names = parser.add_subparsers(dest="command", metavar="NAME", required=True)
    for name, sub in SUBCOMMANDS.items():
        names.add_parser(name, help=sub.help, add_help=False)
    return parser


def launch_parser(sub: Subcommand) -> argparse.ArgumentParser:
    """``--nproc``, as a parent parser of the subcommand's own (so its ``--help`` lists it)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "--nproc",
        type=int,
        default=argparse.SUPPRESS,  # no "(default: None)" from the settings' help formatter: the line says it
        metavar="N",
        help=f"processes on this machine; above 1 ddp-ft starts N workers itself, as torchrun --standalone (its agent "
        f"runs in ddp-ft's process). Under a launcher already, leave it out or give the launched WORLD_SIZE. "
        f"Default: {sub.nproc}",
    )
    return parser


def strip_option(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option VALUE`` / ``option=VALUE`` (what the workers must not see again)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(f"{option}="):
            out.append(arg)
    return out


def _validate(
    name: str, argv: list[str], parents: list[argparse.ArgumentParser], nproc: int
) -> tuple[list[str], Path | None]:
    """Parse the subcommand's settings here, before any worker starts.

    Returns:
        tuple[list[str], Path | None]: the workers' ``argv`` and the traceback folder, if any.

    Raises:
        SystemExit: on a wrong flag (status 2) or ``--help`` (status 0).
    """
    prog = f"ddp-ft {name}"
    failure_dir = None
    if name in ("train", "recipe"):
        from ..training.batch import gradient_accumulation_steps
        from ..training.checkpoint import refuse_earlier_run
        from ..training.checkpoint.shared_fs import check_output_dir
        from ..training.config import parse_settings
        from ..training.data.sources import check_local_file
        from ..training.model.source import check_model_source, choose_default

        extra = parents
        if name == "recipe":
            from .recipe import recipe_parser

            extra = [recipe_parser(), *parents]
        try:
            settings = parse_settings(argv, extra, choose_default(argv).preset, prog)
            check_model_source(settings.model.model_name_or_path)  # an unreachable hub id: seconds, not a minute
            check_local_file(settings.data)  # a wrong --source path: here, not once per worker
            check_output_dir(settings.train.output_dir)  # a file, or not writable: before the workers' start-up
            if not settings.train.resume:
                refuse_earlier_run(settings.train.output_dir)
            micro = settings.train.micro_batch  # "auto" is resolved on the device; it always divides
            gradient_accumulation_steps(settings.train.effective_batch, 1 if micro == "auto" else micro, nproc)
            _check_kernels(settings.model.liger, settings.model.compile)
            _check_backend(settings.ddp.backend, nproc)
            if name == "recipe":
                from ..integrations.stock import check_stock_settings

                own = recipe_parser().parse_known_args(argv)[0]
                check_stock_settings(settings, own.trainer, own.stock_find_unused)
        except (ValueError, FileNotFoundError) as error:
            _fail(prog, str(error))
        failure_dir = Path(settings.train.output_dir).absolute() / "logs"
    elif name == "doctor":
        from .doctor import parse_args

        parse_args(argv, parents, prog)
        if nproc > 1 and not any(a.split("=")[0] == "--expect-world-size" for a in argv):
            argv = [*argv, "--expect-world-size", str(nproc)]
    elif name == "compare":
        from .compare import build_parser as compare_parser

        compare_parser(parents, prog).parse_args(argv)
    else:
        importlib.import_module(SUBCOMMANDS[name].module).parse_args(argv, parents, prog)
    return argv, failure_dir


def _check_kernels(liger: bool, compile: bool | str) -> None:
    """Check ``--liger`` and ``--compile`` on the workers' device before any starts."""
    if liger or compile is True:  # compile auto: resolved by each worker, off where it cannot work
        import torch

        from ..training.model.kernels import check_kernel_settings

        check_kernel_settings(liger, compile is True, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def _check_backend(backend: str, nproc: int) -> None:
    """Check ``--backend`` against the GPUs here, which every worker will see, before any starts."""
    import torch

    from ..distributed.devices import check_local_gpus, device_and_backend

    device_type, backend = device_and_backend("auto", torch.cuda.is_available(), backend)
    if device_type == "cuda":
        check_local_gpus(nproc, torch.cuda.device_count(), backend)


def same_threads_for_any_nproc(prog: str, environ: MutableMapping[str, str] = os.environ) -> int | None:
    """Give one process the threads torchrun gives each of several, so speeds compare.

    Args:
        prog (str): the command named in the notice.
        environ (MutableMapping[str, str]): the workers' environment. Default: ``os.environ``

    Returns:
        int | None: threads per process, or None if left to OpenMP.

    Example:
        >>> same_threads_for_any_nproc("ddp-ft train", {})
        1
    """
    if THREADS_ENV not in environ:
        environ[THREADS_ENV] = "1"
        console().info(
            "%s: 1 thread per process (%s unset: torchrun's default for several processes, and ddp-ft's for one, so "
            "runs of any --nproc compare); set %s to choose",
            prog,
            THREADS_ENV,
            THREADS_ENV,
        )
    value = environ[THREADS_ENV].strip()
    threads = int(value) if value.isdigit() and int(value) > 0 else None
    if threads:
        import torch

        torch.set_num_threads(threads)  # OpenMP read the variable before it was set
    return threads


def _fail(prog: str, message: str) -> None:
    """Exit with a one-line usage error naming the setting."""
    from ..training.ranges import brief_usage_error

    brief_usage_error(prog, message)


def _in_process(name: str, argv: list[str], parents: list[argparse.ArgumentParser]) -> int:
    """Run the subcommand here: one process, or one worker of a launch."""
    prog = f"ddp-ft {name}"
    if name in ("train", "recipe"):
        from . import recipe, train

        (train if name == "train" else recipe).main(argv, parents, prog)
        return 0
    if name == "doctor":
        from .doctor import main as doctor

        return doctor(argv, parents, prog)
    if name == "compare":
        from .compare import main as compare

        compare(argv)
        return 0
    if name == "merge":
        from .merge import main as merge

        merge(argv, parents, prog)
        return 0
    importlib.import_module(SUBCOMMANDS[name].module).main(argv)  # a benchmark leaves through os._exit once written
    return 0


def run_subcommand(name: str, argv: list[str]) -> int:
    """Check ``--nproc`` and the subcommand's flags, then run it here or under torchrun. Returns the exit status."""
    sub = SUBCOMMANDS[name]
    parents = [launch_parser(sub)] if sub.nproc else []
    prog = f"ddp-ft {name}"
    nproc = sub.nproc
    if parents:
        given = getattr(parents[0].parse_known_args(argv)[0], "nproc", None)
        launched = int(os.environ.get("WORLD_SIZE", "0") or 0)
        if given is not None and given < sub.min_nproc:
            _fail(prog, f"--nproc {given}: {name} needs at least {sub.min_nproc} processes.")
        if launched and given not in (None, launched):
            _fail(prog, f"--nproc {given} under a launcher that started WORLD_SIZE={launched}: leave --nproc out.")
        nproc = launched or (given if given is not None else sub.nproc)
        if launched:
            return _in_process(name, strip_option(argv, "--nproc"), parents)
    argv, failure_dir = _validate(name, argv, parents, nproc)
    if name in ("train", "recipe"):
        same_threads_for_any_nproc(prog)
    if nproc <= 1:  # a subcommand that never launches (forecast) keeps an --nproc of its own
        return _in_process(name, strip_option(argv, "--nproc") if parents else argv, parents)
    return launch(prog, sub.module, nproc, strip_option(argv, "--nproc"), failure_dir)


def main(argv: list[str] | None = None) -> int:
    """``ddp-ft NAME [flags]``. Returns the exit status (the console script exits with it)."""
    quiet_upstream_notices()
    argv = list(sys.argv[1:] if argv is None else argv)
    build_parser().parse_args(argv[:1])  # --help, or an unknown name: argparse lists the subcommands and exits
    try:
        return run_subcommand(argv[0], argv[1:])
    except KeyboardInterrupt:  # while the settings are checked, before a worker starts, or a lone process's 2nd Ctrl-C
        console().warning("ddp-ft %s: interrupted; exit status 130", argv[0])
        return 130


if __name__ == "__main__":
    sys.exit(main())
