"""Throughput of one process without DDP vs torch DDP vs BucketedDDP on the tiny Qwen3 QLoRA model (the body:
``ddp_ft.tools.bench_ddp``; ``--help`` for every flag).

    torchrun --standalone --nproc_per_node=2 scripts/bench_ddp.py --out bench_results/bench_ddp.json
    python scripts/bench_ddp.py --pool bench_results/a.json bench_results/b.json   # pool earlier runs' ratios
"""

from __future__ import annotations

from ddp_ft.tools.bench import exit_without_finalization
from ddp_ft.tools.bench_ddp import main

if __name__ == "__main__":
    main()
    exit_without_finalization()  # done and written
