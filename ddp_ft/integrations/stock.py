"""The stock peers of the recipe: the same model, data and arguments on ``transformers.Trainer`` or TRL's
``SFTTrainer`` with torch DDP, with no ddp_ft class in the training path, so a run measures what a user would run
instead (``--trainer stock-hf``, ``--trainer stock-trl``).

Only :class:`~ddp_ft.integrations.callbacks.ThroughputCallback` is added, first in line, so the run writes the same
``metrics.jsonl`` as the ddp_ft trainers and is timed the same way (from ``on_step_begin`` to ``on_step_end``,
non-padding tokens from the Trainer's ``num_input_tokens_seen``). The stock Trainer gathers that count on every
micro-step; that cost is part of what is measured. Evaluation covers every held-out row, as on the ddp_ft trainers
(``ddp_ft.integrations.recipe_eval``: the eval loader only, outside the training path).

A setting the stock classes cannot honour is refused before the model loads, never dropped: the balanced plan (pass
``--no-balance-ranks``), BucketedDDP's own knobs away from their defaults, ``bucket_cap_mb='auto'``, and installed run
hooks (the fault tests').
``bucket_cap_mb``, ``broadcast_buffers`` and ``ddp_timeout`` become the Trainer's ``ddp_*`` arguments; torch DDP's
``find_unused_parameters`` is ``--stock-find-unused``: the Trainer's own choice (True for a PeftModel, which is not a
``PreTrainedModel``), or forced.
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
FIND_UNUSED = ("trainer", "true", "false")  # --stock-find-unused: the Trainer's default, or forced
# BucketedDDP settings the stock path passes on to torch DDP through TrainingArguments (ddp_*).
_PASSED_ON = ("bucket_cap_mb", "broadcast_buffers", "ddp_timeout")


def check_stock_settings(settings: RunSettings, trainer: str, find_unused: str) -> None:
    """Refuse what ``trainer`` cannot honour, before the model loads.

    Raises:
        ValueError: ``--stock-find-unused`` other than ``trainer`` on a ddp_ft trainer; on a stock one, the balanced
            plan, ``bucket_cap_mb='auto'``, a BucketedDDP setting torch DDP is not given through the Trainer, or
            installed run hooks (``ddp_ft.training.hooks``); each naming the setting and the fix.
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
    if run_hooks_installed():  # a harness installs them on every rank, where a rank's own may do nothing
        raise ValueError(
            f"run hooks are installed (ddp_ft.training.hooks, as the fault tests do): they need a ddp_ft trainer, "
            f"not --trainer {trainer}."
        )


def stock_ddp_arguments(settings: RunSettings, find_unused: str) -> dict:
    """The TrainingArguments' ``ddp_*`` values that carry the run's DDP settings to torch DDP."""
    return dict(
        ddp_find_unused_parameters=None if find_unused == "trainer" else find_unused == "true",
        ddp_bucket_cap_mb=float(settings.ddp.bucket_cap_mb),
        ddp_broadcast_buffers=settings.ddp.broadcast_buffers,
    )


def build_stock_trainer(trainer: str, arguments: dict, settings: RunSettings, find_unused: str, **kwargs):
    """``transformers.Trainer`` (``stock-hf``) or ``trl.SFTTrainer`` (``stock-trl``, with ``sft`` arguments in
    ``arguments``) on ``arguments`` plus the DDP values, and ``ThroughputCallback`` first in line.

    Args:
        trainer (str): one of ``STOCK_TRAINERS``.
        arguments (dict): the recipe's TrainingArguments (or SFTConfig) values.
        settings (RunSettings): the run (its DDP settings).
        find_unused (str): one of ``FIND_UNUSED``.
        **kwargs: the trainer's model, data sets, collator and processing class.
    """
    from transformers import Trainer, TrainingArguments

    arguments = {**arguments, **stock_ddp_arguments(settings, find_unused)}
    if trainer == "stock-trl":
        from .trl import SFTConfig, SFTTrainer  # the optional trl, imported here only

        stock = evaluating_every_row(SFTTrainer)(args=SFTConfig(**arguments), **kwargs)
    else:
        stock = evaluating_every_row(Trainer)(args=TrainingArguments(**arguments), **kwargs)
    handler = getattr(stock.accelerator, "ddp_handler", None)  # what the Trainer gives torch DDP
    used = getattr(handler, "find_unused_parameters", arguments["ddp_find_unused_parameters"])
    record = {"trainer": trainer, "ddp": "torch", "find_unused_parameters": used}
    record["bucket_cap_mb"] = arguments["ddp_bucket_cap_mb"]
    stock.callback_handler.callbacks.insert(0, ThroughputCallback(ddp_config=record))
    logger.info(
        "%s: torch DDP through the stock Trainer (find_unused_parameters=%s, bucket_cap_mb=%s), no ddp_ft class",
        trainer,
        used,
        arguments["ddp_bucket_cap_mb"],
    )
    return stock
