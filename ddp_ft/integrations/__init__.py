"""BucketedDDP for Accelerate and the HF Trainer: one-line swaps for ``Accelerator`` and ``Trainer``."""

from .accelerate import BucketedAccelerator
from .callbacks import ThroughputCallback
from .trainer import BucketedTrainer

__all__ = ["BucketedAccelerator", "BucketedTrainer", "ThroughputCallback"]
