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

from ..ddp import BucketedDDP
from ..distributed import DistInfo, restart_count
from ..report.metrics import ThroughputMeter, open_metric_sink
from ..report.records import STOP, bucket_choice_record, config_record, eval_record, run_identity, train_record
from .checkpoint import TrainState, check_resume_position, checkpoint_to_resume, load_checkpoint, save_checkpoint
from .checkpoint.shared_fs import check_shared_resume, prepare_output_dir
from .config import RunSettings, write_run_config
from .data import EpochLoader
from .data.step_tokens import StepTokenCounts, global_order
from .model.compilation import CompileWatch
from .perf_traps import loop_fix, watch_idle_device
from .preemption import StopSignal
from .setup import build_training_model, check_run_settings, prepare_run
from .steps import StepResult, evaluate, forward_backward_timed, rank_balance

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


def train(settings: RunSettings, info: DistInfo) -> TrainResult:
    """Run the fine-tune described by ``settings`` on this rank; every check fails before training starts.

    SIGTERM or SIGUSR1 to any rank (or to the launcher, which forwards it) stops every rank at the same step
    boundary with one checkpoint (``ddp_ft.training.preemption``); the result's ``stopped_by`` names the signal.
    """
    with StopSignal() as stop:
        return _Loop(settings, info, stop).run()


