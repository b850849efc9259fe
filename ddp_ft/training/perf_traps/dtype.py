"""4-bit layers computing in float32 while the run computes in a half type.

``BitsAndBytesConfig`` defaults ``bnb_4bit_compute_dtype`` to float32. bitsandbytes casts each layer's input to
that dtype, out of autocast's reach. A layer without a compute dtype takes its first input's dtype, which is
the input embeddings' (float32 after ``prepare_model_for_kbit_training``).
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable

import torch

from ..model.precision import BF16_MIN_CAPABILITY

logger = logging.getLogger(__name__)

_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
_WARNED_MODELS: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # warned once per model


def _stream_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype reaching the 4-bit layers: the input embeddings', else float32."""
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    weight = getattr(embeddings, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else torch.float32


def _half_run(
    model: torch.nn.Module, mixed_precision: str, stream: torch.dtype, device: torch.device, capability
) -> tuple[torch.dtype, str, bool] | None:
    """The half type the 4-bit layers should use, why, and whether to train in it; or None."""
    if mixed_precision in _HALF:
        dtype = _HALF[mixed_precision]
        return dtype, f"this run computes in {_name(dtype)} (mixed_precision={mixed_precision!r})", False
    if stream in _HALF.values():
        return stream, f"this run computes in {_name(stream)} (the model's input embeddings)", False
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    for dtype in (torch.bfloat16, torch.float16):
        if dtype in trained:
            held = f"the trained weights are in {_name(dtype)} (TRL's SFTTrainer casts a 4-bit model's adapters)"
            return dtype, held, False
    if device.type == "cuda" and tuple(capability or torch.cuda.get_device_capability(device)) >= BF16_MIN_CAPABILITY:
        return torch.bfloat16, "this float32 run is on a GPU with native bfloat16", True
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bnb_config_fix(dtype: torch.dtype, train_too: bool) -> str:
    """How a script that loads its own 4-bit model sets the compute dtype."""
    also = " and train in it (TrainingArguments(bf16=True), Accelerator(mixed_precision='bf16'))" if train_too else ""
    return (
        f"Load with BitsAndBytesConfig(..., bnb_4bit_compute_dtype=torch.{_name(dtype)}) (float32 is its "
        f"default){also}."
    )


def command_line_fix(dtype: torch.dtype, train_too: bool) -> str:
    """How a ``ddp-ft`` command sets it: one setting for layers and autocast."""
    return f"Pass --compute-dtype {_name(dtype)}: the 4-bit layers then compute in it, and the run trains in it."


def check_4bit_compute_dtype(
    model: torch.nn.Module,
    mixed_precision: str,
    device: torch.device,
    is_main_process: bool,
    capability: tuple[int, int] | None = None,
    fix: Callable[[torch.dtype, bool], str] = bnb_config_fix,
) -> str | None:
    """Warn once per model, on the main process, about 4-bit layers computing in float32 for nothing.

    It warns when a ``Linear4bit`` computes in float32 while the run uses a half type, or on a GPU with native
    bfloat16. There float32 buys no accuracy over 4-bit weights and costs tensor-core speed. A float32 run on
    the CPU or an older GPU stays silent.

    Args:
        model (nn.Module): the model about to train.
        mixed_precision (str): Accelerate's ``mixed_precision``.
        device (torch.device): the device it trains on.
        is_main_process (bool): warn here.
        capability (tuple[int, int] | None): CUDA compute capability. Default: asked of CUDA
        fix (Callable[[torch.dtype, bool], str]): the fix in the entry point's terms. Default: :func:`bnb_config_fix`

    Returns:
        str | None: the warning, or None when nothing is wrong.
    """
    bnb = sys.modules.get("bitsandbytes")  # not imported: no 4-bit layer exists
    if bnb is None:
        return None
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    if not layers:
        return None
    stream = _stream_dtype(model)
    slow = [m for m in layers if (m.compute_dtype or stream) == torch.float32]
    if not slow:
        return None
    half = _half_run(model, mixed_precision, stream, device, capability)
    if half is None:
        return None
    dtype, run, train_too = half
    message = (
        f"ddp_ft: {len(slow)} of {len(layers)} bitsandbytes 4-bit layers compute in float32 while {run}. "
        "bitsandbytes casts each layer's input to its compute dtype and runs the dequantising matmul in it, out of "
        "autocast's reach: these matmuls, most of the model's FLOPs, run in float32, without the half-precision "
        "tensor cores (1/16 of bfloat16's rate on an A100 or H100): several times slower per step on a GPU. "
        f"{fix(dtype, train_too)}"
    )
    if is_main_process and model not in _WARNED_MODELS:
        logger.warning(message)
    _WARNED_MODELS.add(model)
    return message
