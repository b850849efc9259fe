"""The defaults that depend on the device: fast on a GPU, unchanged on the CPU, each said once with why.

At micro-batch 1 with eager layers the host (Python, autograd, thousands of kernel launches per step) sets the pace
and the GPU idles. On one H100 a full micro-batch and compiled decoder layers trained the Qwen3-4B recipe many times
faster (``docs/entry_points.md``). So on CUDA
``micro_batch: auto`` fills the GPU (``ddp_ft.training.setup.resolve_micro_batch``; the effective batch is kept,
accumulation shrinks) and ``compile: auto`` compiles each decoder layer (``ddp_ft.training.model.compilation``). On the
CPU ``auto`` keeps the settings the CPU runs were measured with, micro-batch 1 and eager: a CPU has no separate memory
to fill, compiling costs each process its start-up time, and whether it pays on a CPU is not measured.

Each default is resolved in place before anything loads, so ``run_config.yaml`` records what ran, and said once on
rank 0. A number for ``--micro-batch`` or ``--no-compile`` turns either off. An explicit ``--compile`` where
compilation is known to break is refused (``ddp_ft.training.model.compilation.compile_blockers``); the default is turned
off there, with the reason and the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..ddp.autotune import AUTO
from .model.compilation import Blocker, compile_blockers, refuse_blockers

if TYPE_CHECKING:
    from ..distributed import DistInfo
    from .config import RunSettings

logger = logging.getLogger(__name__)

COMPILE_WHY = (
    "regional compilation of the decoder layers; one H100 trained the Qwen3-4B recipe 2.2x faster with it at "
    "micro-batch 16 (2026-11-26)"
)


def resolve_device_defaults(
    settings: RunSettings, info: DistInfo, blockers: Callable[..., list[Blocker]] = compile_blockers
) -> None:
    """Resolve ``compile: auto`` (and refuse an explicit ``compile: true`` that cannot work), and ``micro_batch:
    auto`` off CUDA, in place; log each default once on rank 0.

    ``micro_batch: auto`` on CUDA is left to ``ddp_ft.training.setup.resolve_micro_batch``, which needs the model's
    shape.

    Args:
        settings (RunSettings): the run's settings, changed in place.
        info (DistInfo): this rank; its device.
        blockers (Callable): :func:`~ddp_ft.training.model.compilation.compile_blockers` (injectable for tests).

    Raises:
        ValueError: ``--compile`` (``compile: true``) where compilation cannot work or is known to break, naming each
            reason, its fix, and ``--no-compile``.
    """
    model, lora, train = settings.model, settings.lora, settings.train
    say = logger.info if info.is_main_process else logger.debug
    if model.compile in (True, AUTO):
        found = blockers(
            info.device,
            four_bit=model.load_in_4bit,
            lora_dropout=lora.lora_dropout,
            checkpointing=model.gradient_checkpointing,
        )
        if model.compile is True:
            refuse_blockers(found, "--compile (compile: true)")
        elif info.device.type != "cuda":
            model.compile = False
            say(
                "compile: off (auto on %s: compiling costs each process tens of seconds; --compile turns it on)",
                info.device.type,
            )
        elif found:
            model.compile = False
            reasons = "; ".join(f"{b.reason} ({b.fix})" for b in found)
            if info.is_main_process:
                logger.warning("compile: off, though the default on CUDA is on: %s", reasons)
        else:
            model.compile = True
            say("compile: on (auto on CUDA: %s; --no-compile turns it off)", COMPILE_WHY)
    if train.micro_batch == AUTO and info.device.type != "cuda":
        train.micro_batch = 1
        say(
            "micro-batch: 1 (auto on %s: the host's memory is shared, with no GPU to fill; --micro-batch N sets it)",
            info.device.type,
        )
