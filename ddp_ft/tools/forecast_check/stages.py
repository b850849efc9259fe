"""The check's commands, each run as a subprocess of this checkout's ``python -m ddp_ft``: the doctor's probe, the
training runs (one process, the independent pair, the multi-process runs) and the forecasts. Each writes its output
to ``DIR/logs/<name>.log``; a failure ends the check with that log's tail."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the checkout whose ddp_ft the subprocesses import
TIMEOUT_S = 1800
TAIL_CHARS = 3000


@dataclass(frozen=True)
class Sizes:
    """How much the check measures.

    Args:
        steps (int): optimizer steps per training run.
        runs (int): multi-process runs.
        probe_sizes (tuple[str, ...]): the doctor's all-reduce sizes.
        probe_repeats (int): the doctor's timed all-reduces per size.
    """

    steps: int
    runs: int
    probe_sizes: tuple[str, ...]
    probe_repeats: int


FULL_PROBE = ("64K", "256K", "1M", "4M", "16M")  # fewer sizes or repeats leave the fit to the noise
PROBE_REPEATS = 10
QUICK = Sizes(steps=3, runs=1, probe_sizes=FULL_PROBE, probe_repeats=PROBE_REPEATS)


BACKEND = "gloo"  # the CPU's, and on CUDA the one that lets the 2 processes share one GPU


def one_visible_gpu(environ: Mapping[str, str] | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` naming one GPU: the first of those visible (``0`` when unset).

    Args:
        environ (Mapping[str, str] | None): the environment to read. Default: this process's.
    """
    environ = os.environ if environ is None else environ
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "0").split(",") if d.strip()]
    return visible[0] if visible else "0"


def environment(device: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The subprocesses' environment: one thread per process, no wandb, this checkout first on the path.

    Args:
        device (str): ``cpu`` hides every GPU (``CUDA_VISIBLE_DEVICES`` empty); ``cuda`` shows one, which the
            processes share.
        environ (dict[str, str] | None): the environment to start from. Default: this process's.
    """
    env = dict(os.environ if environ is None else environ)
    path = env.get("PYTHONPATH", "")
    env |= {
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), path) if p),
    }
    env["CUDA_VISIBLE_DEVICES"] = "" if device == "cpu" else one_visible_gpu(env)
    return env


def ddp_ft(*args: str) -> list[str]:
    """``python -m ddp_ft ARGS`` with this interpreter."""
    return [sys.executable, "-m", "ddp_ft", *args]


def train_command(out: Path, steps: int, preset: str, nproc: int = 1) -> list[str]:
    """``ddp-ft train`` on ``preset`` for ``steps`` steps into ``out`` over gloo: no wandb, no checkpoint before the end.

    Without a GPU visible it trains on the CPU; with one, on it.
    """
    flags = ["--preset", preset, "--max-steps", str(steps), "--report-to", "none", "--save-every", "0"]
    flags += ["--backend", BACKEND, "--no-compile", "--packing", "false"]  # the CPU's defaults: no run compiles
    return ddp_ft("train", *(["--nproc", str(nproc)] if nproc > 1 else []), *flags, "--output-dir", str(out))


def doctor_command(out: Path, device: str, sizes: Sizes, nproc: int) -> list[str]:
    """``ddp-ft doctor`` on ``nproc`` processes over gloo, writing the probe ``--link measured`` reads into ``out``."""
    return ddp_ft(
        "doctor",
        *("--nproc", str(nproc), "--device", device, "--backend", BACKEND, "--sizes", *sizes.probe_sizes),
        *("--repeats", str(sizes.probe_repeats), "--out", str(out)),
    )


def forecast_command(run: Path, probe: Path, out: Path, nproc: int) -> list[str]:
    """``ddp-ft forecast`` of ``run`` on ``nproc`` processes over the link the doctor measured."""
    return ddp_ft(
        "forecast", str(run), "--nproc", str(nproc), "--link", "measured", "--probe", str(probe), "--out", str(out)
    )


def run_together(commands: dict[str, Sequence[str]], logs: Path, env: dict[str, str]) -> None:
    """Start every command at once, each writing ``logs/<name>.log``, and wait for all.

    Raises:
        SystemExit: a command failed or ran past the timeout, with its log's tail.
    """
    logs.mkdir(parents=True, exist_ok=True)
    files = {name: (logs / f"{name}.log").open("w") for name in commands}
    try:
        started = {
            name: subprocess.Popen(list(c), env=env, cwd=ROOT, stdout=files[name], stderr=subprocess.STDOUT)
            for name, c in commands.items()
        }
        codes = {name: _wait(p) for name, p in started.items()}
    finally:
        for f in files.values():
            f.close()
    failed = [name for name, code in codes.items() if code != 0]
    if failed:
        name = failed[0]
        tail = (logs / f"{name}.log").read_text()[-TAIL_CHARS:]
        command = " ".join(commands[name])
        raise SystemExit(f"forecast_check: {name} failed (exit {codes[name]}): {command}\n{tail}")


def _wait(process: subprocess.Popen) -> int:
    try:
        return process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return 124


class Progress:
    """One line per stage: ``[i/n] what ...``, then its seconds when it ends."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0

    def stage(self, what: str, commands: dict[str, Sequence[str]], logs: Path, env: dict[str, str]) -> float:
        """Run one stage's commands together (:func:`run_together`) and print its line; returns its seconds."""
        self.done += 1
        print(f"[{self.done}/{self.total}] {what} ...", end="", flush=True)
        started = time.perf_counter()
        try:
            run_together(commands, logs, env)
        except SystemExit:
            print(" failed", flush=True)
            raise
        seconds = time.perf_counter() - started
        print(f" {seconds:.0f} s", flush=True)
        return seconds
