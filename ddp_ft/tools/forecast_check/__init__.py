"""The validation of ``ddp-ft forecast`` in one command (``make forecast-check``).

    python -m ddp_ft.tools.forecast_check --out bench_results/forecast_check            # the CPU, 16 steps, 3 runs
    python -m ddp_ft.tools.forecast_check --out /tmp/fc --quick                         # a smoke test
    python -m ddp_ft.tools.forecast_check --out /tmp/fc --device cuda                   # 2 processes on one GPU

On the tiny preset, one thread per process, each as a subprocess of ``python -m ddp_ft``: the doctor's probe of the
link on 2 processes; one 1-process run; the independent pair (two 1-process runs at once: the host's contention
between two processes, no communication); ``--runs`` 2-process runs over gloo; ``ddp-ft forecast --link measured``
from the 1-process run and from each of the pair's runs. The verdict, per quantity (step time, exposed
communication): whether the forecast from the 1-process run falls inside the 2-process runs' range, each run its
median of steps 2..N. Every run is over gloo (``--backend gloo``): with ``--device cuda`` on one visible GPU, which the
2 processes share.

* ``verdict``: the runs' medians, the range and the verdicts, and the table (pure);
* ``stages``: the commands and how they run (subprocesses, logs, one progress line per stage);
* ``cli``: the command; ``forecast_check.json`` and ``forecast_check.md`` in ``--out``.
"""

from .cli import RESULT_JSON, collect, main, run_check
from .verdict import QUANTITIES, compare, judge, markdown, passed, run_medians

__all__ = [
    "QUANTITIES",
    "RESULT_JSON",
    "collect",
    "compare",
    "judge",
    "main",
    "markdown",
    "passed",
    "run_check",
    "run_medians",
]
