"""HF Trainer with BucketedDDP (its callbacks: ``ddp_ft.integrations.callbacks``).

``BucketedTrainer`` is a drop-in for ``transformers.Trainer`` (and TRL-style subclasses: derive from it the
same way). The Trainer builds its own ``Accelerator`` and lets it wrap the model; we adopt that accelerator
as a :class:`BucketedAccelerator` right after it is built, so ``accelerator.prepare`` wraps with BucketedDDP,
``no_sync`` during accumulation is ours, and every ``unwrap_model`` (saving, checkpoints,
``resume_from_checkpoint``) sees through the wrapper. (``_wrap_model`` alone would leave Accelerate unaware
of the wrapper, so unwrapping and the DDP kwargs would still belong to torch DDP.)

This module holds the step: its one all-gather (tokens, stop flag, compute time, flos, loss, a subclass's values),
the stop agreement and the training step's guard. The data plan (``balance_ranks``) is in ``trainer_plan``, the
atomic checkpoints in ``trainer_checkpoints``: mixins of ``BucketedTrainer``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.integrations import WandbCallback

from ..ddp import BucketedDDP, DDPSettings
from ..distributed.launch import TRAINER_CPU_FIX, check_world_seen
from ..report.metrics import WandbSwitch
from ..training.hooks import run_hooks
from ..training.perf_traps import trainer_fix
from ..training.preemption import StopSignal
from .accelerate import BucketedAccelerator
from .callbacks import GuardedWandbCallback, ThroughputCallback
from .trainer_checkpoints import AtomicCheckpoints
from .trainer_plan import PlanEpochCallback, PlannedData, check_plan_columns

if TYPE_CHECKING:
    from ..training.data import StepBatchSampler

logger = logging.getLogger(__name__)


class _StopCallback(TrainerCallback):
    """Ends training with a checkpoint at the step where the ranks agree a stop signal arrived."""

    def __init__(self, trainer: BucketedTrainer) -> None:
        self._trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self._trainer._run_hooks.start(state.global_step, args.gradient_accumulation_steps)

    def on_step_end(self, args, state, control, **kwargs):
        if self._trainer.stop_requested():
            control.should_save = True
            control.should_training_stop = True
            logger.info("stopping after step %d (%s): saving a checkpoint", state.global_step, self._trainer.stopped_by)


class _StepClockCallback(TrainerCallback):
    """Starts the clock of each optimizer step's compute, right before its first micro-step (the step's batches are
    already drawn, as the plain loop's); ``BucketedTrainer.training_step`` stops it after the step's last backward."""

    def __init__(self, trainer: BucketedTrainer) -> None:
        self._trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        self._trainer._step_started = time.perf_counter()


class BucketedTrainer(PlannedData, AtomicCheckpoints, Trainer):
    """``transformers.Trainer`` that trains multi-process runs with BucketedDDP.

    Args:
        *args: passed to ``Trainer``.
        ddp_settings (DDPSettings | None): BucketedDDP knobs. Default: ``DDPSettings()``.
        balance_ranks (bool): train each optimizer step's samples split over ranks and micro-batches by
            ``balanced_plan`` (``ddp_ft.training.data.balance``), as the plain loop's ``EpochLoader`` does (the same
            global order: ``DistributedSampler``'s, seeded by ``data_seed`` or ``seed`` plus the epoch), with the stock
            Trainer's steps: the same micro-batches per rank, optimizer steps and learning-rate schedule, every sample
            of the epoch trained unless ``dataloader_drop_last`` (``ddp_ft.integrations.trainer_plan``); settings it
            cannot keep are refused, and so are rows it cannot cost (``check_plan_columns``: ``input_ids``, or TRL's
            DPO, reward and KTO rows by their padded width). Default: False (the stock Trainer's sampling)
        **kwargs: passed to ``Trainer``.

    Raises:
        RuntimeError: launched with ``WORLD_SIZE`` > 1 while ``args.world_size`` is 1 (on a machine without CUDA,
            ``use_cpu=True`` is missing), before the model is touched.
    """

    accelerator_class: type[BucketedAccelerator] = BucketedAccelerator  # what the Trainer's accelerator is adopted as

    def __init__(
        self,
        *args,
        ddp_settings: DDPSettings | None = None,
        balance_ranks: bool = False,
        **kwargs,
    ) -> None:
        self.ddp_settings = ddp_settings or DDPSettings()
        self.balance_ranks = balance_ranks
        self._plan_sampler: StepBatchSampler | None = None
        self._local_tokens: torch.Tensor | None = None  # this rank's input tokens since the last optimizer step
        self._step_started = 0.0  # perf_counter() at the current optimizer step's begin (``_StepClockCallback``)
        self._compute_ms: float | None = None  # this rank's compute of the current step, once its last backward is done
        self._step_balance: dict[str, float] | None = None  # the ranks' balance of the step just finished
        self._answer_counts = None  # StepTokenCounts of the planned train set, when its rows have labels
        # (step, its answer tokens from the plan, this rank's by the Trainer's rule): checked in the step's gather
        self._planned_answers: tuple[int, int, torch.Tensor] | None = None
        self._step_flos: tuple[int, float] | None = None  # (step, the ranks' summed flos since the last store_flos)
        self._step_loss: tuple[int, float] | None = None  # (step, the ranks' mean of the Trainer's running loss)
        self._stop = StopSignal()
        self._stop_verdict: tuple[int, bool] = (-1, False)  # (global step, any rank asked to stop)
        self.stopped_by: str | None = None  # the signal that stopped train() early, after saving a checkpoint
        self._run_hooks = run_hooks()  # inert unless a harness installed some (ddp_ft.training.hooks)
        self._staging_dir: str | None = None
        # Found by type: TRL's online trainers take ``args`` third, after ``reward_funcs``.
        training_args = kwargs.get("args") or next((a for a in args if isinstance(a, TrainingArguments)), None)
        if training_args is not None:  # before a subclass (TRL's SFTTrainer) loads or wraps the model
            check_world_seen(training_args.world_size, TRAINER_CPU_FIX)
        super().__init__(*args, **kwargs)
        if balance_ranks:  # the rows as the subclass prepared them, before any step
            check_plan_columns(self.train_dataset, type(self).__name__, self.data_collator)
        if self.args.include_num_input_tokens_seen == "no":
            self.args.include_num_input_tokens_seen = "non_padding"
        self.ddp_settings = self.accelerator.ddp_settings  # resolved with the TrainingArguments' ddp_* fields
        ddp_config = {"bucket_cap_mb": self.ddp_settings.bucket_cap_mb, "comm_hook": self.ddp_settings.comm_hook}
        # A wandb failure must not stop training: both callbacks that call wandb share one switch that turns it off.
        wandb_switch = WandbSwitch(Path(self.args.output_dir) / "metrics.jsonl")
        callbacks = self.callback_handler.callbacks
        callbacks[:] = [GuardedWandbCallback(wandb_switch) if type(c) is WandbCallback else c for c in callbacks]
        # First in line, so the reporting callbacks (wandb, console) log what it adds.
        callbacks.insert(
            0, ThroughputCallback(lambda: self.model_wrapped, ddp_config, wandb_switch, self.pop_step_balance)
        )
        self.add_callback(_StopCallback(self))
        self.add_callback(_StepClockCallback(self))
        if balance_ranks:
            self.add_callback(PlanEpochCallback(self))

    def _track_num_input_tokens(self, inputs) -> None:
        """Count input tokens on this rank every micro-step; on the synced one, the step's one collective.

        The stock Trainer all-gathers the count and reads it on the host after every micro-step: a collective and a
        device sync on each ``no_sync`` micro-step. Here the count stays a local tensor until the synced micro-step
        (the last of the step), whose single all-gather (:meth:`_gather_step`) updates
        ``state.num_input_tokens_seen`` before any ``on_step_end`` callback reads it. Same counting rule as the
        Trainer: ``non_padding`` sums the attention mask (without one, as for TRL's padding-free batches and
        ``PackedCollator``'s rows, counts the tokens other than the tokenizer's pad token), ``all`` counts every
        position; without the main input, or for ``non_padding`` without a mask or a pad token, the Trainer counts
        itself. A batch of rows not yet tokenized (the prompts TRL's GRPO and RLOO draw) is not counted here: those
        trainers add their prompt and completion tokens to ``state.num_input_tokens_seen`` themselves.
        """
        mode = self.args.include_num_input_tokens_seen
        main_input = getattr(self.model, "main_input_name", "input_ids")
        masked = "attention_mask" in inputs
        pad_id = getattr(self.processing_class, "pad_token_id", None)
        if mode == "no" or not isinstance(inputs, Mapping):  # rows of prompts: an online trainer counts its own
            count = None
        elif main_input not in inputs or (mode == "non_padding" and not masked and pad_id is None):
            count = None
            super()._track_num_input_tokens(inputs)  # the Trainer's fallbacks and warning
        elif mode == "non_padding":
            count = inputs["attention_mask"].sum() if masked else (inputs[main_input] != pad_id).sum()
        else:
            count = torch.tensor(inputs[main_input].numel())
        if count is not None:
            count = count.to(self.args.device, torch.int64)
            self._local_tokens = count if self._local_tokens is None else self._local_tokens + count
        if self.accelerator.sync_gradients:
            self._gather_step()

    def _gather_step(self) -> None:
        """The optimizer step's one collective besides the buckets' all-reduces, after its last backward.

        Each rank sends [input tokens, its answer tokens, stop flag, compute ms, flos, running loss] (float64: exact
        for counts below 2**53; NaN for what was not counted) and reads the gathered rows once: the Trainer's
        input-token count, the check of the planned answer count (:meth:`_get_num_items_in_batch`), whether any
        rank was asked to stop (:meth:`stop_requested`), the ranks' balance of this very step
        (``ddp_ft.training.steps.rank_balance``, as the plain loop; :meth:`pop_step_balance` hands it to
        ``ThroughputCallback``), the ranks' summed flos (:meth:`store_flos`) and their mean loss for the log
        (:meth:`_maybe_log_save_evaluate`). The Trainer's ``_tr_loss`` and ``current_flos`` already hold the step's
        last micro-step here. On one process: no collective, the rank's own numbers (imbalance 1.0, no wait). A step
        whose compute was not measured gets no balance, on every rank alike. A subclass adds values of its own to the
        same gather through :meth:`_step_values` and reads them back in :meth:`_read_step_values`.

        Raises:
            RuntimeError: the step's loss was divided by a planned answer-token count that differs from the
                ranks' batches (before the optimizer step, on every rank).
        """
        from ..training.steps import rank_balance  # here: ddp_ft.training.steps imports ddp_ft.training.data

        step, device = self.state.global_step + 1, self.args.device
        planned = self._planned_answers if self._planned_answers and self._planned_answers[0] == step else None
        nan = torch.tensor(math.nan, dtype=torch.float64, device=device)
        compute_ms = math.nan if self._compute_ms is None else self._compute_ms
        extra = [float(self._stop.local_flag), compute_ms, float(self.current_flos)]
        running_loss = getattr(self, "_tr_loss", None)  # the Trainer's running loss (transformers 5.23)
        counted = [self._local_tokens, None if planned is None else planned[2], running_loss]
        counted = [nan if t is None else t.to(device, torch.float64).reshape(()) for t in counted]
        mine = torch.cat([torch.stack(counted), torch.tensor(extra, dtype=torch.float64, device=device)])
        contributed = self._step_values()  # a subclass's own per-rank values ride on the same gather
        if contributed is not None:
            mine = torch.cat([mine, contributed.to(device, torch.float64).reshape(-1)])
        if self.args.world_size > 1:
            per_rank = [torch.empty_like(mine) for _ in range(self.args.world_size)]
            torch.distributed.all_gather(per_rank, mine)
            gathered = torch.stack(per_rank)
        else:
            gathered = mine.unsqueeze(0)
        rows = gathered.tolist()  # one transfer
        tokens, answers, losses, stops, compute, flos = zip(*(row[:6] for row in rows), strict=True)
        if contributed is not None:
            self._read_step_values([row[6:] for row in rows])
        self._local_tokens, self._compute_ms, self._planned_answers = None, None, None
        if planned is not None and sum(answers) != planned[1]:
            raise RuntimeError(
                f"BucketedTrainer: step {step}'s loss was averaged over {planned[1]} answer tokens, counted from the "
                f"training rows' labels for the balanced plan, but the ranks' batches hold {int(sum(answers))} "
                "(labels other than -100 after the shift). The collator changes the labels after the rows are "
                "read; give the rows their final labels, or train with balance_ranks=False (--no-balance-ranks) "
                "to count them on every step."
            )
        if not math.isnan(tokens[0]):
            self.state.num_input_tokens_seen += int(sum(tokens))
        self._stop_verdict = (step, any(stops))
        self._step_flos = (step, sum(flos))
        self._step_loss = (step, math.fsum(losses) / len(losses))  # the Trainer's mean, in float64 (its: float32)
        measured = not any(math.isnan(ms) for ms in compute)
        self._step_balance = rank_balance(list(compute), self.args.process_index) if measured else None

    def _step_values(self) -> torch.Tensor | None:
        """Extension point: this rank's own values for the optimizer step's all-gather (:meth:`_gather_step`).

        Returns:
            torch.Tensor | None: any shape and dtype, sent as float64 (exact for integers below 2**53 and for
            float32/bfloat16 values); the same number of values on every rank. None (the default): nothing to add.
        """
        return None

    def _read_step_values(self, per_rank: list[list[float]]) -> None:
        """Extension point: every rank's :meth:`_step_values` from the step's all-gather, in rank order (called on
        every rank, after the step's last backward and before its ``on_step_end`` callbacks and log)."""

    def _maybe_log_save_evaluate(
        self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=None
    ) -> None:
        """The Trainer's, logging on several processes the ranks' mean loss from the step's all-gather
        (:meth:`_gather_step`) instead of all-gathering it again at every log. The log is the Trainer's: the loss
        averaged over the steps since the last log, the gradient norm and the learning rate."""
        gathered, state = self._gathered_loss(), self.state
        if self.control.should_log and gathered is not None:
            logs = {"loss": gathered / (state.global_step - self._globalstep_last_logged)}
            tr_loss -= tr_loss
            if grad_norm is not None:
                logs["grad_norm"] = grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm
            logs["learning_rate"] = learning_rate if learning_rate is not None else self._get_learning_rate()
            self._total_loss_scalar += gathered
            self._globalstep_last_logged = state.global_step
            self.store_flos()
            self.log(logs, start_time)  # the Trainer below then only evaluates and saves, as it would
        super()._maybe_log_save_evaluate(
            tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=learning_rate
        )

    def _gathered_loss(self) -> float | None:
        """The ranks' mean running loss since the last log, from this step's all-gather (:meth:`_gather_step`); None
        on one process, with nothing since the last log, or when this step had no gather or a NaN loss."""
        step, loss = self._step_loss or (-1, math.nan)
        if self.args.world_size == 1 or step != self.state.global_step or math.isnan(loss):
            return None
        return loss if step > self._globalstep_last_logged else None

    def _finalize_training(self, trial, num_train_samples, start_time):
        """The Trainer's, with the same ``train_loss`` on every rank. The Trainer adds the loss since the last log
        ungathered: each rank's own rows' share. Here the ranks' mean is added, as a log at that step would add it.
        So ``train_loss`` does not depend on ``logging_steps`` (nor, with ``balance_ranks``, on the rank)."""
        gathered = self._gathered_loss()
        if gathered is not None:
            self._total_loss_scalar += gathered
            self._tr_loss -= self._tr_loss
        return super()._finalize_training(trial, num_train_samples, start_time)

    def store_flos(self) -> None:
        """The Trainer's, with the ranks' flos from the step's all-gather (:meth:`_gather_step`) instead of an
        all-gather of its own at every log; the Trainer's own on one process or at a step with no gather."""
        step_flos = self._step_flos
        if self.args.world_size > 1 and step_flos is not None and step_flos[0] == self.state.global_step:
            self.state.total_flos += step_flos[1]
            self.current_flos = 0
            self._step_flos = (step_flos[0], 0.0)  # stored: a second store at this step adds nothing, as the Trainer's
        else:
            super().store_flos()

    def pop_step_balance(self) -> dict[str, float] | None:
        """The ranks' balance of the optimizer step just finished (``compute_max_ms``, ``compute_min_ms``,
        ``imbalance``, ``wait_for_slowest_ms``), then None until the next step's."""
        balance, self._step_balance = self._step_balance, None
        return balance

    def stop_requested(self) -> bool:
        """Whether any rank received SIGTERM/SIGUSR1 by the optimizer step just finished; the same on every rank.

        Read from that step's all-gather (:meth:`_gather_step`); a step that had none reduces the flag on its own.
        Called by every rank at the same point (``on_step_end``).
        """
        step, verdict = self._stop_verdict
        if step != self.state.global_step:
            flag = torch.tensor([self._stop.local_flag], device=self.args.device)
            if self.args.world_size > 1:
                torch.distributed.all_reduce(flag)
            verdict = bool(flag.item() > 0)
            self._stop_verdict = (self.state.global_step, verdict)
        if verdict and self.stopped_by is None:
            self.stopped_by = self._stop.received or "a stop signal on another rank"
        return verdict

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader=None) -> torch.nn.Module:
        """For multi-process training, anything but a BucketedDDP in ``model_wrapped`` is a leftover of evaluation
        (``trainer.evaluate()`` before ``train()`` with ``torch_compile`` leaves the compiled model there, which
        the Trainer would take as already wrapped): start again from ``self.model`` so it is prepared, and wrapped,
        for training."""
        if training and self.args.world_size > 1 and not isinstance(model, BucketedDDP):
            model = self.model
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    def prediction_step(self, model: torch.nn.Module, inputs, prediction_loss_only: bool, ignore_keys=None):
        """The Trainer's step with each batch's loss its own token mean, as on one process.

        With ``average_tokens_across_devices`` the stock step divides a batch's summed loss by the answer tokens of
        *all* ranks' batches and multiplies by the world size. That is right for a gradient, but the evaluation loop
        averages the per-rank values it gathers, and ``gather_for_metrics`` drops the duplicate samples that
        Accelerate's even batches add to the last step: the value left for the last real sample was divided by
        the tokens of the dropped duplicates too, and the per-rank values only average right in pairs (measured on
        the tiny model and 5 samples: eval_loss 7.68 on 2 ranks, 7.44 on one process). With each batch's own mean,
        ``per_device_eval_batch_size=1`` gives the mean of the per-sample losses on every world size
        (``tests/training/test_eval_uneven.py``); larger eval batches give the stock Trainer's mean of batch means, which
        depends on how the samples fall into batches, so on the world size.
        """
        averaging = self.args.average_tokens_across_devices
        self.args.average_tokens_across_devices = False
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        finally:
            self.args.average_tokens_across_devices = averaging

    def training_step(self, model: torch.nn.Module, inputs, num_items_in_batch=None) -> torch.Tensor:
        """The Trainer's step, refused for a multi-process run whose model is not BucketedDDP.

        On the synced micro-step it also takes this rank's compute of the optimizer step: from the step's begin to
        the wrapper's last gradient (``BucketedDDP.last_gradient_ready_at``, host time; on one process, or without
        one, when backward returned), the plain loop's measure (``ddp_ft.training.steps.forward_backward_timed``).

        Raises:
            RuntimeError: world size > 1 and ``model`` is not a BucketedDDP: its gradients would not be averaged,
                and the ranks would train apart while looking like a DDP run.
        """
        if self.args.world_size > 1 and not isinstance(model, BucketedDDP):
            raise RuntimeError(
                f"BucketedTrainer: a training step at world size {self.args.world_size} with a model not wrapped in "
                f"BucketedDDP ({type(model).__name__}): the ranks would train apart. The model reached the step "
                "unwrapped through some preparation path; prepare it with BucketedAccelerator.prepare (or report "
                "the path to ddp_ft)."
            )
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:
            ready = getattr(model, "last_gradient_ready_at", None)
            ended = ready if ready is not None and ready > self._step_started else time.perf_counter()
            self._compute_ms = (ended - self._step_started) * 1e3
        return loss

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """The Trainer's ``train``, stopping gracefully on SIGTERM/SIGUSR1 to any rank: the ranks agree at the next
        optimizer step, the Trainer saves its checkpoint there and returns; ``stopped_by`` names the signal."""
        if resume_from_checkpoint and self.ddp_settings.comm_hook == "powersgd":
            logger.warning(
                "comm_hook powersgd: PowerSGD's state (error feedback, warm-start matrices, its step "
                "count) is not in checkpoints; the resumed run starts it afresh, so it does not continue "
                "the uninterrupted run exactly."
            )
        self.stopped_by = None
        with self._stop:
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator = self.accelerator_class.adopt(self.accelerator, self.ddp_settings, self.args)
        self.accelerator.micro_batch_fix = trainer_fix  # the idle-device warning in TrainingArguments' terms
        # The Trainer bound these to the accelerator just replaced: bind them to ours (as Trainer.__init__ does).
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(
                self.gather_function, use_gather_object=self.args.eval_use_gather_object
            )
