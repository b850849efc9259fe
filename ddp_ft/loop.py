"""The plain PyTorch training loop, every mechanism in sight.

One optimizer step = ``accumulation`` micro-batches per rank. All but the last run under ``no_sync()``
(no communication); the last one's backward averages everything over the ranks while it runs. The loss
of a step is normalised by the number of answer tokens in the whole effective batch (all micro-batches,
all ranks), so one process with accumulation 2k and two with k compute the same gradient, whatever the
padding or the answer lengths.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from .checkpoint import (
    TrainState,
    checkpoint_to_resume,
    load_checkpoint,
    save_checkpoint,
    saved_position,
    verify_checkpoint,
)
from .config import RunSettings
from .data import EpochLoader, check_resume
from .data.step_tokens import StepTokenCounts, global_order
from .ddp import BucketedDDP
from .distributed import DistInfo, restart_count
from .metrics import ThroughputMeter, open_metric_sink
from .preemption import StopSignal
from .records import STOP, bucket_choice_record, config_record, eval_record, run_identity, train_record
from .setup import build_model, check_run_settings, prepare_run
from .shared_fs import check_shared_resume, prepare_output_dir
from .steps import evaluate, forward_backward_timed, rank_balance

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a finished run reports (on every rank; paths are rank 0's)."""

    steps: int
    first_loss: float | None
    last_loss: float | None
    eval_loss: float | None
    output_dir: str
    checkpoint: str | None
    stopped_by: str | None = None  # the signal that stopped the run early (a checkpoint was saved), else None


def _check_resume(path: Path, layout) -> None:
    """Refuse a checkpoint whose data position this run's layout cannot continue exactly (naming both)."""
    verify_checkpoint(path)  # every file loads without executing code, checked before the model loads
    state, saved = saved_position(path)
    if saved is None:
        raise ValueError(
            f"--resume {path}: the checkpoint records no data layout; start a new run in another --output-dir."
        )
    try:
        check_resume(saved, layout, state.sample_in_epoch)
    except ValueError as err:
        raise ValueError(f"--resume {path}: {err}") from None


def train(settings: RunSettings, info: DistInfo) -> TrainResult:
    """Run the fine-tune described by ``settings`` on this rank; every check fails before training starts.

    SIGTERM or SIGUSR1 to any rank (or to the launcher, which forwards it) stops every rank at the same step
    boundary with one checkpoint (``ddp_ft.preemption``); the result's ``stopped_by`` names the signal.
    """
    with StopSignal() as stop:
        return _train(settings, info, stop)


