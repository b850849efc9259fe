"""Read run folders and write the comparison files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..forecast.render import FORECAST_FILE, load_forecast
from ..metrics import read_jsonl, timeline
from ..records import METRICS_FILE
from .render import markdown_table, plot_comparison, table_rows
from .summary import RunSummary, compare_runs, summarize_run
from .wandb_io import WANDB_PREFIX, records_from_wandb

logger = logging.getLogger(__name__)


def load_run(run_dir: str | Path, skip_first: int = 1) -> tuple[RunSummary, list[dict]]:
    """Read a run folder or ``wandb:`` run; an unnamed run takes the folder's name.

    Args:
        run_dir (str | Path): the run's output_dir or ``wandb:entity/project/id``.
        skip_first (int): warm-up steps left out. Default: 1.

    Returns:
        tuple[RunSummary, list[dict]]: the summary and the records.

    Raises:
        FileNotFoundError: if ``run_dir`` holds no ``metrics.jsonl``.
    """
    if str(run_dir).startswith(WANDB_PREFIX):
        path = str(run_dir)[len(WANDB_PREFIX) :]
        records = records_from_wandb(path)
        return summarize_run(records, skip_first, path.rstrip("/").rpartition("/")[2]), records
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass the output_dir of a training run")
    records = timeline(read_jsonl(path))
    return summarize_run(records, skip_first, Path(run_dir).resolve().name), records


def write_report(
    baseline_dir: str | Path,
    other_dir: str | Path,
    out_dir: str | Path,
    skip_first: int = 1,
    independent_dirs: list[str | Path] | None = None,
    forecast: str | Path | None = None,
) -> dict:
    """Compare two runs and write ``comparison.md``, ``.png`` and ``.json``.

    Args:
        baseline_dir (str | Path): the baseline run.
        other_dir (str | Path): the DDP run.
        out_dir (str | Path): where the files go.
        skip_first (int): warm-up steps left out. Default: 1.
        independent_dirs (list[str | Path] | None): side-by-side single-device runs. Default: None.
        forecast (str | Path | None): a ``forecast.json``. Default: the baseline's, if any.

    Returns:
        dict: the content of ``comparison.json``.

    Example:
        >>> write_report("runs/single", "runs/ddp", "runs/compare")
    """
    baseline, baseline_records = load_run(baseline_dir, skip_first)
    other, other_records = load_run(other_dir, skip_first)
    independent = [load_run(d, skip_first)[0] for d in independent_dirs or []]
    if forecast is None and not str(baseline_dir).startswith(WANDB_PREFIX):
        beside = Path(baseline_dir) / FORECAST_FILE
        forecast = beside if beside.is_file() else None
    predicted = load_forecast(forecast) if forecast is not None else None
    comparison = compare_runs(baseline, baseline_records, other, other_records, independent, predicted)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    markdown = markdown_table(comparison)
    files = {name: str(out / f"comparison.{name}") for name in ("md", "png", "json")}
    Path(files["md"]).write_text(markdown)
    plot_comparison(comparison, files["png"])
    columns, rows = table_rows(comparison)
    report = {**comparison.to_dict(), "table": {"columns": columns, "rows": rows}, "markdown": markdown, "files": files}
    Path(files["json"]).write_text(json.dumps(report, indent=2))
    logger.info("wrote %s", ", ".join(files.values()))
    return report
