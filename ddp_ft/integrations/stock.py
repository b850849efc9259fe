"""The recipe's stock peers: ``transformers.Trainer`` or TRL's ``SFTTrainer`` with torch DDP.

They train the same model and data with no ddp_ft class in the training path.
Only ``ThroughputCallback`` is added, so the runs are measured the same way.
Settings the stock classes cannot honour are refused before the model loads.
"""

from __future__ import annotations

import logging
from dataclasses import fields

from ..ddp import DDPSettings
from ..ddp.autotune import AUTO
from ..training.config import RunSettings
from ..training.hooks import run_hooks_installed
from .callbacks import ThroughputCallback
from .recipe_eval import evaluating_every_row

logger = logging.getLogger(__name__)

STOCK_TRAINERS = ("stock-hf", "stock-trl")
FIND_UNUSED = ("trainer", "true", "false")  # the Trainer's default, or forced
# passed on to torch DDP as TrainingArguments' ddp_*
_PASSED_ON = ("bucket_cap_mb", "broadcast_buffers", "ddp_timeout", "backend")


def check_stock_settings(settings: RunSettings, trainer: str, find_unused: str) -> None:
    """Refuses what ``trainer`` cannot honour, before the model loads.

    Raises:
        ValueError: ``--stock-find-unused`` on a ddp_ft trainer, or a ddp_ft-only setting on a stock one.
    """
    if find_unused not in FIND_UNUSED:
        raise ValueError(f"--stock-find-unused {find_unused!r}: choose one of {', '.join(FIND_UNUSED)}.")
    if trainer not in STOCK_TRAINERS:
        if find_unused != "trainer":
            raise ValueError(
                f"--stock-find-unused {find_unused} sets torch DDP's find_unused_parameters for --trainer stock-hf "
                f"or stock-trl; --trainer {trainer} trains with BucketedDDP, whose setting is "
                "--find-unused-parameters."
            )
        return
    if settings.train.balance_ranks:
        raise ValueError(
            f"balance_ranks is on: --trainer {trainer} samples as the stock Trainer does and has no balanced plan. "
            "Pass --no-balance-ranks (the stock order), or use --trainer hf / trl."
        )
    if settings.ddp.bucket_cap_mb == AUTO:
        raise ValueError(
            f"bucket_cap_mb='auto' is BucketedDDP's trial: --trainer {trainer} runs torch DDP. Give a number of MiB."
        )
    default = DDPSettings()
    changed = [
        f.name
        for f in fields(DDPSettings)
        if f.name not in _PASSED_ON and getattr(settings.ddp, f.name) != getattr(default, f.name)
    ]
    if changed:
        raise ValueError(
            f"{', '.join(changed)}: BucketedDDP settings that --trainer {trainer} (torch DDP through the stock "
            "Trainer) does not take. Leave them at their defaults; torch DDP's find_unused_parameters is "
            "--stock-find-unused."
        )
    if run_hooks_installed():  # a harness installs them on every rank
        raise ValueError(
            f"run hooks are installed (ddp_ft.training.hooks, as the fault tests do): they need a ddp_ft trainer, "
            f"not --trainer {trainer}."
        )


def stock_ddp_arguments(settings: RunSettings, find_unused: str) -> dict:
    """The ``ddp_*`` TrainingArguments that carry the run's DDP settings to torch DDP."""
    return dict(
        ddp_find_unused_parameters=None if find_unused == "trainer" else find_unused == "true",
        ddp_bucket_cap_mb=float(settings.ddp.bucket_cap_mb),
        ddp_broadcast_buffers=settings.ddp.broadcast_buffers,
    )


def build_stock_trainer(trainer: str, arguments: dict, settings: RunSettings, find_unused: str, **kwargs):
    """Builds the stock trainer with ``ThroughputCallback`` first in line.

    Args:
        trainer (str): one of ``STOCK_TRAINERS``.
        arguments (dict): the recipe's TrainingArguments or SFTConfig values.
        settings (RunSettings): the run.
        find_unused (str): one of ``FIND_UNUSED``.
        **kwargs: the trainer's model, data sets, collator and processing class.

    Returns:
        Trainer: the stock trainer.
    """
    from transformers import Trainer, TrainingArguments

    arguments = {**arguments, **stock_ddp_arguments(settings, find_unused)}
    if trainer == "stock-trl":
        from .trl import SFTConfig, SFTTrainer  # trl is optional

        stock = evaluating_every_row(SFTTrainer)(args=SFTConfig(**arguments), **kwargs)
    else:
        stock = evaluating_every_row(Trainer)(args=TrainingArguments(**arguments), **kwargs)
    handler = getattr(stock.accelerator, "ddp_handler", None)
    used = getattr(handler, "find_unused_parameters", arguments["ddp_find_unused_parameters"])
    record = {"trainer": trainer, "ddp": "torch", "find_unused_parameters": used}
    record["bucket_cap_mb"] = arguments["ddp_bucket_cap_mb"]
    record["backend"] = arguments.get("ddp_backend")
    stock.callback_handler.callbacks.insert(0, ThroughputCallback(ddp_config=record))
    logger.info(
        "%s: torch DDP through the stock Trainer (find_unused_parameters=%s, bucket_cap_mb=%s), no ddp_ft class",
        trainer,
        used,
        arguments["ddp_bucket_cap_mb"],
    )
    return stock
