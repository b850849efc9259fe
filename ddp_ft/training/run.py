"""The plain loop's run before the first step, built in one pass: ``build_run``.

The order refuses bad settings before anything is touched or loaded:

1. checks needing only settings and world size (``resolve.resolve_run``);
2. the shared output folder and the checkpoint to resume;
3. tokenizer, data, and a resume position this layout can continue (a new run: a folder no earlier run filled);
4. the model as it trains, the loader, the DDP wrap, optimizer, schedule and scaler;
5. the resumed state, then ``run_config.yaml``, written after every refusal.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..ddp.timeline import BackwardRecorder
from ..distributed import DistInfo, restart_count
from .checkpoint import (
    TrainState,
    check_resume_position,
    check_resume_settings,
    checkpoint_to_resume,
    load_checkpoint,
)
from .checkpoint.shared_fs import check_new_run, check_shared_resume, prepare_output_dir
from .config import RunSettings, write_run_config
from .data import DataLayout, EpochLoader, describe_epoch
from .model.compilation import CompileWatch
from .perf_traps import loop_fix, watch_idle_device
from .resolve import Resolved, resolve_run
from .setup import RunParts, build_training_model, prepare_run

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything one rank trains with, and where it starts."""

    settings: RunSettings  # as parsed, never written to
    resolved: Resolved  # what the run trains with
    info: DistInfo
    parts: RunParts
    output_dir: Path
    loader: EpochLoader
    total_steps: int
    model: torch.nn.Module  # unwrapped: what is saved and evaluated
    wrapped: torch.nn.Module
    recorder: BackwardRecorder | None  # one process: bucket readiness, for the forecast
    compile_watch: CompileWatch | None
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    state: TrainState  # resumed, or zero


def build_run(settings: RunSettings, info: DistInfo) -> Run:
    """Check, then build this rank's run; every refusal happens here, before anything is written.

    Raises:
        ValueError: a setting, the data, the output folder or the checkpoint cannot work, naming the fix.

    Example:
        >>> run = build_run(settings, info)
    """
    t = settings.train
    resolved = resolve_run(settings, info)  # before anything is touched
    output_dir = Path(t.output_dir)
    prepare_output_dir(output_dir, info)  # also removes partial saves
    resume_from = check_shared_resume(lambda: checkpoint_to_resume(t.resume, output_dir, restart_count()), info)
    parts = prepare_run(settings, info, resolved)  # packing resolved here
    check_new_run(output_dir, resume_from, info)  # what an earlier run left is not replaced
    # The micro-batch only splits a step; the layout fixes the order.
    layout = DataLayout(len(parts.train_set), t.seed, t.effective_batch, info.world_size, parts.resolved.micro_batch)
    logger.info("%s", describe_epoch(layout))
    total_steps = t.max_steps if t.max_steps > 0 else t.epochs * layout.steps_per_epoch
    if resume_from is not None:  # before the model loads
        check_resume_settings(resume_from, settings, info)
        check_resume_position(resume_from, layout)

    precision = parts.resolved.precision
    scaled = ", loss-scaled" if precision.loss_scaling else ""
    logger.info("compute dtype %s (%s)%s", precision.name, precision.reason, scaled)
    compile_watch = CompileWatch() if parts.resolved.compile else None
    model, resolved = build_training_model(settings, info, parts)  # the final micro-batch
    loader = make_loader(settings, info, parts, resolved)
    wrapped = settings.ddp.wrap(model) if info.is_distributed else model
    recorder = None if info.is_distributed else settings.ddp.record_backward(model)  # for ddp-ft forecast
    scaler = precision.grad_scaler()  # a pass-through unless float16
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=t.learning_rate, weight_decay=t.weight_decay)
    watch_idle_device(model, info.device, info.is_main_process, loop_fix)  # CUDA only
    scheduler = _schedule(optimizer, settings, total_steps)
    state = TrainState()
    if resume_from is not None:
        state = load_checkpoint(resume_from, model, optimizer, scheduler, info, scaler)
        _log_resume(settings, resume_from, state, info)
    write_run_config(settings, info, resolved.as_config())  # after every refusal
    return Run(
        settings=settings,
        resolved=resolved,
        info=info,
        parts=parts,
        output_dir=output_dir,
        loader=loader,
        total_steps=total_steps,
        model=model,
        wrapped=wrapped,
        recorder=recorder,
        compile_watch=compile_watch,
        trainable=trainable,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        state=state,
    )


def make_loader(settings: RunSettings, info: DistInfo, parts: RunParts, resolved: Resolved) -> EpochLoader:
    """This rank's micro-batches of every step, at the resolved micro-batch."""
    t = settings.train
    return EpochLoader(
        parts.train_set,
        parts.hooks.wrap_collate(parts.collate),
        resolved.micro_batch,
        info.rank,
        info.world_size,
        seed=t.seed,
        effective_batch=t.effective_batch,
        pin_memory=info.device.type == "cuda",
        balance=t.balance_ranks,
        cost=parts.batch_cost,  # balance ranks on packed tokens
    )


def _schedule(optimizer: torch.optim.Optimizer, settings: RunSettings, total_steps: int):
    """Linear warm-up, then cosine decay to ``min_learning_rate``."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    t = settings.train
    warmup = math.ceil(t.warmup_ratio * total_steps)
    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total_steps, min_lr=t.min_learning_rate)


def _log_resume(settings: RunSettings, resume_from: Path, state: TrainState, info: DistInfo) -> None:
    if settings.ddp.comm_hook == "powersgd" and info.is_main_process:
        logger.warning(
            "--comm-hook powersgd: PowerSGD's state (error feedback, warm-start matrices, its step "
            "count) is not in checkpoints; the resumed run starts it afresh, so it does not continue "
            "the uninterrupted run exactly."
        )
    logger.info(
        "resumed from %s at step %d (epoch %d, sample %d of its global order)",
        resume_from,
        state.global_step,
        state.epoch,
        state.sample_in_epoch,
    )
