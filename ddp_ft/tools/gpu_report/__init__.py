"""``make gpu-report``: the project's GPU measurements in one command, most valuable first, under a time budget, the
report JSON rewritten after each step so that a run cut short keeps what it measured.

One module per part, each importing only the ones before it:

* ``runner``: :class:`Step`, :func:`run_report` (each step a subprocess with its own limit, skipped when it would not
  fit, the report rewritten atomically), :func:`write_report`, :func:`report_failed`; no torch;
* ``summaries``: each step's headline numbers from its JSON, and a variant's losses against its baseline's;
* ``plan``: :func:`plan_steps`, the steps for this host (CUDA shapes, or tiny ones on the CPU) and what each skips;
* ``render``: the terminal table and the markdown beside the JSON;
* ``cli``: ``scripts/gpu_report.py``.
"""

from .runner import FAILED, STATUSES, Step, report_failed, run_report, run_step, write_report

__all__ = ["FAILED", "STATUSES", "Step", "report_failed", "run_report", "run_step", "write_report"]
