"""``make gpu-report`` (``scripts/gpu_report.py``): every GPU measurement of the project in one command, most valuable
first, under a time budget (10 minutes by default), each result in the report JSON as soon as it exists.

    python scripts/gpu_report.py --out bench_results/gpu_report.json    # on a CUDA host
    python scripts/gpu_report.py --device cpu --out /tmp/r.json          # the smoke test: tiny shapes, CPU

Writes the report JSON (every step: command, status, exit status, seconds, its result JSON or error tail), a
markdown table beside it (``.md``), each step's JSON in ``<out stem>/`` and its output in ``<out stem>_logs/``.
The exit status is 1 if any step failed or timed out; skipped steps (no CUDA, one GPU, out of time) are not failures.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
from pathlib import Path

import torch

from ...distributed.devices import DEVICE_CHOICES, device_and_backend
from ..bench import cpu_name
from .plan import plan_steps
from .render import format_table, write_markdown
from .runner import choose_steps, report_failed, run_report

DEFAULT_BUDGET_S = 600.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--device", choices=DEVICE_CHOICES, default="auto", help="cuda: the real shapes; cpu: the smoke test"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="seconds for all steps; a step that would not fit in what is left is skipped, with the reason",
    )
    p.add_argument("--out", type=Path, default=Path("bench_results/gpu_report.json"), help="the report JSON")
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help="folder with qwen2-tokenizer/ and ami/ami_abstractive.jsonl for the end-to-end steps (skipped without; "
        "make gpu-report passes the project's data folder)",
    )
    p.add_argument(
        "--steps",
        nargs="+",
        metavar="NAME",
        default=None,
        help="run only these steps, in this order, each after those it reads from (the rest are skipped, saying so). "
        "Default: all, most valuable first",
    )
    args = p.parse_args(argv)
    if args.budget_s <= 0:
        p.error("--budget-s must be positive")
    return args


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for package in ("transformers", "peft", "bitsandbytes", "liger-kernel", "triton"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def host_header(device: str) -> dict:
    """Which host the report ran on: device, GPUs, CPU, versions, this checkout's commit."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if device == "cuda" else []
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
    except OSError:  # no git on the host
        commit = None
    return {
        "report": "gpu_report",
        "device": device,
        "gpus": gpus,
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "versions": _versions(),
        "commit": commit.stdout.strip() if commit is not None and commit.returncode == 0 else None,
    }


def main(argv: list[str] | None = None, scripts: Path | None = None) -> int:
    """Plan the steps for this host, run them, print the table; the exit status."""
    args = parse_args(argv)
    try:
        device, _ = device_and_backend(args.device, torch.cuda.is_available())
    except ValueError as error:  # --device cuda without CUDA
        print(f"gpu_report: {error}", file=sys.stderr)
        return 1
    scripts = scripts or Path(__file__).resolve().parents[3] / "scripts"
    header = host_header(device)
    steps = plan_steps(device, len(header["gpus"]), args.out.with_suffix(""), scripts, data=args.data)
    try:
        steps = choose_steps(steps, args.steps)
    except ValueError as error:
        print(f"gpu_report: {error}", file=sys.stderr)
        return 2
    report = run_report(
        steps,
        args.out,
        args.budget_s,
        header,
        progress=lambda line: print(line, flush=True),
        also_write=lambda r: write_markdown(r, args.out),
    )
    print(format_table(report))
    print(f"wrote {args.out}, {args.out.with_suffix('.md')}")
    return 1 if report_failed(report) else 0