class _Loop:
    """One run on this rank: ``__init__`` checks and builds everything, ``run`` trains, evaluates and saves.

    Phases: setup (output dir, resume point, data, model, optimizer, metric sink; every refusal happens here,
    before the first step), then epochs of optimizer steps (``_step``: forward/backward over the micro-batches,
    unscale, clip, step; ``_log_step``: one record per step), a periodic evaluation and checkpoint between
    steps, and the end (``_finish``: final eval and checkpoint, or ``_stop``: the preemption checkpoint).
    """

    def __init__(self, settings: RunSettings, info: DistInfo, stop: StopSignal) -> None:
        self.settings, self.info, self.stop, self.t = settings, info, stop, settings.train
        self.output_dir = Path(self.t.output_dir)
        self._prepare_data()
        self._build_model()
        write_run_config(settings, info)  # every refusal (settings, data, resume) has passed: nothing is written before
        self._open_sink()
        self.meter = ThroughputMeter(info.world_size, info.device)
        self.token_counts = StepTokenCounts(self.train_set)
        self.progress = tqdm(  # rank 0's only
            total=self.total_steps,
            initial=self.state.global_step,
            disable=not info.is_main_process,
            desc=self.identity.name,
        )
        self.first_loss = self.last_loss = self.eval_loss = None
        self.choice_logged = False  # bucket_cap_mb="auto": its choice is written once
        self.stopped_by: str | None = None
        self.saved_step = self.state.global_step  # a checkpoint already holds this step (the one resumed, or 0)
        self.has_eval = len(self.eval_set) > 0  # --eval-fraction 0: no eval loss at all (an empty sum is not 0)
        self.parts.faults.start(self.state.global_step, self.accumulation)

    # -- setup ---------------------------------------------------------------------------------------------------

    def _prepare_data(self) -> None:
        """Check the settings and the output dir, find the checkpoint to resume, build the data and its loader."""
        settings, info, t = self.settings, self.info, self.t
        check_run_settings(settings, info)  # before anything is touched
        prepare_output_dir(self.output_dir, info)  # shared by every node; partial saves (a SIGKILL mid-write) removed
        self.resume_from = check_shared_resume(
            lambda: checkpoint_to_resume(t.resume, self.output_dir, restart_count()), info
        )
        self.parts = parts = prepare_run(settings, info)
        self.accumulation, self.train_set, self.eval_set = parts.accumulation, parts.train_set, parts.eval_set
        self._make_loader()  # with --micro-batch auto's first guess; remade once the probe has chosen
        logger.info("%s", self.loader.describe_epoch())  # floor(samples / effective batch): what is left out, once
        self.total_steps = t.max_steps if t.max_steps > 0 else t.epochs * self.loader.layout.steps_per_epoch
        if self.resume_from is not None:  # refuse a position this layout cannot continue exactly, before the model
            check_resume_position(self.resume_from, self.loader.layout)

    def _make_loader(self) -> None:
        t, info = self.t, self.info
        self.loader = EpochLoader(
            self.train_set,
            self.parts.faults.wrap_collate(self.parts.collate),
            t.micro_batch,
            info.rank,
            info.world_size,
            seed=t.seed,
            effective_batch=t.effective_batch,
            pin_memory=info.device.type == "cuda",
            balance=t.balance_ranks,
            cost=self.parts.batch_cost,  # packed micro-batches: the ranks balanced on packed tokens
        )

    def _build_model(self) -> None:
        """The model (wrapped in DDP when distributed), optimizer, schedule and loss scaler; the resumed state."""
        from transformers import get_cosine_with_min_lr_schedule_with_warmup

        settings, info, t = self.settings, self.info, self.t
        self.precision = precision = settings.model.precision(info.device)
        scaled = ", loss-scaled" if precision.loss_scaling else ""
        logger.info("compute dtype %s (%s)%s", precision.name, precision.reason, scaled)
        self.compile_watch = CompileWatch() if settings.model.compile else None  # compiles from the first forward
        self.model, self.probe = build_training_model(settings, info, self.parts)  # Liger, compiled, probed
        if self.probe is not None:  # --micro-batch auto: the probe's choice
            self.accumulation = self.probe.accumulation
            self._make_loader()  # the same global order and steps (DataLayout): only the per-forward split changes
        self.wrapped = settings.ddp.wrap(self.model) if info.is_distributed else self.model
        self.scaler = precision.grad_scaler()  # disabled (a pass-through) unless float16
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=t.learning_rate, weight_decay=t.weight_decay)
        watch_idle_device(self.model, info.device, info.is_main_process, loop_fix)  # CUDA, 4th step (perf_traps)
        self.scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            self.optimizer, math.ceil(t.warmup_ratio * self.total_steps), self.total_steps, min_lr=t.min_learning_rate
        )
        self.state = TrainState()
        if self.resume_from is not None:
            self._resume()

    def _resume(self) -> None:
        self.state = load_checkpoint(
            self.resume_from, self.model, self.optimizer, self.scheduler, self.info, self.scaler
        )
        if self.settings.ddp.comm_hook == "powersgd":
            logger.warning(
                "--comm-hook powersgd: PowerSGD's state (error feedback, warm-start matrices, its step "
                "count) is not in checkpoints; the resumed run starts it afresh, so it does not continue "
                "the uninterrupted run exactly."
            )
        logger.info(
            "resumed from %s at step %d (epoch %d, sample %d of its global order)",
            self.resume_from,
            self.state.global_step,
            self.state.epoch,
            self.state.sample_in_epoch,
        )

    def _open_sink(self) -> None:
        """The run's identity and config record, written to a new metric sink (JSONL, and wandb if asked)."""
        settings, info, t = self.settings, self.info, self.t
        # Which samples each rank starts on: proof in the log that shards follow the global rank.
        first_indices = next(self.loader.plans(self.state.epoch))[info.rank][0]
        all_first = [first_indices] * info.world_size
        if info.is_distributed:
            dist.all_gather_object(all_first, first_indices)

        self.identity = identity = run_identity(
            t.wandb_project, t.wandb_group, t.run_name, settings.preset, info.world_size
        )
        config = config_record(
            run_name=identity.name,
            world_size=info.world_size,
            micro_batch=t.micro_batch,
            accumulation=self.accumulation,
            total_steps=self.total_steps,
            resumed_from_step=self.state.global_step,
            bucket_cap_mb=settings.ddp.bucket_cap_mb,
            comm_hook=settings.ddp.comm_hook,
            buckets=len(self.wrapped.bucket_sizes) if isinstance(self.wrapped, BucketedDDP) else 0,
            train_samples=len(self.train_set),
            eval_samples=len(self.eval_set),
            truncation=str(self.parts.truncation),
            preset=settings.preset,
            first_batch_indices=all_first,
            **({"micro_batch_probe": self.probe.as_record()} if self.probe else {}),
        )
        wandb_run = identity.wandb_run(config) if t.report_to == "wandb" else None
        self.sink = open_metric_sink(info, self.output_dir, wandb_run)
        self.sink.log(config)
        logger.info(
            "%s: %d steps of %d samples (%d ranks x micro-batch %d x accumulation %d); %s",
            identity.name,
            self.total_steps,
            t.effective_batch,
            info.world_size,
            t.micro_batch,
            self.accumulation,
            self.parts.truncation,
        )

    # -- training ------------------------------------------------------------------------------------------------

    def run(self) -> TrainResult:
        """Train to ``total_steps`` (or to a stop signal), then evaluate and save; closes the progress bar and sink."""
        state = self.state
        self.model.train()
        try:
            while state.global_step < self.total_steps and self.stopped_by is None:
                self._epoch()
            if self.stopped_by is not None:
                checkpoint = self._stop()
            else:
                checkpoint = self._finish()
        finally:
            self.progress.close()
            self.sink.close()
        return TrainResult(
            state.global_step,
            self.first_loss,
            self.last_loss,
            self.eval_loss,
            str(self.output_dir),
            str(checkpoint) if checkpoint else None,
            self.stopped_by,
        )

    def _epoch(self) -> None:
        """Optimizer steps from the saved position to the end of this epoch, ``total_steps`` or a stop signal."""
        state, t = self.state, self.t
        batches = self.loader.epoch(state.epoch, start_sample=state.sample_in_epoch)
        order = global_order(len(self.train_set), t.seed, state.epoch)  # every rank sees every step's samples
        while state.global_step < self.total_steps:
            group = list(islice(batches, self.accumulation))
            if len(group) < self.accumulation:  # epoch done (EpochLoader yields whole steps; the remainder is dropped)
                state.epoch, state.sample_in_epoch = state.epoch + 1, 0
                return
            self.meter.start()
            # The step's global token counts, from its samples in the global order: no collective.
            step_samples = order[state.sample_in_epoch : state.sample_in_epoch + t.effective_batch]
            result = self._step(group, step_samples)
            self._log_step(result)
            if any(result.stop_flags) and state.global_step < self.total_steps:
                # Some rank received SIGTERM/SIGUSR1 by this step's gather: every rank read the same flags, so all
                # stop here, after this step, with one checkpoint.
                self.stopped_by = self.stop.received or "a stop signal on another rank"
                return
            self._between_steps()

    def _step(self, group: list, step_samples) -> StepResult:
        """One optimizer step on the micro-batches ``group``; advances the schedule and the data position."""
        info, precision, scaler, optimizer, t = self.info, self.precision, self.scaler, self.optimizer, self.t
        counts = torch.tensor(self.token_counts.totals(step_samples), dtype=torch.float64, device=info.device)
        stop = lambda: self.stop.local_flag  # noqa: E731 - read after the step's last backward: the step in flight
        outcome = forward_backward_timed(self.wrapped, group, info, counts, precision, scaler, stop)
        loss, counts = outcome.loss, outcome.counts
        # The gradients are already averaged over the ranks, so every rank unscales the same numbers, and finds the
        # same inf/nan: the scaler skips the same steps everywhere with no extra collective.
        scaler.unscale_(optimizer)
        if t.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, t.max_grad_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.trainable if p.grad is not None])
        lr = self.scheduler.get_last_lr()[0]
        scaler.step(optimizer)  # optimizer.step(), unless float16 gradients overflowed
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        # Every logged scalar in one device-to-host transfer (the step's one wait for the device).
        logged = [loss.double(), grad_norm.double(), counts[1].double(), *outcome.compute_ms]
        logged += list(outcome.stop_flags)
        if precision.loss_scaling:
            logged.append(scaler._get_scale_async().double())  # the tensor behind get_scale(), unread
        loss, grad_norm, input_tokens, *rest = torch.stack(logged).tolist()
        world = info.world_size
        scale = rest[2 * world :]
        skipped = precision.loss_scaling and not math.isfinite(grad_norm)  # inf/nan: the scaler skipped
        if not skipped:
            self.scheduler.step()
        self.state.global_step += 1
        self.state.sample_in_epoch += t.effective_batch
        self.state.samples_seen += t.effective_batch
        return StepResult(
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            input_tokens=int(input_tokens),
            compute_ms=rest[:world],
            stop_flags=rest[world : 2 * world],
            loss_scale=scale[0] if scale else None,
            skipped=skipped,
        )

    def _log_step(self, result: StepResult) -> None:
        """The step's record (throughput, rank balance, loss scale, communication) to the sink and progress bar."""
        state, wrapped = self.state, self.wrapped
        record = train_record(
            step=state.global_step,
            samples_seen=state.samples_seen,
            loss=result.loss,
            lr=result.lr,
            grad_norm=result.grad_norm,
            epoch=state.epoch,
            **self.meter.stop(result.input_tokens),
            **rank_balance(result.compute_ms, self.info.rank),
            **({"expected_peak_gb": self.probe.expected_peak / 1e9} if self.probe else {}),  # beside peak_mem_gb
        )
        if self.precision.loss_scaling:
            record.update({"loss_scale": result.loss_scale, "skipped": int(result.skipped)})
        if isinstance(wrapped, BucketedDDP):
            record.update(wrapped.pop_comm_stats().as_dict())
        record.update(self.compile_watch.snapshot() if self.compile_watch else {})
        self.sink.log(record)
        if isinstance(wrapped, BucketedDDP) and wrapped.bucket_choice is not None and not self.choice_logged:
            self.sink.log(bucket_choice_record(step=state.global_step, choice=wrapped.bucket_choice))
            self.choice_logged = True
        self.first_loss = result.loss if self.first_loss is None else self.first_loss
        self.last_loss = result.loss
        self.progress.update(1)
        self.progress.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")

    def _between_steps(self) -> None:
        """The periodic evaluation and checkpoint (never after the last step: ``_finish`` does both there)."""
        step, t = self.state.global_step, self.t
        if step >= self.total_steps:
            return
        if self.has_eval and t.eval_every and step % t.eval_every == 0:
            self._evaluate()
        if t.save_every and step % t.save_every == 0:
            self._save()

    # -- evaluation, checkpoints, the end ------------------------------------------------------------------------

    def _evaluate(self) -> None:
        t, state = self.t, self.state
        self.eval_loss = evaluate(
            self.model, self.eval_set, self.parts.collate, t.micro_batch, self.info, self.precision
        )
        self.sink.log(eval_record(step=state.global_step, samples_seen=state.samples_seen, eval_loss=self.eval_loss))

    def _save(self) -> Path | None:
        self.saved_step = self.state.global_step
        return save_checkpoint(
            self.output_dir,
            self.model,
            self.optimizer,
            self.scheduler,
            self.state,
            self.info,
            self.t.save_total_limit,
            self.loader.layout,
            before_publish=self.parts.faults.checkpoint_partly_written,
            scaler=self.scaler,
        )

    def _stop(self) -> Path | None:
        """Preempted: one checkpoint of the last finished step (unless one holds it already), no final eval."""
        state = self.state
        new_work = state.global_step > self.saved_step
        checkpoint = self._save() if new_work else None
        self.sink.log(
            {
                "type": STOP,
                "step": state.global_step,
                "samples_seen": state.samples_seen,
                "signal": self.stopped_by,
                "checkpoint": str(checkpoint) if checkpoint else None,
            }
        )
        where = f"checkpoint {checkpoint}" if checkpoint else "the latest checkpoint holds this step"
        done = f"{where}; continue with the same command and --resume latest" if self.info.is_main_process else ""
        step = f"{state.global_step} of {self.total_steps}"  # the one line saying where and how to go on: rank 0's
        logger.warning("stopped by %s after step %s: %s", self.stopped_by, step, done or "rank 0 saved the checkpoint")
        return checkpoint

    def _finish(self) -> Path | None:
        """The final evaluation and checkpoint."""
        if self.has_eval:
            self._evaluate()
        checkpoint = self._save()
        logger.info(
            "done: %d steps, loss %s -> %s, eval loss %s",
            self.state.global_step,
            self.first_loss,
            self.last_loss,
            self.eval_loss,
        )
        return checkpoint
