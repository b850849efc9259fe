"""Bucket sizing, measured (the body: ``ddp_ft.tools.ladder.sweep_cli``; ``ddp-ft bucket-sweep``).

torchrun --standalone --nproc_per_node=2 scripts/bucket_sweep.py --help
"""

from __future__ import annotations

from ddp_ft.tools.ladder.sweep_cli import main

if __name__ == "__main__":
    main()
