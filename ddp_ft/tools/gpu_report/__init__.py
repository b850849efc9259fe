"""``make gpu-report``: the GPU measurements in one command, most valuable first, under a time budget.

The report JSON is rewritten after each step, so a run cut short keeps what it measured.
Modules, each importing only those before it: ``runner``, ``summaries``, ``plan``, ``render``, ``cli``.
"""

from .runner import FAILED, STATUSES, Step, report_failed, run_report, run_step, write_report

__all__ = ["FAILED", "STATUSES", "Step", "report_failed", "run_report", "run_step", "write_report"]
