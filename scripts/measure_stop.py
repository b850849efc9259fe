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

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _command(entry: str, out: Path) -> list[str]:
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
        return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", str(ROOT / "scripts" / "train.py"), *flags]
    return [
        str(BIN / "accelerate"),
        "launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / "2cpu_gloo.yaml"),
        str(ROOT / "recipes" / "qwen_ami.py"),
        *flags,
    ]


def _steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"type": "train"' in line)


def measure(entry: str, at_step: int) -> dict:
    """One run: SIGTERM to the launcher once ``at_step`` steps are logged; seconds until it exited, and what it saved."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": "lo",
            "WANDB_MODE": "disabled",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        }
        launcher = subprocess.Popen(
            _command(entry, out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--at-step", type=int, default=3)
    parser.add_argument("--out", default="bench_results/stop_latency.json")
    args = parser.parse_args()
    entries = ["torchrun scripts/train.py", "accelerate launch recipes/qwen_ami.py"]
    runs = [measure(entry, args.at_step) for _ in range(args.repeats) for entry in entries]  # alternated
    rows = []
    for entry in entries:
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


if __name__ == "__main__":
    main()
