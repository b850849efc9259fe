"""End to end: ddp_ft against the stock Trainer and SFTTrainer, and 2-rank DDP against its limit (``make bench-e2e``).

    python scripts/bench_e2e.py --repeats 5 --out bench_results/bench_e2e.json

``--help`` lists every configuration; the body is ``ddp_ft.tools.bench_e2e``.
"""

from ddp_ft.tools.bench_e2e.cli import main

if __name__ == "__main__":
    main()
