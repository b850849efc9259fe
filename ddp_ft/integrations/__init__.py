"""BucketedDDP for Accelerate, the HF Trainer and TRL.

TRL's trainers are imported on first use, so this package needs no trl.
"""

from .accelerate import BucketedAccelerator
from .bucketed import TRL_TRAINERS, bucketed
from .callbacks import ThroughputCallback
from .trainer import BucketedTrainer

__all__ = [
    "BucketedAccelerator",
    "BucketedDPOTrainer",
    "BucketedGRPOTrainer",
    "BucketedKTOTrainer",
    "BucketedRLOOTrainer",
    "BucketedRewardTrainer",
    "BucketedSFTTrainer",
    "BucketedTrainer",
    "ThroughputCallback",
    "bucketed",
]


def __getattr__(name: str):
    if name == "BucketedSFTTrainer":  # imported on first use
        from .trl import BucketedSFTTrainer

        return BucketedSFTTrainer
    if name in TRL_TRAINERS:
        from .bucketed import trl_trainer

        return trl_trainer(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
