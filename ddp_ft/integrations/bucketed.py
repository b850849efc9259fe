"""Any ``transformers.Trainer`` subclass with BucketedDDP: ``bucketed(DPOTrainer)`` is ``BucketedTrainer`` mixed in
before it, as ``BucketedSFTTrainer`` is before ``SFTTrainer``.

The subclass keeps its arguments, data preparation, loss and logs; the Trainer's accelerator is adopted, so the
model trains wrapped in BucketedDDP. TRL's trainers are made on first use (``ddp_ft.integrations``' names), so
importing ddp_ft imports no trl.
"""

from __future__ import annotations

import functools

from .trainer import BucketedTrainer

# TRL's trainers by the name ddp_ft gives them (``SFTTrainer`` has its own class: ``ddp_ft.integrations.trl``).
TRL_TRAINERS = {
    "BucketedDPOTrainer": "DPOTrainer",
    "BucketedKTOTrainer": "KTOTrainer",
    "BucketedRewardTrainer": "RewardTrainer",
    "BucketedRLOOTrainer": "RLOOTrainer",
    "BucketedGRPOTrainer": "GRPOTrainer",
}


@functools.cache
def bucketed(trainer_class: type) -> type:
    """``trainer_class`` training multi-process runs with BucketedDDP: ``class Bucketed<Name>(BucketedTrainer,
    trainer_class)``, made once per class.

    Its arguments are ``trainer_class``'s, plus ``BucketedTrainer``'s ``ddp_settings`` and ``balance_ranks`` (off by
    default: the stock sampling). A class that is bucketed already is returned as it is.

    Args:
        trainer_class (type): a subclass of ``transformers.Trainer``: TRL's, an experimental one, your own.

    Returns:
        type: the bucketed class, named ``Bucketed`` + its name.

    Raises:
        TypeError: a class that is not a ``transformers.Trainer``, naming it and what to pass instead.
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
    name = f"Bucketed{trainer_class.__name__}"
    doc = (
        f"``{trainer_class.__module__}.{trainer_class.__qualname__}`` that trains multi-process runs with "
        "BucketedDDP; its arguments, plus ``BucketedTrainer``'s ``ddp_settings`` and ``balance_ranks``."
    )
    return type(name, (BucketedTrainer, trainer_class), {"__doc__": doc, "__module__": __name__})


def trl_trainer(name: str) -> type:
    """The bucketed TRL trainer ddp_ft names ``name`` (``BucketedDPOTrainer``...); imports trl."""
    import trl

    return bucketed(getattr(trl, TRL_TRAINERS[name]))