def _train(settings: RunSettings, info: DistInfo, stop: StopSignal) -> TrainResult:
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    t = settings.train
    output_dir = Path(t.output_dir)
    check_run_settings(settings, info)  # before anything is touched
    prepare_output_dir(output_dir, info)  # shared by every node; partial saves (a SIGKILL mid-write) removed
    resume_from = check_shared_resume(lambda: checkpoint_to_resume(t.resume, output_dir, restart_count()), info)
    parts = prepare_run(settings, info)
    accumulation, train_set, eval_set, collate = parts.accumulation, parts.train_set, parts.eval_set, parts.collate
    loader = EpochLoader(
        train_set,
        parts.faults.wrap_collate(collate),
        t.micro_batch,
        info.rank,
        info.world_size,
        seed=t.seed,
        effective_batch=t.effective_batch,
        pin_memory=info.device.type == "cuda",
        balance=t.balance_ranks,
    )
    # floor(samples / effective batch) steps per epoch, the same on every world size
    total_steps = t.max_steps if t.max_steps > 0 else t.epochs * loader.layout.steps_per_epoch
    if resume_from is not None:  # refuse a position this layout cannot continue exactly, before the model loads
        _check_resume(resume_from, loader.layout)

    precision = settings.model.precision(info.device)
    logger.info(
        "compute dtype %s (%s)%s", precision.name, precision.reason, ", loss-scaled" if precision.loss_scaling else ""
    )
    model = build_model(settings, info, parts)
    wrapped = settings.ddp.wrap(model) if info.is_distributed else model
    scaler = precision.grad_scaler()  # disabled (a pass-through) unless float16
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=t.learning_rate, weight_decay=t.weight_decay)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, math.ceil(t.warmup_ratio * total_steps), total_steps, min_lr=t.min_learning_rate
    )
    state = TrainState()
    if resume_from is not None:
        state = load_checkpoint(resume_from, model, optimizer, scheduler, info, scaler)
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

    # Which samples each rank starts on: proof in the log that shards follow the global rank.
    first_indices = next(loader.plans(state.epoch))[info.rank][0]
    all_first = [first_indices] * info.world_size
    if info.is_distributed:
        dist.all_gather_object(all_first, first_indices)

    identity = run_identity(t.wandb_project, t.wandb_group, t.run_name, settings.preset, info.world_size)
    config = config_record(
        run_name=identity.name,
        world_size=info.world_size,
        micro_batch=t.micro_batch,
        accumulation=accumulation,
        total_steps=total_steps,
        resumed_from_step=state.global_step,
        bucket_cap_mb=settings.ddp.bucket_cap_mb,
        comm_hook=settings.ddp.comm_hook,
        buckets=len(wrapped.bucket_sizes) if isinstance(wrapped, BucketedDDP) else 0,
        train_samples=len(train_set),
        eval_samples=len(eval_set),
        truncation=str(parts.truncation),
        preset=settings.preset,
        first_batch_indices=all_first,
    )
    wandb_run = {
        "project": identity.project,
        "group": identity.group,
        "job_type": identity.job_type,
        "name": identity.name,
        "config": {k: v for k, v in config.items() if k != "type"},
    }
    sink = open_metric_sink(info, output_dir, wandb_run if t.report_to == "wandb" else None)
    sink.log(config)
    logger.info(
        "%s: %d steps of %d samples (%d ranks x micro-batch %d x accumulation %d); %s",
        identity.name,
        total_steps,
        t.effective_batch,
        info.world_size,
        t.micro_batch,
        accumulation,
        parts.truncation,
    )

    meter = ThroughputMeter(info.world_size, info.device)
    token_counts = StepTokenCounts(train_set)
    progress = tqdm(total=total_steps, initial=state.global_step, disable=not info.is_main_process, desc=identity.name)
    first_loss = last_loss = eval_loss = None
    choice_logged = False  # bucket_cap_mb="auto": its choice is written once
    checkpoint = None
    stopped_by = None
    saved_step = state.global_step  # a checkpoint already holds this step (the one resumed, or nothing at 0)
    has_eval = len(eval_set) > 0  # --eval-fraction 0: no eval loss at all (an empty sum is not a loss of 0)
    parts.faults.start(state.global_step, accumulation)

    def save() -> Path | None:
        nonlocal saved_step
        saved_step = state.global_step
        return save_checkpoint(
            output_dir,
            model,
            optimizer,
            scheduler,
            state,
            info,
            t.save_total_limit,
            loader.layout,
            before_publish=parts.faults.checkpoint_partly_written,
            scaler=scaler,
        )

    model.train()
    try:
        while state.global_step < total_steps and stopped_by is None:
            batches = loader.epoch(state.epoch, start_sample=state.sample_in_epoch)
            order = global_order(len(train_set), t.seed, state.epoch)  # every rank sees every step's samples
            while state.global_step < total_steps:
                group = list(islice(batches, accumulation))
                if len(group) < accumulation:  # epoch done (EpochLoader yields whole steps; the remainder is dropped)
                    state.epoch, state.sample_in_epoch = state.epoch + 1, 0
                    break
                meter.start()
                # The step's global token counts, from its samples in the global order: no collective.
                step_samples = order[state.sample_in_epoch : state.sample_in_epoch + t.effective_batch]
                counts = torch.tensor(token_counts.totals(step_samples), dtype=torch.float64, device=info.device)
                outcome = forward_backward_timed(wrapped, group, info, counts, precision, scaler, stop.local_flag)
                loss, counts = outcome.loss, outcome.counts
                # The gradients are already averaged over the ranks, so every rank unscales the same numbers, and
                # finds the same inf/nan: the scaler skips the same steps everywhere with no extra collective.
                scaler.unscale_(optimizer)
                if t.max_grad_norm > 0:
                    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, t.max_grad_norm)
                else:
                    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in trainable if p.grad is not None])
                lr = scheduler.get_last_lr()[0]
                scaler.step(optimizer)  # optimizer.step(), unless float16 gradients overflowed
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                # Every logged scalar in one device-to-host transfer (the step's one wait for the device).
                logged = [loss.double(), grad_norm.double(), counts[1].double(), *outcome.compute_ms]
                logged += list(outcome.stop_flags)
                if precision.loss_scaling:
                    logged.append(scaler._get_scale_async().double())  # the tensor behind get_scale(), unread
                loss, grad_norm, input_tokens, *rest = torch.stack(logged).tolist()
                compute_ms, stop_flags = rest[: info.world_size], rest[info.world_size : 2 * info.world_size]
                scale = rest[2 * info.world_size :]
                skipped = precision.loss_scaling and not math.isfinite(grad_norm)  # inf/nan: the scaler skipped
                if not skipped:
                    scheduler.step()
                state.global_step += 1
                state.sample_in_epoch += t.effective_batch
                state.samples_seen += t.effective_batch
                record = train_record(
                    step=state.global_step,
                    samples_seen=state.samples_seen,
                    loss=loss,
                    lr=lr,
                    grad_norm=grad_norm,
                    epoch=state.epoch,
                    **meter.stop(int(input_tokens)),
                    **rank_balance(compute_ms, info.rank),
                )
                if precision.loss_scaling:
                    record.update({"loss_scale": scale[0], "skipped": int(skipped)})
                if isinstance(wrapped, BucketedDDP):
                    record.update(wrapped.pop_comm_stats().as_dict())
                sink.log(record)
                if isinstance(wrapped, BucketedDDP) and wrapped.bucket_choice is not None and not choice_logged:
                    sink.log(bucket_choice_record(step=state.global_step, choice=wrapped.bucket_choice))
                    choice_logged = True
                first_loss = loss if first_loss is None else first_loss
                last_loss = loss
                progress.update(1)
                progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
                if any(stop_flags) and state.global_step < total_steps:
                    # Some rank received SIGTERM/SIGUSR1 by this step's gather: every rank read the same flags, so
                    # all stop here, after this step, with one checkpoint.
                    stopped_by = stop.received or "a stop signal on another rank"
                    break
                if (
                    has_eval
                    and t.eval_every
                    and state.global_step % t.eval_every == 0
                    and state.global_step < total_steps
                ):
                    eval_loss = evaluate(model, eval_set, collate, t.micro_batch, info, precision)
                    sink.log(eval_record(step=state.global_step, samples_seen=state.samples_seen, eval_loss=eval_loss))
                if t.save_every and state.global_step % t.save_every == 0 and state.global_step < total_steps:
                    save()
        if stopped_by is not None:
            # Preempted: one checkpoint of the last finished step (unless one holds it already), no final eval.
            new_work = state.global_step > saved_step
            checkpoint = save() if new_work else None
            sink.log(
                {
                    "type": STOP,
                    "step": state.global_step,
                    "samples_seen": state.samples_seen,
                    "signal": stopped_by,
                    "checkpoint": str(checkpoint) if checkpoint else None,
                }
            )
            logger.warning(
                "stopped by %s after step %d of %d: %s; continue with --resume latest",
                stopped_by,
                state.global_step,
                total_steps,
                "checkpoint saved" if new_work else "the latest checkpoint already holds this step",
            )
        else:
            if has_eval:
                eval_loss = evaluate(model, eval_set, collate, t.micro_batch, info, precision)
                sink.log(eval_record(step=state.global_step, samples_seen=state.samples_seen, eval_loss=eval_loss))
            checkpoint = save()
            logger.info(
                "done: %d steps, loss %s -> %s, eval loss %s", state.global_step, first_loss, last_loss, eval_loss
            )
    finally:
        progress.close()
        sink.close()
    return TrainResult(
        state.global_step,
        first_loss,
        last_loss,
        eval_loss,
        str(output_dir),
        str(checkpoint) if checkpoint else None,
        stopped_by,
    )
