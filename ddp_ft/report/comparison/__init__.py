"""What DDP bought: one run on 1 device against the same experiment with DDP on N devices.

Both runs are read from their rank-0 ``metrics.jsonl`` (see :mod:`ddp_ft.report.metrics`). Throughput compares
global tokens/s (non-padding tokens, summed over ranks); scaling efficiency divides the speedup by the
ratio of device counts, so 100% means N devices did N times the work. Loss curves are overlaid on
*samples seen*, not step: with the same effective batch the two runs see the same samples per step, and
with different ones it is still the axis on which their curves line up.

One module per part, each importing only the ones before it:

* ``fairness``: :func:`mismatch` and :func:`host_notes`, whether two runs' speeds measure DDP (threads per process,
  device type, the host) (pure);
* ``summary``: :class:`RunSummary`, :class:`LossCurve`, :class:`Comparison`, :func:`summarize_run`,
  :func:`loss_curve`, :func:`compare_runs` (pure, unit-tested);
* ``render``: :func:`table_rows`, :func:`summary_lines`, :func:`forecast_lines` (``ddp-ft forecast`` beside the DDP
  run), :func:`markdown_table` (pure), :func:`comparison_figure` and :func:`plot_comparison`;
* ``wandb_io``: :func:`records_from_wandb` (a run logged online as records) and :func:`log_report_to_wandb`;
* ``files``: :func:`load_run` and :func:`write_report`, the thin I/O around the rest.
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
