"""The plain loop's run as it stands before the first step, built in one pass down: ``build_run``.

The settings go through each piece once, in the order that refuses before anything is touched or loaded:

1. the checks that need only the settings and the world size, and what they resolve (``resolve.resolve_run``);
2. the output folder every node shares, and the checkpoint to resume (``checkpoint``);
3. tokenizer and data (``setup.prepare_run``), and a resume position this data layout can continue;
4. the model as it trains (``setup.build_training_model``: Liger, QLoRA, compiled layers, ``--micro-batch auto``'s
   probe), then the per-rank loader at the final micro-batch, the model wrapped in BucketedDDP when distributed, its
   optimizer, schedule and loss scaler;
5. the resumed state, then ``run_config.yaml`` (written only once every refusal has passed).

The settings are only read; what the run trains with is the frozen ``Run.resolved``.

``ddp_ft.training.loop`` trains the :class:`Run` it returns and never calls back here.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..ddp.timeline import BackwardRecorder
from ..distributed import DistInfo, restart_count
from .checkpoint import TrainState, check_resume_position, checkpoint_to_resume, load_checkpoint
from .checkpoint.shared_fs import check_shared_resume, prepare_output_dir
from .config import RunSettings, write_run_config
from .data import DataLayout, EpochLoader, describe_epoch
from .model.compilation import CompileWatch
from .perf_traps import loop_fix, watch_idle_device
from .resolve import Resolved, resolve_run
from .setup import RunParts, build_training_model, prepare_run

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything one rank trains with: the settings, what they resolved to, the data, the model and its optimizer,
    where it starts."""

    settings: RunSettings  # as parsed, never written to
    resolved: Resolved  # micro-batch, accumulation, compile, packing, precision: what the run trains with
    info: DistInfo
    parts: RunParts  # tokenizer, data sets, collate, truncation report, fault injection
    output_dir: Path
    loader: EpochLoader
    total_steps: int
    model: torch.nn.Module  # unwrapped: what is saved, evaluated and unscaled
    wrapped: torch.nn.Module  # BucketedDDP(model) when distributed, else the model itself
    recorder: BackwardRecorder | None  # one process: when each bucket BucketedDDP would build is ready
    compile_watch: CompileWatch | None
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    state: TrainState  # step, epoch and sample position: the resumed one, or zero


def build_run(settings: RunSettings, info: DistInfo) -> Run:
    """Check, then build this rank's run; every refusal happens here, before the first step and before anything is
    written but the removal of half-written saves.

    Raises:
        ValueError: a setting, the data, the output folder or the checkpoint to resume that cannot work, naming the
            setting to change (``resolve.resolve_run``, ``setup.prepare_run``, ``checkpoint``).
    """
    t = settings.train
    resolved = resolve_run(settings, info)  # before anything is touched
    output_dir = Path(t.output_dir)
    prepare_output_dir(output_dir, info)  # shared by every node; partial saves (a SIGKILL mid-write) removed
    resume_from = check_shared_resume(lambda: checkpoint_to_resume(t.resume, output_dir, restart_count()), info)
    parts = prepare_run(settings, info, resolved)  # packing resolved here
    # The global order and the steps; the micro-batch (a first guess with --micro-batch auto) only splits a step.
    layout = DataLayout(len(parts.train_set), t.seed, t.effective_batch, info.world_size, parts.resolved.micro_batch)
    logger.info("%s", describe_epoch(layout))  # floor(samples / effective batch): what is left out, once
    total_steps = t.max_steps if t.max_steps > 0 else t.epochs * layout.steps_per_epoch
    if resume_from is not None:  # refuse a position this layout cannot continue exactly, before the model
        check_resume_position(resume_from, layout)

    precision = parts.resolved.precision
    scaled = ", loss-scaled" if precision.loss_scaling else ""
    logger.info("compute dtype %s (%s)%s", precision.name, precision.reason, scaled)
    compile_watch = CompileWatch() if parts.resolved.compile else None  # compiles from the first forward
    model, resolved = build_training_model(settings, info, parts)  # Liger, compiled, probed: the final micro-batch
    loader = make_loader(settings, info, parts, resolved)
    wrapped = settings.ddp.wrap(model) if info.is_distributed else model
    recorder = None if info.is_distributed else settings.ddp.record_backward(model)  # for ddp-ft forecast
    scaler = precision.grad_scaler()  # disabled (a pass-through) unless float16
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=t.learning_rate, weight_decay=t.weight_decay)
    watch_idle_device(model, info.device, info.is_main_process, loop_fix)  # CUDA, 4th step (perf_traps)
    scheduler = _schedule(optimizer, settings, total_steps)
    state = TrainState()
    if resume_from is not None:
        state = load_checkpoint(resume_from, model, optimizer, scheduler, info, scaler)
        _log_resume(settings, resume_from, state)
    write_run_config(
        settings, info, resolved.as_config()
    )  # every refusal (settings, data, resume) has passed: nothing is written before
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
    """This rank's micro-batches of every step, at the resolved micro-batch (``ddp_ft.training.data.loader``)."""
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
        cost=parts.batch_cost,  # packed micro-batches: the ranks balanced on packed tokens
    )


def _schedule(optimizer: torch.optim.Optimizer, settings: RunSettings, total_steps: int):
    """Linear warm-up, then cosine decay to ``min_learning_rate``."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    t = settings.train
    warmup = math.ceil(t.warmup_ratio * total_steps)
    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total_steps, min_lr=t.min_learning_rate)


def _log_resume(settings: RunSettings, resume_from: Path, state: TrainState) -> None:
    if settings.ddp.comm_hook == "powersgd":
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
