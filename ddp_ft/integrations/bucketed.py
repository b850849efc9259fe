"""Any ``transformers.Trainer`` subclass with BucketedDDP: ``bucketed(DPOTrainer)`` is ``BucketedTrainer`` mixed in
before it, as ``BucketedSFTTrainer`` is before ``SFTTrainer``.

The subclass keeps its arguments, data preparation, loss and logs; the Trainer's accelerator is adopted, so the
model trains wrapped in BucketedDDP. TRL's trainers are made on first use (``ddp_ft.integrations``' names), so
importing ddp_ft imports no trl.
"""

from __future__ import annotations

import functools
import logging

from .trainer import BucketedTrainer

logger = logging.getLogger(__name__)

# TRL's trainers by the name ddp_ft gives them (``SFTTrainer`` has its own class: ``ddp_ft.integrations.trl``).
TRL_TRAINERS = {
    "BucketedDPOTrainer": "DPOTrainer",
    "BucketedKTOTrainer": "KTOTrainer",
    "BucketedRewardTrainer": "RewardTrainer",
    "BucketedRLOOTrainer": "RLOOTrainer",
    "BucketedGRPOTrainer": "GRPOTrainer",
}
# TRL's trainers that generate their training batches while they train: their rows are prompts, and their own
# sampler repeats each prompt over the ranks, so the balanced plan cannot apply.
ONLINE_TRAINERS = ("GRPOTrainer", "RLOOTrainer")
# TRL classes refused by name, their subclasses too: why, in a sentence that ends with what to do instead.
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
    """``BucketedTrainer.__init__`` with the stock sampling: ``balance_ranks=True`` is turned off, and logged once."""
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
    """``trainer_class`` training multi-process runs with BucketedDDP: ``class Bucketed<Name>(BucketedTrainer,
    trainer_class)``, made once per class.

    Its arguments are ``trainer_class``'s, plus ``BucketedTrainer``'s ``ddp_settings`` and ``balance_ranks`` (off by
    default: the stock sampling). For TRL's online trainers (GRPO, RLOO and their subclasses) ``balance_ranks=True``
    is turned off with a warning on rank 0: their rows are prompts, generated into completions while they train. A
    class that is bucketed already is returned as it is.

    Args:
        trainer_class (type): a subclass of ``transformers.Trainer``: TRL's, an experimental one, your own.

    Returns:
        type: the bucketed class, named ``Bucketed`` + its name.

    Raises:
        TypeError: a class that is not a ``transformers.Trainer``, naming it and what to pass instead; a class of
            :data:`REFUSED` or a subclass of one, naming it and why.
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
    """The bucketed TRL trainer ddp_ft names ``name`` (``BucketedDPOTrainer``...); imports trl."""
    import trl

    return bucketed(getattr(trl, TRL_TRAINERS[name]))
