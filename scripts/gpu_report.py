"""Every GPU measurement in one command, most valuable first, under 10 minutes (``make gpu-report``; the body:
``ddp_ft.tools.gpu_report``).

    python scripts/gpu_report.py --out bench_results/gpu_report.json   # a CUDA host
    python scripts/gpu_report.py --device cpu --out /tmp/gpu_report.json   # the smoke test (tiny shapes)
"""

from __future__ import annotations

import sys
from pathlib import Path

from ddp_ft.tools.gpu_report.cli import main

if __name__ == "__main__":
    sys.exit(main(scripts=Path(__file__).resolve().parent))
