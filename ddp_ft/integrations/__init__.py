"""BucketedDDP for Accelerate and the HF Trainer: one-line swaps for ``Accelerator`` and ``Trainer``."""

from .accelerate import BucketedAccelerator
from .trainer import BucketedTrainer, ThroughputCallback

__all__ = ["BucketedAccelerator", "BucketedTrainer", "ThroughputCallback"]
