"""All-reduce through the backend and through the ring (the body: ``ddp_ft.tools.ladder.bench_comm_cli``;
``ddp-ft bench-comm``).

torchrun --standalone --nproc_per_node=2 scripts/bench_comm.py --help
"""

from __future__ import annotations

from ddp_ft.tools.ladder.bench_comm_cli import main

if __name__ == "__main__":
    main()
