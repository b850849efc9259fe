"""Performance traps in a user's script: correct runs that are many times slower than needed.

Each is warned once, on rank 0, with the fix; nothing is refused:

- **4-bit layers computing in float32** (``dtype``), checked when a model is prepared.
- **An idle device with memory to spare** (``idle``), one step measured, on CUDA only, unless the micro-batch
  probe sized the run.
"""

from .dtype import bnb_config_fix, check_4bit_compute_dtype, command_line_fix
from .idle import (
    IDLE_SHARE,
    MEASURED_STEP,
    CudaStepProfiler,
    IdleDeviceCheck,
    MicroBatchAdvice,
    StepProfiler,
    StepUsage,
    accelerate_fix,
    busy_ns,
    larger_micro_batch,
    loop_fix,
    sized_by_probe,
    trainer_fix,
    watch_idle_device,
)

__all__ = [
    "IDLE_SHARE",
    "MEASURED_STEP",
    "CudaStepProfiler",
    "IdleDeviceCheck",
    "MicroBatchAdvice",
    "StepProfiler",
    "StepUsage",
    "accelerate_fix",
    "bnb_config_fix",
    "busy_ns",
    "check_4bit_compute_dtype",
    "command_line_fix",
    "larger_micro_batch",
    "loop_fix",
    "sized_by_probe",
    "trainer_fix",
    "watch_idle_device",
]
