"""The first thing to run on a CUDA host (``make gpu-check``): do BucketedDDP, the 4-bit stack and the dtype choice
work on these GPUs, and what does a short QLoRA run cost?

One process, then two when there are two GPUs or more (on ``--device cpu``: gloo, always two), each a fresh group of
spawned processes on their own devices, exactly as torchrun would lay them out. Every process runs:

- ``dtype``: the compute dtype ``precision_for`` picks for its device, and why; bfloat16 never below compute
  capability 8.0, where ``torch.cuda.is_bf16_supported()`` can still say True (emulation).
- ``grads_equal_torch_ddp``: BucketedDDP and ``torch.nn.parallel.DistributedDataParallel`` wrap the same QLoRA model
  (embedded tiny Qwen3, NF4, LoRA, non-reentrant checkpointing) and see the same data: one micro-step under
  ``no_sync`` and one synced; every trainable gradient finite, non-zero and equal to torch DDP's within the tolerance
  of the compute dtype (the project's tests ask bitwise equality on CPU/gloo; GPU kernels such as the attention
  backward need not be deterministic between two model copies), and identical on all ranks.
- ``no_sync``: the backward under ``no_sync`` launched no all-reduce (BucketedDDP's counters) and, with two ranks,
  left different gradients on them (nothing was averaged behind the counters' back); the synced one launched one
  all-reduce per bucket.
- ``qlora_run``: a short run with the project's defaults (LoRA r=16, AdamW, gradient accumulation under
  ``no_sync``, the loss scaler in float16): tokens/s, step time, peak memory (CUDA allocator: allocated and
  reserved; CPU: peak RSS) and BucketedDDP's exposed communication per step. It fails on a non-finite loss, on a
  float16 run whose scaler skipped every step, or on a wrong number of all-reduces per step.

Rank 0 gathers every rank's checks; the orchestrating process prints a PASS/FAIL table, writes the JSON, and its exit
status is non-zero on any failure, a crashed rank or a phase past its timeout.

One module per part, each importing only the ones before it:

* ``settings``: :class:`GpuCheckSettings` and :class:`Check`;
* ``checks``: one process's checks (:func:`check_dtype`, :func:`compare_with_torch_ddp`, :func:`qlora_run`,
  :func:`run_checks`);
* ``worker``: a spawned process (``run_worker``, the ``mp.start_processes`` target) and :func:`merge_ranks`;
* ``orchestrator``: :func:`plan_world_sizes`, :func:`run_phase`, :func:`run_gpu_check`, :func:`format_report`.
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
