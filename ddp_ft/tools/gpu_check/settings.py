"""What ``scripts/gpu_check.py`` runs (:class:`GpuCheckSettings`) and what each check reports (:class:`Check`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...distributed.devices import DEVICE_CHOICES
from ...training.model.precision import DTYPES
from ..bench import BACKEND_CHOICES


@dataclass
class GpuCheckSettings:
    """What ``scripts/gpu_check.py`` runs."""

    device: str = field(default="auto", metadata={"help": "auto (cuda when available), cuda (NCCL) or cpu (gloo)."})
    compute_dtype: str = field(
        default="auto", metadata={"help": "auto (bfloat16 from compute capability 8.0, float16 below), or a dtype."}
    )
    backend: str = field(
        default="auto",
        metadata={
            "help": "auto (NCCL on CUDA, gloo on cpu) or gloo: on CUDA, gloo with CUDA tensors, where the processes "
            "may share one GPU (one visible: every rank on cuda:0) to exercise BucketedDDP's CUDA events and streams "
            "with real asynchronous communication on a one-GPU host."
        },
    )
    world_sizes: list[int] = field(
        default_factory=list,
        metadata={"help": "Process counts to run, in order. Default: 1, then 2 with 2+ GPUs (always 2 on cpu)."},
    )
    seq_len: int = field(default=512, metadata={"help": "Tokens per sample in the QLoRA run."})
    micro_batch: int = field(default=4, metadata={"help": "Samples per micro-step per process in the QLoRA run."})
    grad_accum: int = field(default=2, metadata={"help": "Micro-steps per optimizer step (all but the last no_sync)."})
    warmup_steps: int = field(default=2, metadata={"help": "Untimed optimizer steps before the timed ones."})
    steps: int = field(default=10, metadata={"help": "Timed optimizer steps of the QLoRA run."})
    timeout_s: float = field(default=240.0, metadata={"help": "Seconds one phase (one process count) may take."})

    def __post_init__(self) -> None:
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"device={self.device!r}: choose one of {', '.join(DEVICE_CHOICES)}.")
        if self.compute_dtype != "auto" and self.compute_dtype not in DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r}: choose auto or one of {sorted(DTYPES)}.")
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"backend={self.backend!r}: choose one of {', '.join(BACKEND_CHOICES)}.")
        for name in ("seq_len", "micro_batch", "grad_accum", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1.")
        if self.warmup_steps < 0 or self.timeout_s <= 0 or any(w < 1 for w in self.world_sizes):
            raise ValueError("warmup_steps must be >= 0, timeout_s > 0 and every world size >= 1.")


@dataclass
class Check:
    """One row of the table: a named check of one process count, and why it passed or failed."""

    name: str
    passed: bool
    detail: str
    values: dict = field(default_factory=dict)
