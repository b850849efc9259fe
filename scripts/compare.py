"""What DDP bought: compare a 1-device run with the same experiment under DDP (the body: ``ddp_ft.commands.compare``;
``ddp-ft compare``).

    python scripts/train.py --preset tiny --output-dir runs/single
    torchrun --standalone --nproc_per_node=2 scripts/train.py --preset tiny --output-dir runs/ddp
    python scripts/compare.py runs/single runs/ddp --out runs/compare [--wandb-project P --wandb-group G]
        [--independent runs/alone0 runs/alone1]   # single-device runs that ran side by side: the limit

Prints the markdown table and writes comparison.md, comparison.png and comparison.json into --out.
"""

from __future__ import annotations

from ddp_ft.commands.compare import main

if __name__ == "__main__":
    main()
