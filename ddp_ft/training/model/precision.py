"""Which floating-point precision a run computes in, chosen once from the setting and the device.

The choice drives the 4-bit compute dtype, the load dtype, autocast, the loss scaler and the Trainer's flags.
Cards below compute capability 8.0 only emulate bfloat16, slowly, so auto gives them float16.
Under BucketedDDP, float16's scaled gradients are averaged before ``unscale_``.
So every rank skips the same steps, and the scaler's state agrees with no extra collective.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BF16_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class Precision:
    """A run's precision.

    Args:
        dtype (torch.dtype): compute dtype of the 4-bit layers and autocast.
        device_type (str): ``cuda`` or ``cpu``.
        reason (str): why this dtype, for the log.
    """

    dtype: torch.dtype
    device_type: str
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def mixed_precision(self) -> str:
        """Accelerate's name for this autocast."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, "no")

    @property
    def autocast(self) -> bool:
        """Whether the forward autocasts; off in float32."""
        return self.dtype != torch.float32

    @property
    def loss_scaling(self) -> bool:
        """Whether float16's narrow range needs a loss scaler."""
        return self.dtype == torch.float16

    def autocast_context(self) -> AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype) if self.autocast else nullcontext()

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A scaler that is a no-op unless the dtype is float16."""
        return torch.amp.GradScaler(self.device_type, enabled=self.loss_scaling)


def choose_precision(requested: str, device_type: str, capability: tuple[int, int] | None = None) -> Precision:
    """The precision for ``--compute-dtype requested`` on this device.

    ``auto``: bfloat16 from capability 8.0, float16 on older CUDA, float32 on the CPU.

    Args:
        requested (str): ``auto``, ``bfloat16``, ``float16`` or ``float32``.
        device_type (str): ``cuda`` or ``cpu``.
        capability (tuple[int, int] | None): the CUDA compute capability. Default: None.

    Returns:
        Precision: the dtype and why.

    Raises:
        ValueError: an unknown dtype, or bfloat16 on a CUDA device older than 8.0.
    """
    if requested != "auto" and requested not in DTYPES:
        raise ValueError(f"--compute-dtype {requested!r}: choose auto or one of {sorted(DTYPES)}.")
    old_gpu = device_type == "cuda" and capability is not None and tuple(capability) < BF16_MIN_CAPABILITY
    cc = f"{capability[0]}.{capability[1]}" if capability else "?"
    if requested == "bfloat16" and old_gpu:
        raise ValueError(
            f"--compute-dtype bfloat16 on a GPU of compute capability {cc}: bfloat16 needs 8.0 (Ampere) or newer; "
            "older cards (T4, V100) only emulate it, several times slower. Use --compute-dtype float16 (trained with "
            "a loss scaler) or auto."
        )
    if requested != "auto":
        return Precision(DTYPES[requested], device_type, "--compute-dtype")
    if device_type != "cuda":
        return Precision(torch.float32, device_type, "auto: float32 on the CPU")
    if old_gpu:
        return Precision(torch.float16, device_type, f"auto: compute capability {cc} < 8.0 has no native bfloat16")
    return Precision(torch.bfloat16, device_type, f"auto: compute capability {cc} has native bfloat16")


def precision_for(requested: str, device: torch.device) -> Precision:
    """``choose_precision`` for this process's device."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return choose_precision(requested, device.type, capability)
