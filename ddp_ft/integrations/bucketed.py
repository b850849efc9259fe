"""Any ``transformers.Trainer`` subclass with BucketedDDP: ``bucketed(DPOTrainer)``.

The subclass keeps its arguments, data preparation, loss and logs.
TRL's trainers are made on first use, so importing ddp_ft imports no trl.
"""

from __future__ import annotations

import functools
import logging

from .trainer import BucketedTrainer

logger = logging.getLogger(__name__)

# TRL's trainers by ddp_ft's name; SFTTrainer has its own class.
TRL_TRAINERS = {
    "BucketedDPOTrainer": "DPOTrainer",
    "BucketedKTOTrainer": "KTOTrainer",
    "BucketedRewardTrainer": "RewardTrainer",
    "BucketedRLOOTrainer": "RLOOTrainer",
    "BucketedGRPOTrainer": "GRPOTrainer",
}
# TRL's trainers that generate batches while training; their sampler repeats prompts over ranks.
ONLINE_TRAINERS = ("GRPOTrainer", "RLOOTrainer")
# TRL classes refused by name, with their subclasses, and why.
_ASYNC = (
    "trains on completions that a rollout worker generates on a vLLM server beside the training loop, with rank 0 "
    "dispatching each step's batches to the other ranks; it cannot run without that server, so no test proves that "
    "BucketedDDP keeps its steps exactly data-parallel. Train it with the stock class (torch DDP, through Accelerate)"
)
REFUSED = {
    ("trl.experimental.async_grpo.async_grpo_trainer", "AsyncGRPOTrainer"): _ASYNC,
    ("trl.experimental.async_distillation.async_distillation_trainer", "AsyncDistillationTrainer"): _ASYNC,
}


def generates_online(trainer_class: type) -> bool:
    """Whether ``trainer_class`` is, or derives from, one of TRL's :data:`ONLINE_TRAINERS`."""
    return any(c.__module__.startswith("trl.") and c.__name__ in ONLINE_TRAINERS for c in trainer_class.__mro__)


def _online_init(self, *args, balance_ranks: bool = False, **kwargs) -> None:
    """``BucketedTrainer.__init__`` with the stock sampling, warning once if ``balance_ranks`` was asked."""
    BucketedTrainer.__init__(self, *args, balance_ranks=False, **kwargs)
    if balance_ranks and self.args.process_index == 0:
        logger.warning(
            "%s: balance_ranks=True is off. Its plan splits tokenized rows over the ranks, but this trainer "
            "generates its completions while it trains and repeats each prompt over the ranks with its own sampler; "
            "it trains with that sampler.",
            type(self).__name__,
        )


@functools.cache
def bucketed(trainer_class: type) -> type:
    """``trainer_class`` training multi-process runs with BucketedDDP, made once per class.

    It takes ``trainer_class``'s arguments plus ``ddp_settings`` and ``balance_ranks``.
    TRL's online trainers keep their own sampler: their rows are prompts.

    Args:
        trainer_class (type): a subclass of ``transformers.Trainer``.

    Returns:
        type: ``Bucketed<Name>``, or ``trainer_class`` when it is bucketed already.

    Raises:
        TypeError: not a ``transformers.Trainer``, or a class of :data:`REFUSED`.

    Example:
        >>> from trl import DPOTrainer
        >>> trainer = bucketed(DPOTrainer)(model=model, args=dpo_args, train_dataset=pairs)
    """
    from transformers import Trainer

    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(
            f"bucketed({trainer_class!r}): not a subclass of transformers.Trainer, so there is no Trainer for "
            "BucketedDDP to take over. Pass a Trainer class (TRL's DPOTrainer, your own Trainer subclass); for a "
            "loop of your own, use BucketedAccelerator or BucketedDDP."
        )
    if issubclass(trainer_class, BucketedTrainer):
        return trainer_class
    for base in trainer_class.__mro__:
        reason = REFUSED.get((base.__module__, base.__name__))
        if reason is not None:
            raise TypeError(f"bucketed({trainer_class.__name__}): {base.__module__}.{base.__name__} {reason}.")
    name = f"Bucketed{trainer_class.__name__}"
    doc = (
        f"``{trainer_class.__module__}.{trainer_class.__qualname__}`` that trains multi-process runs with "
        "BucketedDDP; its arguments, plus ``BucketedTrainer``'s ``ddp_settings`` and ``balance_ranks``."
    )
    namespace = {"__doc__": doc, "__module__": __name__}
    if generates_online(trainer_class):
        namespace["__doc__"] += " It generates online, so ``balance_ranks=True`` is off (logged once)."
        namespace["__init__"] = _online_init
    return type(name, (BucketedTrainer, trainer_class), namespace)


def trl_trainer(name: str) -> type:
    """The bucketed TRL trainer ddp_ft names ``name``; imports trl."""
    import trl

    return bucketed(getattr(trl, TRL_TRAINERS[name]))
