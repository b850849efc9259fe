"""Qwen3-4B QLoRA training speed on GPUs: tokens/s, step time, peak memory and model FLOPs utilisation (the body:
``ddp_ft.tools.bench_gpu``; ``--help`` for every flag).

    python scripts/bench_gpu.py                                     # 1 GPU: BucketedDDP vs no wrapper
    torchrun --standalone --nproc_per_node=2 scripts/bench_gpu.py   # 2 GPUs: scaling
    python scripts/bench_gpu.py --shape tiny --device cpu           # the smoke test
"""

from __future__ import annotations

from ddp_ft.tools.bench_gpu.cli import main

if __name__ == "__main__":
    main()
