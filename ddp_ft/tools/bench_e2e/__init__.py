"""The end-to-end benchmark (``scripts/bench_e2e.py``, ``make bench-e2e``): ddp_ft's trainers against the stock
ones, and 2-rank DDP against two independent processes. ``runs``: the configurations and how one is run and read;
``summary``: the paired ratios and the loss check; ``table``: the table and the picture; ``cli``: the command."""
