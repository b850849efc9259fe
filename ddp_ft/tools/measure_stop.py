"""How long a preempted run takes to stop: SIGTERM to the launcher at step k -> every rank saved and the launcher exited.

    python scripts/measure_stop.py --repeats 3 --out bench_results/stop_latency.json

Alternates the two entry points (torchrun scripts/train.py, accelerate launch recipes/qwen_ami.py) on the tiny preset
with 2 processes, sends SIGTERM to the launcher once step ``--at-step`` is in metrics.jsonl, and times until the
launcher exits. Prints a table (median and range over the repeats) and writes JSON. The budget to compare with is the
launcher's grace: torchrun sends SIGKILL 30 s (``--shutdown-timeout``) after forwarding the signal.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..report.records import METRICS_FILE

BIN = Path(sys.executable).parent
ENTRIES = ["torchrun scripts/train.py", "accelerate launch recipes/qwen_ami.py"]


def _command(entry: str, out: Path, root: Path) -> list[str]:
    flags = [
        "--preset",
        "tiny",
        "--output-dir",
        str(out),
        "--max-steps",
        "40",
        "--save-every",
        "0",
        "--report-to",
        "none",
    ]
    if entry == "torchrun scripts/train.py":
        return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", str(root / "scripts" / "train.py"), *flags]
    return [
        str(BIN / "accelerate"),
        "launch",
        "--config_file",
        str(root / "accelerate_configs" / "2cpu_gloo.yaml"),
        str(root / "recipes" / "qwen_ami.py"),
        *flags,
    ]


def _steps_logged(out: Path) -> int:
    """How many training steps ``out``'s metrics.jsonl holds so far."""
    path = out / METRICS_FILE
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"type": "train"' in line)


def measure(entry: str, at_step: int, root: Path) -> dict:
    """One run: SIGTERM to the launcher once ``at_step`` steps are logged; seconds until it exited, and what it saved.

    Raises:
        RuntimeError: when the launcher exits before step ``at_step``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": "lo",
            "WANDB_MODE": "disabled",
            "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p),
        }
        launcher = subprocess.Popen(
            _command(entry, out, root), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        while _steps_logged(out) < at_step:
            if launcher.poll() is not None:
                raise RuntimeError(f"{entry} exited before step {at_step}: {launcher.stderr.read()[-3000:]}")
            time.sleep(0.05)
        start = time.perf_counter()
        launcher.send_signal(signal.SIGTERM)
        stderr = launcher.communicate(timeout=120)[1]
        seconds = time.perf_counter() - start
        saved = sorted(p.name for p in out.glob("*checkpoint-*"))
        stopped = stderr.count("stopped by SIGTERM after step")
        return {
            "entry": entry,
            "seconds": seconds,
            "launcher_exit": launcher.returncode,
            "checkpoints": saved,
            "ranks_reporting_stop": stopped,
        }


def main(root: Path) -> None:
    """Time the stop of both entry points of the repository at ``root``, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--at-step", type=int, default=3)
    parser.add_argument("--out", default="bench_results/stop_latency.json")
    args = parser.parse_args()
    runs = [measure(entry, args.at_step, root) for _ in range(args.repeats) for entry in ENTRIES]  # alternated
    rows = []
    for entry in ENTRIES:
        seconds = [r["seconds"] for r in runs if r["entry"] == entry]
        ok = all(r["ranks_reporting_stop"] == 2 and len(r["checkpoints"]) == 1 for r in runs if r["entry"] == entry)
        rows.append(
            {
                "entry": entry,
                "median_s": statistics.median(seconds),
                "min_s": min(seconds),
                "max_s": max(seconds),
                "every_run_saved_one_checkpoint_on_both_ranks": ok,
            }
        )
    print(f"SIGTERM to the launcher at step {args.at_step} -> launcher exited ({args.repeats} repeats, alternated)")
    print(f"{'entry point':<42} {'median s':>9} {'range s':>14}  one checkpoint, both ranks stopped")
    for row in rows:
        print(
            f"{row['entry']:<42} {row['median_s']:>9.2f} {row['min_s']:>6.2f}-{row['max_s']:<6.2f}  "
            f"{row['every_run_saved_one_checkpoint_on_both_ranks']}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"at_step": args.at_step, "rows": rows, "runs": runs}, indent=2))
