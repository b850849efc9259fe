"""Fewer kernels per step, opt-in: Liger's fused Qwen3 kernels (``--liger``) and ``torch.compile`` (``--compile``).

``check_kernel_settings`` refuses either where it cannot work, from the settings and the device alone, so both entry
points stop before anything loads (``ddp_ft.setup.check_run_settings``). The plain loop then applies them itself:
``apply_liger_to_qwen3`` before the model is built, ``compile_repeated_blocks`` on the built model before BucketedDDP
wraps it. The recipe hands both to the Trainer instead (``use_liger_kernel``, ``torch_compile``).

Neither is a default: their speed and memory on a GPU, against the same run without them, are not measured yet
(issue 27). On this project's CPU, ``--compile`` of the tiny model under BucketedDDP gives the uncompiled run's
gradients to ~1e-7 (``tests/test_kernels.py``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

LIGER_INSTALL = 'pip install "ddp_ft[liger]"'  # the optional extra that brings liger-kernel (and Triton with it)


def check_kernel_settings(
    liger: bool,
    compile: bool,
    device: torch.device,
    find_spec: Callable[[str], object] = importlib.util.find_spec,
    which: Callable[[str], str | None] = shutil.which,
) -> None:
    """Refuse ``--liger`` and ``--compile`` where they cannot work on ``device``, before anything loads.

    Args:
        liger (bool): ``ModelSettings.liger``.
        compile (bool): ``ModelSettings.compile``.
        device (torch.device): this rank's device.
        find_spec (Callable): whether a module is installed (``importlib.util.find_spec``; injectable for tests).
        which (Callable): where an executable is (``shutil.which``; injectable for tests).

    Raises:
        ValueError: ``--liger`` off CUDA, without Triton or without liger-kernel; ``--compile`` on the CPU without the
            C++ compiler TorchInductor builds its kernels with, or on CUDA without Triton; each naming the setting and
            the fix.
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
        if device.type == "cuda":
            if find_spec("triton") is None:
                raise ValueError(
                    "--compile (compile: true) on CUDA: TorchInductor writes its GPU kernels in Triton, which is not "
                    "installed. Install the CUDA build of torch (it brings Triton) or `pip install triton`; or drop "
                    "--compile."
                )
        elif device.type == "cpu":
            compiler = os.environ.get("CXX", "g++")
            if which(compiler) is None:
                raise ValueError(
                    f"--compile (compile: true) on the CPU: TorchInductor builds its CPU kernels with a C++ compiler, "
                    f"and {compiler!r} (the CXX variable, default g++) is not on PATH. Install one (`apt-get install "
                    "g++`) or point CXX at it; or drop --compile."
                )


def apply_liger_to_qwen3(model_name_or_path: str) -> None:
    """Liger's Qwen3 patch, before the model is built: RoPE, RMSNorm, SwiGLU and the fused linear cross-entropy.

    Liger's documented entry point (``liger_kernel.transformers.apply_liger_kernel_to_qwen3``) swaps the classes and
    functions of transformers' ``modeling_qwen3`` for this process, so the model ``from_pretrained`` builds next has
    Liger's layers (bitsandbytes then quantises their linear layers as any others). In training the loss comes from
    the last hidden states and the lm_head weight in chunks, never the logits (151,936 per token on Qwen3-4B); in
    evaluation the logits are computed as before.

    Raises:
        ValueError: the model is not a Qwen3 (its ``config.json``'s ``model_type``), naming --liger.
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


def compile_repeated_blocks(model: torch.nn.Module) -> int:
    """``torch.compile`` each block of the model's repeated layers (the decoder layers), in place.

    Regional compilation (torch's recipe, and Accelerate's ``compile_regions``): the layers run the same code, so
    one compilation serves all of them, where compiling the whole model traces each layer anew (tiny Qwen3 on this
    project's CPU: the first step took 18 s regionally, 50 to 100 s whole). In place (``nn.Module.compile``), so
    parameter names, ``state_dict`` keys, BucketedDDP's layout and checkpoints are those of the uncompiled model. The
    rest (embedding, final norm, lm_head and loss) runs eagerly. Gradient checkpointing wraps each compiled layer, as
    it wrapped the layer.

    Returns:
        int: how many blocks were compiled.

    Raises:
        ValueError: the model has no ``ModuleList`` of blocks of one class, naming --compile.
    """
    blocks: list[torch.nn.Module] = []
    inside: list[str] = []  # the lists taken: a list of blocks within a block is compiled with it, not again
    for name, module in model.named_modules():
        repeated = isinstance(module, torch.nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1
        if repeated and not any(name.startswith(f"{outer}.") for outer in inside):
            inside.append(name)
            blocks.extend(module)
    if not blocks:
        raise ValueError(
            f"--compile (compile: true) compiles the model's repeated layers, and {type(model).__name__} has no "
            "ModuleList of layers of one class: drop --compile."
        )
    for block in blocks:
        block.compile()
    logger.info("--compile: %d %s blocks compiled (regional compilation)", len(blocks), type(blocks[0]).__name__)
    return len(blocks)
