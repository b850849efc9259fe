"""wandb at both ends of the comparison: :func:`records_from_wandb` reads a run logged online as ``metrics.jsonl``
records; :func:`log_report_to_wandb` logs a written report (table, plot, headline numbers) as a ``compare`` job.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..metrics import resolve_wandb_mode
from ..records import CONFIG, STEP_METRIC, TRAIN, eval_record

logger = logging.getLogger(__name__)

WANDB_PREFIX = "wandb:"


def records_from_wandb(run_path: str, api: object | None = None) -> list[dict]:
    """A wandb run (``entity/project/run_id``) as ``metrics.jsonl`` records, for runs logged online.

    Uses the keys both ddp_ft paths log: ``train/*`` (against ``train/samples_seen``) and ``eval/loss``;
    the run config gives world size and batch arithmetic.

    Args:
        run_path (str): ``entity/project/run_id``.
        api (object | None): a ``wandb.Api()`` (or a stand-in with ``run(path)``). Default: a new ``wandb.Api()``.
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
    """Log a :func:`write_report` result to wandb as one ``compare`` job of ``group``; never raises.

    Logs the per-run table as a ``wandb.Table``, the PNG as a ``wandb.Image`` and the headline numbers
    (speedup, scaling efficiency, loss gap, ...) to the run summary. The mode comes from
    :func:`resolve_wandb_mode`. If wandb is missing or fails, a warning is logged and nothing else happens. wandb's
    own output is silenced; offline, one log line says where the run is and how to upload it (``wandb sync``).

    Args:
        report (dict): what :func:`write_report` returned.
        png_path (str | Path): the comparison plot.
        project (str): wandb project.
        group (str): wandb group, shared with the two training runs; the run is named ``{group}-compare``.
    """
    try:
        import wandb
    except ImportError:
        logger.warning("wandb is not installed: comparison not logged to wandb")
        return
    mode = resolve_wandb_mode(os.environ)
    run = None
    try:
        quiet = wandb.Settings(silent=True)  # its own banner, summary and sync hint: ours is one line, below
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
            runs = Path(run.dir).parent.parent  # <WANDB_DIR>/wandb, holding offline-run-*/files
            logger.info(
                "to upload it and the training runs logged to the same WANDB_DIR: wandb sync %s",
                runs / "offline-run-*",
            )
    except Exception as error:  # a broken wandb must not cost the user the report already on disk
        logger.warning("could not log the comparison to wandb (%s mode): %s", mode, error)
    finally:
        if run is not None:
            try:
                run.finish()
            except Exception as error:
                logger.warning("wandb finish failed: %s", error)
