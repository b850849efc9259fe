"""The plain PyTorch training loop, every mechanism in sight.

One optimizer step is ``accumulation`` micro-batches per rank; only the last one communicates. The loss is
normalised over the whole effective batch, so any world size computes the same gradient.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch

from ..distributed import DistInfo
from .checkpoint import save_checkpoint, save_final
from .config import RunSettings
from .data.step_tokens import StepTokenCounts, global_order
from .predict import PREDICTIONS_FILE, predict_rows, rouge_l, write_predictions
from .preemption import StopSignal
from .run import Run, build_run
from .run_log import RunLog
from .steps import StepResult, evaluate, forward_backward_timed

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a finished run reports; paths are rank 0's."""

    steps: int
    first_loss: float | None
    last_loss: float | None
    eval_loss: float | None
    output_dir: str
    checkpoint: str | None
    stopped_by: str | None = None  # the signal that stopped the run early


def train(settings: RunSettings, info: DistInfo) -> TrainResult:
    """Run the fine-tune ``settings`` describe on this rank; every check fails before training.

    A stop signal to any rank stops all ranks at one step with one checkpoint; ``stopped_by`` names it.

    Args:
        settings (RunSettings): the run's settings.
        info (DistInfo): this rank.

    Returns:
        TrainResult: steps, losses and the last checkpoint.

    Example:
        >>> result = train(settings_from_preset("tiny"), init_distributed())
    """
    with StopSignal() as stop:
        return _Loop(build_run(settings, info), stop).train()


