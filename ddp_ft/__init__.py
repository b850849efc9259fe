"""ddp_ft: QLoRA fine-tuning on one or many GPUs through BucketedDDP, a bucketed, overlapped DDP."""

from .ddp import BucketedDDP, CommStats
from .distributed import keep_upstream_notices_to_rank_zero

__version__ = "0.1.0"
__all__ = ["BucketedDDP", "CommStats", "__version__", "keep_upstream_notices_to_rank_zero"]
