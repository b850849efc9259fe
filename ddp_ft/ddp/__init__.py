"""BucketedDDP: ddp_ft's own bucketed, overlapped DistributedDataParallel. Knows nothing of transformers."""

from .autotune import BucketCandidate, BucketChoice
from .buckets import BucketSpec, ParamSpec, compute_bucket_assignment
from .comm_hooks import COMM_HOOKS, GradBucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from .settings import COMM_HOOK_CHOICES, DDPSettings
from .stats import CommStats
from .wrapper import BucketedDDP

__all__ = [
    "COMM_HOOKS",
    "COMM_HOOK_CHOICES",
    "BucketCandidate",
    "BucketChoice",
    "BucketSpec",
    "BucketedDDP",
    "CommStats",
    "DDPSettings",
    "GradBucket",
    "ParamSpec",
    "allreduce_hook",
    "bf16_compress_hook",
    "compute_bucket_assignment",
    "fp16_compress_hook",
]
