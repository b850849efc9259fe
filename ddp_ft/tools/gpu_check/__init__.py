"""The first thing to run on a CUDA host (``make gpu-check``).

It runs one process, then two where there are two GPUs. Every process runs these checks:

- ``dtype``: the compute dtype picked for the device; no bfloat16 below compute capability 8.0.
- ``grads_equal_torch_ddp``: BucketedDDP's gradients match torch DDP's on the same QLoRA model and data.
  GPU kernels need not be deterministic, so the match is within the dtype's tolerance.
- ``no_sync``: no all-reduce under ``no_sync``, and one per bucket on the synced step.
- ``qlora_run``: a short run's speed, memory and exposed communication; it fails on a non-finite loss.

The exit status is non-zero on any failure, crash or timeout.
Modules, each importing only those before it: ``settings``, ``checks``, ``worker``, ``orchestrator``.
"""

from .checks import (
    COMPARE_BATCH,
    COMPARE_CAPS_MB,
    GRAD_TOL,
    INJECT_ENV,
    check_dtype,
    compare_with_torch_ddp,
    qlora_run,
    run_checks,
)
from .orchestrator import format_report, plan_world_sizes, run_gpu_check, run_phase
from .settings import Check, GpuCheckSettings
from .worker import merge_ranks

__all__ = [
    "COMPARE_BATCH",
    "COMPARE_CAPS_MB",
    "GRAD_TOL",
    "INJECT_ENV",
    "Check",
    "GpuCheckSettings",
    "check_dtype",
    "compare_with_torch_ddp",
    "format_report",
    "merge_ranks",
    "plan_world_sizes",
    "qlora_run",
    "run_checks",
    "run_gpu_check",
    "run_phase",
]
