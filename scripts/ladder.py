"""The DDP ladder, measured (the body: ``ddp_ft.tools.ladder.ladder_cli``; ``ddp-ft ladder``).

torchrun --standalone --nproc_per_node=2 scripts/ladder.py --help
"""

from __future__ import annotations

from ddp_ft.tools.ladder.ladder_cli import main

if __name__ == "__main__":
    main()
