"""ddp_ft: QLoRA fine-tuning on one or many GPUs through BucketedDDP, a bucketed, overlapped DDP."""

from .ddp import BucketedDDP, CommStats
from .distributed import keep_upstream_notices_to_rank_zero

keep_upstream_notices_to_rank_zero()  # before bitsandbytes is imported, where ddp_ft comes first

__version__ = "0.1.0"
__all__ = ["BucketedDDP", "CommStats", "__version__"]
