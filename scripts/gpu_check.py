"""The first thing to run on a CUDA host: BucketedDDP against torch DDP, no communication under no_sync, the compute
dtype for these GPUs, and a short QLoRA run's tokens/s, peak memory and exposed communication
(``ddp_ft.tools.gpu_check``).

    python scripts/gpu_check.py --out bench_results/gpu_check.json   # make gpu-check; 1 process, then 2 on 2+ GPUs
    python scripts/gpu_check.py --device cpu                         # the same checks on 2 CPU processes (gloo)

Prints a PASS/FAIL table, writes the JSON, and exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ddp_ft.tools.gpu_check import GpuCheckSettings, format_report, run_gpu_check


def parse_args() -> tuple[GpuCheckSettings, Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(GpuCheckSettings):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "world_sizes":
            p.add_argument(flag, type=int, nargs="+", default=[], help=f.metadata["help"])
        else:
            p.add_argument(flag, type=type(f.default), default=f.default, help=f.metadata["help"])
    p.add_argument("--out", type=Path, default=Path("bench_results/gpu_check.json"), help="JSON report")
    args = vars(p.parse_args())
    out = args.pop("out")
    return GpuCheckSettings(**args), out


def main() -> int:
    settings, out = parse_args()
    try:
        report = run_gpu_check(settings)
    except ValueError as error:  # --device cuda without CUDA, more processes than GPUs
        print(f"gpu_check: {error}", file=sys.stderr)
        return 1
    print(format_report(report))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    for phase in report["phases"]:
        if phase.get("traceback"):
            print(f"\n{phase['world_size']} process(es) failed:\n{phase['traceback']}", file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