class _Loop:
    """Trains one built run on this rank: steps, periodic evaluation and checkpoints, then the end."""

    def __init__(self, run: Run, stop: StopSignal) -> None:
        self.run, self.stop, self.t, self.state = run, stop, run.settings.train, run.state
        self.log = RunLog(run)
        self.token_counts = StepTokenCounts(run.parts.train_set)
        self.eval_loss: float | None = None
        self.stopped_by: str | None = None
        self.saved_step = run.state.global_step  # a checkpoint already holds this step
        self.has_eval = len(run.parts.eval_set) > 0  # an empty sum is not 0
        run.parts.hooks.start(run.state.global_step, run.resolved.accumulation)

    def train(self) -> TrainResult:
        """Train to ``total_steps`` or a stop signal, then evaluate and save."""
        state, run = self.state, self.run
        run.model.train()
        try:
            while state.global_step < run.total_steps and self.stopped_by is None:
                self._epoch()
            checkpoint = self._stop() if self.stopped_by is not None else self._finish()
        finally:
            self.log.close()
        return TrainResult(
            state.global_step,
            self.log.first_loss,
            self.log.last_loss,
            self.eval_loss,
            str(run.output_dir),
            str(checkpoint) if checkpoint else None,
            self.stopped_by,
        )

    def _epoch(self) -> None:
        """Optimizer steps to the end of this epoch, ``total_steps`` or a stop signal."""
        state, t, run = self.state, self.t, self.run
        batches = run.loader.epoch(state.epoch, start_sample=state.sample_in_epoch)
        order = global_order(len(run.parts.train_set), t.seed, state.epoch)  # every rank sees every step's samples
        while state.global_step < run.total_steps:
            accumulation = run.resolved.accumulation
            group = list(islice(batches, accumulation))
            if len(group) < accumulation:  # epoch done
                state.epoch, state.sample_in_epoch = state.epoch + 1, 0
                return
            self.log.meter.start()
            # The step's global token counts, from the global order: no collective.
            step_samples = order[state.sample_in_epoch : state.sample_in_epoch + t.effective_batch]
            result = self._step(group, step_samples)
            self.log.step(result)
            if any(result.stop_flags) and state.global_step < run.total_steps:
                # Every rank read the same flags, so all stop after this step.
                self.stopped_by = self.stop.received or "a stop signal on another rank"
                return
            if run.compile_watch:
                run.compile_watch.pause()  # evaluation's graphs are not recompilations
            self._between_steps()
            if run.compile_watch:
                run.compile_watch.resume()

    def _step(self, group: list, step_samples) -> StepResult:
        """One optimizer step; advances the schedule and the data position."""
        run, t = self.run, self.t
        info, precision, scaler, optimizer = run.info, run.resolved.precision, run.scaler, run.optimizer
        counts = torch.tensor(self.token_counts.totals(step_samples), dtype=torch.float64, device=info.device)
        stop = lambda: self.stop.local_flag  # noqa: E731 - read after the last backward
        outcome = forward_backward_timed(run.wrapped, group, info, counts, precision, scaler, stop)
        loss, counts = outcome.loss, outcome.counts
        # Gradients are averaged already, so every rank finds the same inf/nan and skips the same steps.
        scaler.unscale_(optimizer)
        if t.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(run.trainable, t.max_grad_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in run.trainable if p.grad is not None])
        lr = run.scheduler.get_last_lr()[0]
        scaler.step(optimizer)  # unless float16 gradients overflowed
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        # Every logged scalar in one device-to-host transfer.
        logged = [loss.double(), grad_norm.double(), counts[1].double(), *outcome.compute_ms]
        logged += list(outcome.stop_flags)
        if precision.loss_scaling:
            logged.append(scaler._get_scale_async().double())  # get_scale() without a sync
        loss, grad_norm, input_tokens, *rest = torch.stack(logged).tolist()
        world = info.world_size
        scale = rest[2 * world :]
        skipped = precision.loss_scaling and not math.isfinite(grad_norm)
        if not skipped:
            run.scheduler.step()
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

    def _between_steps(self) -> None:
        """The periodic evaluation and checkpoint, never after the last step."""
        step, t = self.state.global_step, self.t
        if step >= self.run.total_steps:
            return
        if self.has_eval and t.eval_every and step % t.eval_every == 0:
            self._evaluate()
        if t.save_every and step % t.save_every == 0:
            self._save()

    # -- evaluation, checkpoints, the end ------------------------------------------------------------------------

    def _evaluate(self) -> None:
        run = self.run
        self.eval_loss = evaluate(
            run.model, run.parts.eval_set, run.parts.collate, run.resolved.micro_batch, run.info, run.resolved.precision
        )
        self.log.evaluation(self.eval_loss)

    def _save(self) -> Path | None:
        run = self.run
        self.saved_step = self.state.global_step
        return save_checkpoint(
            run.output_dir,
            run.model,
            run.optimizer,
            run.scheduler,
            self.state,
            run.info,
            self.t.save_total_limit,
            run.loader.layout,
            before_publish=run.parts.hooks.checkpoint_partly_written,
            scaler=run.scaler,
            tokenizer=run.parts.tokenizer,
            data=run.parts.data_record,
        )

    def _stop(self) -> Path | None:
        """Preempted: save the last finished step unless saved already; no final eval."""
        state = self.state
        new_work = state.global_step > self.saved_step
        checkpoint = self._save() if new_work else None
        self.log.stop(self.stopped_by, str(checkpoint) if checkpoint else None)
        where = f"checkpoint {checkpoint}" if checkpoint else "the latest checkpoint holds this step"
        done = f"{where}; continue with the same command and --resume latest" if self.run.info.is_main_process else ""
        step = f"{state.global_step} of {self.run.total_steps}"  # rank 0 says where and how to go on
        logger.warning("stopped by %s after step %s: %s", self.stopped_by, step, done or "rank 0 saved the checkpoint")
        return checkpoint

    def _predict(self) -> None:
        """``--predict``: rank 0 generates for the first eval samples."""
        run = self.run
        if not run.info.is_main_process:
            return
        rows, data = run.parts.eval_rows, run.settings.data
        predictions = predict_rows(run.model, run.parts.tokenizer, rows, data, self.t.predict, self.t.max_new_tokens)
        score = rouge_l(predictions)
        path = write_predictions(run.output_dir / PREDICTIONS_FILE, predictions)
        self.log.predictions(predictions, score)
        shown = "no answers to score" if score is None else f"ROUGE-L {score:.4f}"
        logger.info("predicted %d eval samples (%s): %s", len(predictions), shown, path)

    def _finish(self) -> Path | None:
        """The final evaluation and checkpoint, ``output_dir/final``, then ``--predict``.

        Predictions come after the saves, the run's last collectives: a failed generation keeps the adapter, and no
        rank waits in a collective, under its timeout, while rank 0 generates.
        """
        if self.has_eval:
            self._evaluate()
        checkpoint = self._save()
        run = self.run
        save_final(run.output_dir, run.model, run.parts.tokenizer, run.parts.data_record, run.info)
        if self.t.predict:
            self._predict()
        logger.info(
            "done: %d steps, loss %s -> %s, eval loss %s",
            self.state.global_step,
            self.log.first_loss,
            self.log.last_loss,
            self.eval_loss,
        )
        return checkpoint
