"""4-bit layers computing in float32 while the run computes in a half type (the package docstring has the rule).

transformers' ``BitsAndBytesConfig`` sets ``bnb_4bit_compute_dtype`` to float32 when it is not given. bitsandbytes
(0.50) casts each ``Linear4bit``'s input to that dtype and runs its dequantising GEMM in it
(``torch.ops.bitsandbytes.gemm_4bit`` has no autocast rule, so ``bf16=True`` does not reach it). A layer built without
a compute dtype (None) takes its first input's dtype on its first forward (float16 input leaves it None, which also
computes in the input's dtype): in a model, the residual stream's dtype, which is the input embeddings' (float32 after
``prepare_model_for_kbit_training``).
"""

from __future__ import annotations

import logging
import sys
import weakref

import torch

from ..model.precision import BF16_MIN_CAPABILITY

logger = logging.getLogger(__name__)

_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
_WARNED_MODELS: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # each model's dtype warning, once


def _stream_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype reaching the 4-bit layers: the input embeddings' (the residual stream's), else float32."""
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    weight = getattr(embeddings, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else torch.float32


def _half_run(
    model: torch.nn.Module, mixed_precision: str, stream: torch.dtype, device: torch.device, capability
) -> tuple[torch.dtype, str, str] | None:
    """The half type the 4-bit layers should compute in, what the run does, and what else to change; or None."""
    if mixed_precision in _HALF:
        dtype = _HALF[mixed_precision]
        return dtype, f"this run computes in {_name(dtype)} (mixed_precision={mixed_precision!r})", ""
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    for dtype in (torch.bfloat16, torch.float16):
        if dtype in (stream, *trained):
            return dtype, f"this run computes in {_name(dtype)} (the model's own weights)", ""
    if device.type == "cuda" and tuple(capability or torch.cuda.get_device_capability(device)) >= BF16_MIN_CAPABILITY:
        also = " and train in it (TrainingArguments(bf16=True), Accelerator(mixed_precision='bf16'))"
        return torch.bfloat16, "this float32 run is on a GPU with native bfloat16", also
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_4bit_compute_dtype(
    model: torch.nn.Module,
    mixed_precision: str,
    device: torch.device,
    is_main_process: bool,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Warn, once per model and on the main process only, about 4-bit layers computing in float32 for nothing.

    The rule: a bitsandbytes ``Linear4bit`` computes in float32 (its ``compute_dtype``, or the stream's dtype where
    that is None) while either the run computes in a half type (``mixed_precision`` bf16/fp16, a bf16/fp16 residual
    stream, or trained weights in bf16/fp16), or it runs on a CUDA device with native bfloat16 (compute capability
    >= 8.0), where a 4-bit model's float32 compute buys no accuracy (the weights carry 4 bits) and costs the tensor
    cores' rate. A float32 run on the CPU, or on an older GPU, is the user's plain choice: silent.

    Args:
        model (nn.Module): the model about to train.
        mixed_precision (str): Accelerate's ``mixed_precision``: ``no``, ``bf16`` or ``fp16``.
        device (torch.device): the device it trains on.
        is_main_process (bool): warn here (rank 0).
        capability (tuple[int, int] | None): the CUDA device's compute capability. Default: asked of CUDA.

    Returns:
        str | None: the warning (also on the other ranks, which do not log it), or None when nothing is wrong.
    """
    bnb = sys.modules.get("bitsandbytes")  # not imported: no 4-bit layer exists, and none is imported for this
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
    dtype, run, also = half
    message = (
        f"ddp_ft: {len(slow)} of {len(layers)} bitsandbytes 4-bit layers compute in float32 (BitsAndBytesConfig's "
        f"default bnb_4bit_compute_dtype) while {run}. bitsandbytes casts each layer's input "
        "to its compute dtype and runs the dequantising matmul in it, out of autocast's reach: these matmuls, most "
        "of the model's FLOPs, run in float32, without the half-precision tensor cores (1/16 of bfloat16's rate on "
        "an A100 or H100): several times slower per step on a GPU. Load with "
        f"BitsAndBytesConfig(..., bnb_4bit_compute_dtype=torch.{_name(dtype)}){also}."
    )
    if is_main_process and model not in _WARNED_MODELS:
        logger.warning(message)
    _WARNED_MODELS.add(model)
    return message
