"""BucketedDDP's settings as one typed dataclass, beside the wrapper they configure (torch only, no transformers).

``ddp_ft.training.config`` puts :class:`DDPSettings` in a run's settings and on the command line; the plugin
(``ddp_ft.integrations``) resolves it from the Trainer's and Accelerate's own DDP knobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .autotune import AUTO, TORCH_DEFAULT_CAP_MB
from .comm_hooks import COMM_HOOKS, allreduce_hook, check_powersgd_buckets
from .ranges import DDP_RANGES, check_ranges
from .timeline import BackwardRecorder
from .wrapper import BucketedDDP

COMM_HOOK_CHOICES = (*COMM_HOOKS, "powersgd")
"""``DDPSettings.comm_hook`` values: the built-in hooks by name, and torch's PowerSGD."""
BACKEND_CHOICES = ("auto", "nccl", "gloo")
"""``DDPSettings.backend`` values, as ``ddp_ft.distributed.devices`` takes them (this room imports nothing of it)."""


@dataclass
class DDPSettings:
    """BucketedDDP knobs (same names and meanings as torch DDP's)."""

    bucket_cap_mb: float | str = field(
        default=25.0,
        metadata={
            "help": "Gradient bucket size cap in MiB, or 'auto': time a few layouts over the first synced steps and "
            "keep the fastest (logged; opt-in)."
        },
    )
    first_bucket_cap_mb: float = field(default=1.0, metadata={"help": "Cap of the first bucket (starts comm early)."})
    gradient_as_bucket_view: bool = field(default=True, metadata={"help": "param.grad as views into the buckets."})
    find_unused_parameters: bool = field(
        default=False, metadata={"help": "Reduce trainable parameters that got no gradient as zero instead of failing."}
    )
    broadcast_buffers: bool = field(default=True, metadata={"help": "Broadcast buffers from rank 0 each synced step."})
    comm_hook: str = field(
        default="allreduce",
        metadata={"help": f"Gradient averaging: {', '.join(COMM_HOOK_CHOICES)} (torch's PowerSGD, error feedback on)."},
    )
    powersgd_rank: int = field(default=4, metadata={"help": "PowerSGD: rank of the low-rank gradient approximation."})
    powersgd_start_iter: int = field(
        default=10, metadata={"help": "PowerSGD: plain all-reduce for this many synced steps first (torch: >= 2)."}
    )
    backend: str = field(
        default="auto",
        metadata={
            "help": "Process-group backend (TrainingArguments' ddp_backend): auto (NCCL on CUDA, gloo on the CPU), "
            "nccl, or gloo, which also reduces CUDA tensors and lets the processes share one GPU when exactly one is "
            "visible (slower; for checks on a one-GPU host)."
        },
    )
    ddp_timeout: int = field(
        default=600,
        metadata={"help": "Process-group timeout in seconds: a dead or stuck rank fails the others after this long."},
    )

    def __post_init__(self) -> None:
        check_ranges(self, DDP_RANGES)  # each number's own range (NaN too: it would put every gradient in one bucket)
        if self.comm_hook not in COMM_HOOK_CHOICES:
            raise ValueError(f"comm_hook={self.comm_hook!r}: choose one of {', '.join(COMM_HOOK_CHOICES)}.")
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"backend={self.backend!r}: choose one of {', '.join(BACKEND_CHOICES)}.")
        if self.bucket_cap_mb == AUTO and self.comm_hook == "powersgd":
            raise ValueError(
                "bucket_cap_mb='auto' with comm_hook='powersgd': PowerSGD keeps its state per bucket index, which "
                "the trial's layout changes would scramble. Give bucket_cap_mb a number, or another comm_hook."
            )

    def record_backward(self, module: torch.nn.Module) -> BackwardRecorder:
        """At world size 1, when each bucket :meth:`wrap` would build becomes ready, with nothing communicated.

        ``bucket_cap_mb="auto"`` records the layout its trial starts from; PowerSGD's buckets count their raw bytes.
        """
        cap = TORCH_DEFAULT_CAP_MB if self.bucket_cap_mb == AUTO else self.bucket_cap_mb
        hook = COMM_HOOKS.get(self.comm_hook, allreduce_hook)
        return BackwardRecorder(module, cap, self.first_bucket_cap_mb, hook)

    def wrap(self, module: torch.nn.Module) -> BucketedDDP:
        """``module`` in a BucketedDDP configured by these settings (comm hook registered).

        Raises:
            ValueError: ``backend`` names another backend than the process group's, which started before the wrap.
        """
        running = dist.get_backend() if dist.is_initialized() else None
        if self.backend != "auto" and running not in (None, self.backend):
            raise ValueError(
                f"backend={self.backend!r} but the process group runs {running}: it starts before the wrap. Start it "
                "with the same backend: ddp_ft.distributed.init_distributed(backend=...), TrainingArguments("
                "ddp_backend=...) or Accelerator's, or leave backend at 'auto'."
            )
        wrapped = BucketedDDP(
            module,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_cap_mb=self.first_bucket_cap_mb,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            find_unused_parameters=self.find_unused_parameters,
            broadcast_buffers=self.broadcast_buffers,
        )
        if self.comm_hook == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

            check_powersgd_buckets(
                wrapped.bucket_sizes,
                wrapped.process_group,
                "comm_hook='powersgd'",
                "--first-bucket-cap-mb and --bucket-cap-mb, or DDPSettings(first_bucket_cap_mb=, bucket_cap_mb=), "
                "at least {mb}",
            )
            state = powersgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.powersgd_start_iter,
            )
            wrapped.register_comm_hook(state, powersgd.powerSGD_hook)
        elif self.comm_hook != "allreduce":
            wrapped.register_comm_hook(None, COMM_HOOKS[self.comm_hook])
        return wrapped
