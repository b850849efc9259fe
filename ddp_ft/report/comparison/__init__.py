"""What DDP bought: one run on 1 device against the same experiment on N devices.

Scaling efficiency is the speedup over the device ratio. Loss curves line up on samples seen, not steps.
Modules: ``fairness``, ``summary`` and ``render`` are pure; ``wandb_io`` and ``files`` do the I/O.
"""

from .fairness import host_notes, mismatch
from .files import load_run, write_report
from .render import (
    TOKENS_NOTE,
    comparison_figure,
    forecast_lines,
    markdown_table,
    plot_comparison,
    summary_lines,
    table_rows,
)
from .summary import MEMORY_METRICS, Comparison, LossCurve, RunSummary, compare_runs, loss_curve, summarize_run
from .wandb_io import WANDB_PREFIX, log_report_to_wandb, records_from_wandb

__all__ = [
    "MEMORY_METRICS",
    "TOKENS_NOTE",
    "WANDB_PREFIX",
    "Comparison",
    "LossCurve",
    "RunSummary",
    "compare_runs",
    "comparison_figure",
    "forecast_lines",
    "host_notes",
    "load_run",
    "log_report_to_wandb",
    "loss_curve",
    "markdown_table",
    "mismatch",
    "plot_comparison",
    "records_from_wandb",
    "summarize_run",
    "summary_lines",
    "table_rows",
    "write_report",
]
