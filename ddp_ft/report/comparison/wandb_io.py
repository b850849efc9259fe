"""Read a wandb run as records, and log a written report to wandb."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..metrics import resolve_wandb_mode
from ..records import CONFIG, STEP_METRIC, TRAIN, eval_record

logger = logging.getLogger(__name__)

WANDB_PREFIX = "wandb:"


def records_from_wandb(run_path: str, api: object | None = None) -> list[dict]:
    """A wandb run logged online, as ``metrics.jsonl`` records.

    Args:
        run_path (str): ``entity/project/run_id``.
        api (object | None): a ``wandb.Api()`` or stand-in. Default: a new ``wandb.Api()``.

    Returns:
        list[dict]: the run's records.

    Example:
        >>> records = records_from_wandb("me/ddp-ft/abc123")
    """
    if api is None:
        import wandb

        api = wandb.Api()
    run = api.run(run_path)
    records: list[dict] = [{"type": CONFIG, "run_name": run.name, **dict(run.config)}]
    for row in run.scan_history():
        samples = row.get(STEP_METRIC)
        if row.get("train/loss") is not None:
            train = {k.removeprefix("train/"): v for k, v in row.items() if k.startswith("train/") and v is not None}
            records.append({"type": TRAIN, "step": train.get("step", row.get("_step")), **train})
        if row.get("eval/loss") is not None:
            records.append(eval_record(step=row.get("_step"), samples_seen=samples, eval_loss=row["eval/loss"]))
    return records


def log_report_to_wandb(report: dict, png_path: str | Path, project: str, group: str) -> None:
    """Log a :func:`write_report` result to wandb as a ``compare`` job; never raises.

    A missing or failing wandb only logs a warning.

    Args:
        report (dict): what :func:`write_report` returned.
        png_path (str | Path): the comparison plot.
        project (str): wandb project.
        group (str): wandb group, shared with the two training runs.
    """
    try:
        import wandb
    except ImportError:
        logger.warning("wandb is not installed: comparison not logged to wandb")
        return
    mode = resolve_wandb_mode(os.environ)
    run = None
    try:
        quiet = wandb.Settings(silent=True)  # we print one line instead
        run = wandb.init(
            project=project, group=group, job_type="compare", name=f"{group}-compare", mode=mode, settings=quiet
        )
        table = report["table"]
        run.log(
            {
                "comparison/table": wandb.Table(columns=table["columns"], data=table["rows"]),
                "comparison/plot": wandb.Image(str(png_path)),
            }
        )
        keys = (
            "speedup",
            "scaling_efficiency",
            "step_time_ratio",
            "loss_gap_max",
            "loss_gap_mean",
            "matched_points",
            "eval_loss_delta",
            "limit_tokens_per_s",
            "of_limit",
        )
        run.summary.update({f"comparison/{k}": report[k] for k in keys if report.get(k) is not None})
        if report.get("not_comparable"):  # why the ratios above are missing
            run.summary["comparison/not_comparable"] = "; ".join(report["not_comparable"])
        logger.info("logged comparison to wandb (%s mode): %s", mode, run.dir)
        if mode == "offline":
            runs = Path(run.dir).parent.parent  # the folder of offline runs
            logger.info(
                "to upload it and the training runs logged to the same WANDB_DIR: wandb sync %s",
                runs / "offline-run-*",
            )
    except Exception as error:  # a broken wandb must not cost the report on disk
        logger.warning("could not log the comparison to wandb (%s mode): %s", mode, error)
    finally:
        if run is not None:
            try:
                run.finish()
            except Exception as error:
                logger.warning("wandb finish failed: %s", error)
