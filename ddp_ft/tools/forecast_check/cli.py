"""The command: run the stages, read what they wrote, judge the forecast, write ``forecast_check.json`` and
``forecast_check.md``."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from ...report.forecast import load_forecast
from ...report.metrics import read_jsonl, timeline
from ...report.records import METRICS_FILE
from .stages import (
    FULL_PROBE,
    PROBE_REPEATS,
    QUICK,
    Progress,
    Sizes,
    doctor_command,
    environment,
    forecast_command,
    train_command,
)
from .verdict import compare, forecast_values, markdown, passed, run_medians

NPROC = 2
RESULT_JSON, RESULT_MD = "forecast_check.json", "forecast_check.md"


def build_parser() -> argparse.ArgumentParser:
    """The check's flags."""
    p = argparse.ArgumentParser(
        prog="python -m ddp_ft.tools.forecast_check",
        description="Validate ddp-ft forecast: the forecast for 2 processes against measured 2-process runs.",
    )
    p.add_argument("--out", type=Path, required=True, help="the folder for the runs, the logs and the result")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the runs compute: cpu, or cuda, where the 2 processes share one GPU over gloo (make one visible "
        "with CUDA_VISIBLE_DEVICES). Default: cpu",
    )
    p.add_argument("--steps", type=int, default=16, help="optimizer steps per run. Default: 16")
    p.add_argument("--runs", type=int, default=3, help="2-process runs the forecast is judged against. Default: 3")
    p.add_argument("--preset", default="tiny", help="the training preset. Default: tiny")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke test: {QUICK.steps} steps, {QUICK.runs} run (overrides --steps and --runs)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Sizes]:
    """The flags and the sizes they ask for; an error names the flag."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps {args.steps}: give 2 or more (the medians leave the first step out)")
    if args.runs < 1:
        p.error(f"--runs {args.runs}: give 1 or more")
    sizes = QUICK if args.quick else Sizes(args.steps, args.runs, FULL_PROBE, PROBE_REPEATS)
    return args, sizes


def run_check(out: Path, device: str, sizes: Sizes, preset: str) -> dict:
    """Run every stage into ``out`` and return the check's result (what ``forecast_check.json`` holds).

    Raises:
        SystemExit: a stage failed, with its log's tail.
    """
    env, logs, started = environment(device), out / "logs", time.perf_counter()
    _clear(out, ["probe", "single", "pair0", "pair1", *(f"ddp{i}" for i in range(sizes.runs)), "forecasts", "logs"])
    progress = Progress(total=4 + sizes.runs)
    seconds = {"probe": progress.stage(f"doctor: the link on {NPROC} processes", _probe(out, device, sizes), logs, env)}
    single = {"single": train_command(out / "single", sizes.steps, preset)}
    seconds["single"] = progress.stage(f"1 process, {sizes.steps} steps", single, logs, env)
    pair = {f"pair{i}": train_command(out / f"pair{i}", sizes.steps, preset) for i in range(2)}
    seconds["pair"] = progress.stage("the independent pair: 2 single processes at once", pair, logs, env)
    for i in range(sizes.runs):
        run = {f"ddp{i}": train_command(out / f"ddp{i}", sizes.steps, preset, NPROC)}
        seconds[f"ddp{i}"] = progress.stage(f"{NPROC} processes, run {i + 1} of {sizes.runs}", run, logs, env)
    sources = ["single", *pair]
    forecasts = {s: forecast_command(out / s, out / "probe", out / "forecasts" / s, NPROC) for s in sources}
    seconds["forecasts"] = progress.stage(f"ddp-ft forecast from {', '.join(sources)}", forecasts, logs, env)
    result = collect(out, sources, sizes.runs)
    return (
        result
        | {"device": device, "preset": preset, "steps": sizes.steps, "nproc": NPROC}
        | {
            "probe": {"sizes": list(sizes.probe_sizes), "repeats": sizes.probe_repeats},
            "seconds": seconds,
            "wall_s": time.perf_counter() - started,
        }
    )


def _clear(out: Path, folders: list[str]) -> None:
    """Remove an earlier check's folders: a run folder with a checkpoint would resume instead of training."""
    for name in folders:
        shutil.rmtree(out / name, ignore_errors=True)


def _probe(out: Path, device: str, sizes: Sizes) -> dict[str, list[str]]:
    return {"probe": doctor_command(out / "probe", device, sizes, NPROC)}


def _medians(folder: Path) -> dict[str, float | None]:
    return run_medians(timeline(read_jsonl(folder / METRICS_FILE)), folder.name)


def collect(out: Path, sources: list[str], runs: int) -> dict:
    """Read the runs' medians and the forecasts from ``out`` and judge them.

    Args:
        out (Path): the check's folder.
        sources (list[str]): the runs forecast from, the headline first.
        runs (int): the multi-process runs (``ddp0`` ...).
    """
    loaded = {s: load_forecast(out / "forecasts" / s) for s in sources}
    forecasts = {s: forecast_values(f, NPROC) for s, f in loaded.items()}
    measured = [_medians(out / f"ddp{i}") for i in range(runs)]
    quantities = compare(forecasts, measured)
    return {
        "single": _medians(out / "single"),
        "pair": [_medians(out / s) for s in sources[1:]],
        "runs": measured,
        "forecasts": forecasts,
        "link": loaded[sources[0]].links[0],
        "quantities": quantities,
        "passed": passed(quantities),
    }


def main(argv: list[str] | None = None) -> dict:
    """Parse, run the check, write and print its table; exit 0 whatever the verdict.

    Raises:
        SystemExit: a stage that failed.
    """
    args, sizes = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = run_check(args.out, args.device, sizes, args.preset)
    (args.out / RESULT_JSON).write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (args.out / RESULT_MD).write_text(table)
    print(table, end="", flush=True)
    print(f"wrote {args.out / RESULT_JSON} and {args.out / RESULT_MD} ({result['wall_s']:.0f} s)", flush=True)
    return result
