"""BucketedDDP for Accelerate, the HF Trainer and TRL: one-line swaps for ``Accelerator``, ``Trainer`` and
``SFTTrainer`` (``BucketedSFTTrainer`` imports trl, an optional dependency: ``pip install ".[trl]"`` in a clone, or ``pip install "trl>=1.16,<2"``)."""

from .accelerate import BucketedAccelerator
from .callbacks import ThroughputCallback
from .trainer import BucketedTrainer

__all__ = ["BucketedAccelerator", "BucketedSFTTrainer", "BucketedTrainer", "ThroughputCallback"]


def __getattr__(name: str):
    if name == "BucketedSFTTrainer":  # imported on first use, so ``import ddp_ft.integrations`` needs no trl
        from .trl import BucketedSFTTrainer

        return BucketedSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
