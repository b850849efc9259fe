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
import time
from contextlib import nullcontext
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
from .data import EpochLoader, answer_tokens, check_resume, count_tokens
from .data.step_tokens import StepTokenCounts, global_order
from .ddp import BucketedDDP
from .distributed import DistInfo, restart_count
from .metrics import ThroughputMeter, open_metric_sink
from .precision import Precision
from .preemption import StopSignal
from .records import STOP, config_record, eval_record, run_identity, train_record
from .setup import build_model, check_run_settings, prepare_run
from .shared_fs import check_shared_resume, prepare_output_dir

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


def _count_tokens(group: list[dict], device: torch.device) -> torch.Tensor:
    """[answer tokens that carry loss, non-padding input tokens] of a list of micro-batches."""
    answers = sum(answer_tokens(b) for b in group)
    inputs = sum(count_tokens(b) for b in group)
    return torch.tensor([answers, inputs], dtype=torch.float64, device=device)


def _sum_over_ranks(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.is_distributed:
        dist.all_reduce(t)
    return t


def step_counts(group: list[dict], info: DistInfo, stop_flag: float = 0.0) -> torch.Tensor:
    """[answer tokens, input tokens, ranks asking to stop] of one optimizer step, summed over ranks.

    One collective, for callers that do not know the step's global samples (``forward_backward``'s default, the
    benchmarks). The training loop needs none: it sums the step's samples' counts from the global order
    (``ddp_ft.data.step_tokens``) and sends the stop flag with the loss after backward.
    """
    local = torch.cat(
        [_count_tokens(group, info.device), torch.tensor([stop_flag], dtype=torch.float64, device=info.device)]
    )
    return _sum_over_ranks(local, info)


@dataclass
class StepOutcome:
    """What :func:`forward_backward_timed` leaves on the device for the caller's one transfer."""

    loss: torch.Tensor  # the step's global token-mean loss (0-d)
    counts: torch.Tensor  # [answer tokens, input tokens] summed over ranks
    compute_ms: torch.Tensor  # each rank's forward+backward ms up to its last gradient, in rank order
    stop_flags: torch.Tensor  # each rank's stop flag (``ddp_ft.preemption``), in rank order


def rank_balance(compute_ms: list[float], rank: int) -> dict[str, float]:
    """How unevenly the ranks computed one step, from each rank's compute ms (forward and backward up to the
    last gradient, before the final wait).

    Returns:
        dict[str, float]: ``compute_max_ms``, ``compute_min_ms``; ``imbalance``, max / min (1.0: balanced; 1.5: the
        slowest rank took 50% longer than the fastest); ``wait_for_slowest_ms``, max minus this rank's: what this
        rank spent waiting for the slowest rank in the step's all-reduce (0 on the slowest rank).
    """
    slowest, fastest = max(compute_ms), min(compute_ms)
    return {
        "compute_max_ms": slowest,
        "compute_min_ms": fastest,
        "imbalance": slowest / fastest if fastest > 0 else 1.0,
        "wait_for_slowest_ms": slowest - compute_ms[rank],
    }


def forward_backward(
    model: torch.nn.Module,
    group: list[dict],
    info: DistInfo,
    counts: torch.Tensor | None = None,
    precision: Precision | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate the gradient of one optimizer step over ``group`` (this rank's micro-batches).

    Every micro-batch's loss is its summed token loss over the answer tokens of the *global* effective
    batch, times the world size (DDP averages over ranks), so the accumulated gradient equals one process's
    on the whole batch. ``no_sync()`` wraps every micro-batch but the last.

    Args:
        counts (torch.Tensor | None): ``step_counts(group, info)``, if already reduced. Default: reduced here.
        precision (Precision | None): autocast dtype of the forward. Default: none (the model's own dtypes).
        scaler (torch.amp.GradScaler | None): scales the loss (float16); the gradients stay scaled until the
            caller's ``scaler.unscale_``. Default: none.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: the step's global token-mean loss (a 0-d tensor on the device, not read
        here: the caller reads every logged scalar in one transfer), and [answer tokens, input tokens] summed over
        ranks.
    """
    outcome = forward_backward_timed(model, group, info, counts, precision, scaler)
    return outcome.loss, outcome.counts


def forward_backward_timed(
    model: torch.nn.Module,
    group: list[dict],
    info: DistInfo,
    counts: torch.Tensor | None = None,
    precision: Precision | None = None,
    scaler: torch.amp.GradScaler | None = None,
    stop_flag: float = 0.0,
) -> StepOutcome:
    """:func:`forward_backward`, also gathering each rank's compute ms (see :func:`rank_balance`).

    The loss, this rank's compute time and its stop flag travel together in the one collective after backward
    (an all-gather of [loss, compute ms, stop flag] per rank; the loss is their sum, as the all-reduce it
    replaces), so every rank learns at the same step boundary whether any rank received a stop signal. Compute
    ends when the wrapper's last gradient was ready (``BucketedDDP.last_gradient_ready_at``; host time), else
    when backward returned.
    """
    started = time.perf_counter()
    counts = step_counts(group, info) if counts is None else counts
    answer_tokens = counts[0].clamp(min=1).to(torch.float32)
    local_loss = torch.zeros((), dtype=torch.float64, device=info.device)
    autocast = precision.autocast_context() if precision is not None else nullcontext()
    for i, batch in enumerate(group):
        batch = {k: v.to(info.device, non_blocking=True) for k, v in batch.items()}  # pinned on CUDA: async
        last = i == len(group) - 1
        with model.no_sync() if (info.is_distributed and not last) else nullcontext(), autocast:
            loss = model(**batch, num_items_in_batch=answer_tokens).loss
            scaled = loss * info.world_size
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        local_loss += loss.detach().double()
    ready = getattr(model, "last_gradient_ready_at", None)
    compute_ms = ((ready if ready is not None and ready > started else time.perf_counter()) - started) * 1e3
    extra = torch.tensor([compute_ms, stop_flag], dtype=torch.float64, device=info.device)
    mine = torch.cat([local_loss.unsqueeze(0), extra])
    if info.is_distributed:
        per_rank = [torch.empty_like(mine) for _ in range(info.world_size)]
        dist.all_gather(per_rank, mine)
        gathered = torch.stack(per_rank)
    else:
        gathered = mine.unsqueeze(0)
    return StepOutcome(gathered[:, 0].sum(), counts[:2], gathered[:, 1], gathered[:, 2])


def evaluate(
    model: torch.nn.Module, dataset, collate_fn, micro_batch: int, info: DistInfo, precision: Precision | None = None
) -> float:
    """Token-mean loss over ``dataset``, each rank on ``rank::world_size`` (no padding duplicates).

    ``model`` is the unwrapped model: evaluation communicates only the two sums at the end.
    """
    was_training = model.training
    model.eval()
    indices = list(range(info.rank, len(dataset), info.world_size))
    totals = torch.zeros(2, dtype=torch.float64, device=info.device)
    autocast = precision.autocast_context() if precision is not None else nullcontext()
    for start in range(0, len(indices), micro_batch):
        batch = collate_fn([dataset[i] for i in indices[start : start + micro_batch]])
        batch = {k: v.to(info.device) for k, v in batch.items()}
        tokens = answer_tokens(batch)
        with autocast:
            totals[0] += model(**batch, num_items_in_batch=1).loss.double()  # summed token loss
        totals[1] += tokens
    _sum_over_ranks(totals, info)
    model.train(was_training)
    return (totals[0] / totals[1].clamp(min=1)).item()


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
