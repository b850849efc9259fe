"""Liger's fused Qwen3 kernels (``--liger``), opt-in.

The settings are checked before anything loads (``ddp_ft.training.resolve.resolve_run``).
The plain loop patches Qwen3 itself; the recipe sets the Trainer's ``use_liger_kernel``.
Not a default: it trained slower on a GPU (``docs/performance.md``).
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
from collections.abc import Callable

import torch

from .compilation import compile_blockers, refuse_blockers

logger = logging.getLogger(__name__)

LIGER_INSTALL = 'pip install "liger-kernel>=0.7,<1"'  # ddp_ft is not on PyPI


def check_kernel_settings(
    liger: bool,
    compile: bool,
    device: torch.device,
    *,
    find_spec: Callable[[str], object] = importlib.util.find_spec,
    which: Callable[[str], str | None] = shutil.which,
) -> None:
    """Refuses ``--liger`` and ``--compile`` where they cannot work on ``device``.

    Args:
        liger (bool): ``ModelSettings.liger``.
        compile (bool): ``ModelSettings.compile``.
        device (torch.device): this rank's device.
        find_spec (Callable): whether a module is installed; injectable for tests.
        which (Callable): where an executable is; injectable for tests.

    Raises:
        ValueError: Liger off CUDA or without its packages, or compilation without its toolchain.
    """
    if liger:
        if device.type != "cuda":
            raise ValueError(
                f"--liger (liger: true): Liger's kernels are Triton kernels for CUDA GPUs, and this run is on "
                f"{device.type}. Drop --liger, or run on a GPU."
            )
        if find_spec("triton") is None:
            raise ValueError(
                "--liger (liger: true) needs Triton, which is not installed: install the CUDA build of torch (it "
                f"brings Triton) or `pip install triton`, then {LIGER_INSTALL}; or drop --liger."
            )
        if find_spec("liger_kernel") is None:
            raise ValueError(
                f"--liger (liger: true) needs the liger-kernel package, which is not installed: {LIGER_INSTALL}, or "
                "drop --liger."
            )
    if compile:
        refuse_blockers(compile_blockers(device, find_spec=find_spec, which=which), "--compile (compile: true)")


def apply_liger_to_qwen3(model_name_or_path: str) -> None:
    """Applies Liger's Qwen3 patch before the model is built.

    In training the loss comes from hidden states in chunks, never the full logits.

    Raises:
        ValueError: the model is not a Qwen3.
    """
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(model_name_or_path).model_type
    if model_type != "qwen3":
        raise ValueError(
            f"--liger (liger: true) applies Liger's Qwen3 kernels, and {model_name_or_path} is a {model_type!r} model: "
            "drop --liger, or use a Qwen3 model."
        )
    from liger_kernel.transformers import apply_liger_kernel_to_qwen3

    apply_liger_kernel_to_qwen3(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
    logger.info("--liger: Liger's Qwen3 kernels applied (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy)")
