"""How long a preempted run takes to stop: SIGTERM to the launcher at step k -> every rank saved and the launcher exited
(the body: ``ddp_ft.tools.measure_stop``; ``--help`` for every flag).

    python scripts/measure_stop.py --repeats 3 --out bench_results/stop_latency.json
"""

from __future__ import annotations

from pathlib import Path

from ddp_ft.tools.measure_stop import main

if __name__ == "__main__":
    main(root=Path(__file__).resolve().parents[1])
