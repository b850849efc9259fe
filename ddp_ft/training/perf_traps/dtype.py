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
from collections.abc import Callable

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
) -> tuple[torch.dtype, str, bool] | None:
    """The half type the 4-bit layers should compute in, what the run does, and whether it should train in it too;
    or None."""
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
    """How a script that loads its own 4-bit model makes its layers compute in ``dtype``."""
    also = " and train in it (TrainingArguments(bf16=True), Accelerator(mixed_precision='bf16'))" if train_too else ""
    return (
        f"Load with BitsAndBytesConfig(..., bnb_4bit_compute_dtype=torch.{_name(dtype)}) (float32 is its "
        f"default){also}."
    )


def command_line_fix(dtype: torch.dtype, train_too: bool) -> str:
    """How a ``ddp-ft`` command does it: one setting sets the 4-bit layers' compute dtype and the run's autocast."""
    return f"Pass --compute-dtype {_name(dtype)}: the 4-bit layers then compute in it, and the run trains in it."


def check_4bit_compute_dtype(
    model: torch.nn.Module,
    mixed_precision: str,
    device: torch.device,
    is_main_process: bool,
    capability: tuple[int, int] | None = None,
    fix: Callable[[torch.dtype, bool], str] = bnb_config_fix,
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
        fix (Callable[[torch.dtype, bool], str]): the fix in the entry point's terms, from the dtype and whether to
            train in it too. Default: :func:`bnb_config_fix`

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
