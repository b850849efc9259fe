"""HF Trainer with BucketedDDP.

``BucketedTrainer`` replaces ``transformers.Trainer``; TRL-style subclasses derive from it the same way.
The Trainer's own ``Accelerator`` is adopted as a :class:`BucketedAccelerator` right after it is built.
So ``prepare`` wraps with BucketedDDP, and every ``unwrap_model`` sees through the wrapper.
This module holds the step's one all-gather, the stop agreement and the step guard.
The data plan is in ``trainer_plan``, the atomic checkpoints in ``trainer_checkpoints``.
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
from ..report.records import METRICS_FILE
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
    """Ends training with a checkpoint once the ranks agree a stop signal arrived."""

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
    """Starts the clock of each optimizer step's compute; ``training_step`` stops it."""

    def __init__(self, trainer: BucketedTrainer) -> None:
        self._trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        self._trainer._step_started = time.perf_counter()


class BucketedTrainer(PlannedData, AtomicCheckpoints, Trainer):
    """``transformers.Trainer`` that trains multi-process runs with BucketedDDP.

    Args:
        *args: passed to ``Trainer``.
        ddp_settings (DDPSettings | None): BucketedDDP knobs. Default: ``DDPSettings()``.
        balance_ranks (bool): split each step's samples over ranks by ``balanced_plan``, keeping the Trainer's
            steps and schedule (``trainer_plan``). Refuses rows it cannot cost. Default: False.
        **kwargs: passed to ``Trainer``.

    Raises:
        RuntimeError: ``WORLD_SIZE`` > 1 but ``args.world_size`` is 1 (without CUDA, ``use_cpu=True`` is missing).

    Example:
        >>> trainer = BucketedTrainer(model=model, args=args, train_dataset=rows, balance_ranks=True)
        >>> trainer.train()
    """

    accelerator_class: type[BucketedAccelerator] = BucketedAccelerator

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
        self._local_tokens: torch.Tensor | None = None  # this rank's input tokens since the last step
        self._step_started = 0.0
        self._compute_ms: float | None = None
        self._step_balance: dict[str, float] | None = None
        self._answer_counts = None
        # (step, planned answer tokens, this rank's count)
        self._planned_answers: tuple[int, int, torch.Tensor] | None = None
        self._parameter_count: tuple[int, int] | None = None  # (id of the model, its count) for the flops
        self._step_flos: tuple[int, float] | None = None
        self._step_loss: tuple[int, float] | None = None
        self._stop = StopSignal()
        self._stop_verdict: tuple[int, bool] = (-1, False)
        self.stopped_by: str | None = None
        self._run_hooks = run_hooks()
        self._staging_dir: str | None = None
        # By type: TRL's online trainers take ``args`` after ``reward_funcs``.
        training_args = kwargs.get("args") or next((a for a in args if isinstance(a, TrainingArguments)), None)
        if training_args is not None:  # before a subclass loads the model
            check_world_seen(training_args.world_size, TRAINER_CPU_FIX)
        super().__init__(*args, **kwargs)
        if balance_ranks:
            check_plan_columns(self.train_dataset, type(self).__name__, self.data_collator)
        if self.args.include_num_input_tokens_seen == "no":
            self.args.include_num_input_tokens_seen = "non_padding"
        self.ddp_settings = self.accelerator.ddp_settings
        ddp_config = {"bucket_cap_mb": self.ddp_settings.bucket_cap_mb, "comm_hook": self.ddp_settings.comm_hook}
        ddp_config["backend"] = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        # A wandb failure must not stop training.
        wandb_switch = WandbSwitch(Path(self.args.output_dir) / METRICS_FILE)
        callbacks = self.callback_handler.callbacks
        callbacks[:] = [GuardedWandbCallback(wandb_switch) if type(c) is WandbCallback else c for c in callbacks]
        # First, so the reporting callbacks log what it adds; the recorder's buckets are BucketedDDP's.
        throughput = ThroughputCallback(
            lambda: self.model_wrapped,
            ddp_config,
            wandb_switch,
            self.pop_step_balance,
            record_backward=lambda model: self.ddp_settings.record_backward(model),
        )
        callbacks.insert(0, throughput)
        self.add_callback(_StopCallback(self))
        self.add_callback(_StepClockCallback(self))
        if balance_ranks:
            self.add_callback(PlanEpochCallback(self))

    def _track_num_input_tokens(self, inputs) -> None:
        """Counts input tokens locally; the synced micro-step gathers them once.

        The stock Trainer gathers the count on every micro-step, a collective and a sync each.
        The counting rule is the Trainer's; its fallbacks cover batches without the main input or a mask.
        Untokenized prompt rows (TRL's GRPO, RLOO) are left to those trainers.
        """
        mode = self.args.include_num_input_tokens_seen
        main_input = getattr(self.model, "main_input_name", "input_ids")
        masked = "attention_mask" in inputs
        pad_id = getattr(self.processing_class, "pad_token_id", None)
        if mode == "no" or not isinstance(inputs, Mapping):  # prompt rows: an online trainer counts its own
            count = None
        elif main_input not in inputs or (mode == "non_padding" and not masked and pad_id is None):
            count = None
            super()._track_num_input_tokens(inputs)
        elif mode == "non_padding":
            count = inputs["attention_mask"].sum() if masked else (inputs[main_input] != pad_id).sum()
        else:
            count = torch.tensor(inputs[main_input].numel())
        if count is not None:
            count = count.to(self.args.device, torch.int64)
            self._local_tokens = count if self._local_tokens is None else self._local_tokens + count
        if self.accelerator.sync_gradients:
            self._gather_step()

    def floating_point_ops(self, inputs) -> int:
        """The Trainer's flops estimate, counting the model's parameters once.

        The stock count walks every parameter on every micro-step, while the device waits for the next step.
        """
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return super().floating_point_ops(inputs)
        if self._parameter_count is None or self._parameter_count[0] != id(self.model):
            self._parameter_count = (id(self.model), self.model.num_parameters(exclude_embeddings=True))
        return 6 * inputs[main_input].numel() * self._parameter_count[1]

    def _gather_step(self) -> None:
        """Runs the optimizer step's one all-gather, after its last backward.

        Each rank sends tokens, answer tokens, stop flag, compute ms, flos and loss as float64.
        The rows feed the token count, the answer check, the stop verdict, the rank balance, flos and the logged loss.
        A subclass adds values through :meth:`_step_values`.

        Raises:
            RuntimeError: the planned answer-token count differs from the ranks' batches.
        """
        from ..training.steps import rank_balance  # import cycle

        step, device = self.state.global_step + 1, self.args.device
        planned = self._planned_answers if self._planned_answers and self._planned_answers[0] == step else None
        nan = torch.tensor(math.nan, dtype=torch.float64, device=device)
        compute_ms = math.nan if self._compute_ms is None else self._compute_ms
        extra = [float(self._stop.local_flag), compute_ms, float(self.current_flos)]
        running_loss = getattr(self, "_tr_loss", None)
        counted = [self._local_tokens, None if planned is None else planned[2], running_loss]
        counted = [nan if t is None else t.to(device, torch.float64).reshape(()) for t in counted]
        mine = torch.cat([torch.stack(counted), torch.tensor(extra, dtype=torch.float64, device=device)])
        contributed = self._step_values()
        if contributed is not None:
            mine = torch.cat([mine, contributed.to(device, torch.float64).reshape(-1)])
        if self.args.world_size > 1:
            per_rank = [torch.empty_like(mine) for _ in range(self.args.world_size)]
            torch.distributed.all_gather(per_rank, mine)
            gathered = torch.stack(per_rank)
        else:
            gathered = mine.unsqueeze(0)
        rows = gathered.tolist()
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
        self._step_loss = (step, math.fsum(losses) / len(losses))
        measured = not any(math.isnan(ms) for ms in compute)
        self._step_balance = rank_balance(list(compute), self.args.process_index) if measured else None

    def _step_values(self) -> torch.Tensor | None:
        """Extension point: this rank's values for the step's all-gather.

        Returns:
            torch.Tensor | None: the same number of values on every rank, sent as float64; None adds nothing.
        """
        return None

    def _read_step_values(self, per_rank: list[list[float]]) -> None:
        """Extension point: every rank's :meth:`_step_values`, in rank order."""

    def _maybe_log_save_evaluate(
        self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=None
    ) -> None:
        """The Trainer's, logging the ranks' mean loss from the step's gather."""
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
            self.log(logs, start_time)
        super()._maybe_log_save_evaluate(
            tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=learning_rate
        )

    def _gathered_loss(self) -> float | None:
        """The ranks' mean loss from this step's gather, or None without one."""
        step, loss = self._step_loss or (-1, math.nan)
        if self.args.world_size == 1 or step != self.state.global_step or math.isnan(loss):
            return None
        return loss if step > self._globalstep_last_logged else None

    def _finalize_training(self, trial, num_train_samples, start_time):
        """The Trainer's, adding the ranks' mean loss since the last log.

        So ``train_loss`` is the same on every rank and does not depend on ``logging_steps``.
        """
        gathered = self._gathered_loss()
        if gathered is not None:
            self._total_loss_scalar += gathered
            self._tr_loss -= self._tr_loss
        return super()._finalize_training(trial, num_train_samples, start_time)

    def store_flos(self) -> None:
        """The Trainer's, with the ranks' flos from the step's gather."""
        step_flos = self._step_flos
        if self.args.world_size > 1 and step_flos is not None and step_flos[0] == self.state.global_step:
            self.state.total_flos += step_flos[1]
            self.current_flos = 0
            self._step_flos = (step_flos[0], 0.0)  # a second store at this step adds nothing
        else:
            super().store_flos()

    def pop_step_balance(self) -> dict[str, float] | None:
        """The ranks' balance of the step just finished, then None.

        Returns:
            dict[str, float] | None: compute max and min, imbalance and wait, or None.
        """
        balance, self._step_balance = self._step_balance, None
        return balance

    def stop_requested(self) -> bool:
        """Whether any rank got SIGTERM or SIGUSR1 by the step just finished.

        Every rank calls it at ``on_step_end`` and gets the same answer.

        Returns:
            bool: True when training should stop.
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
        """Starts from ``self.model`` when ``model_wrapped`` is an evaluation leftover.

        A compiled model left by ``evaluate()`` would otherwise pass as already wrapped.
        """
        if training and self.args.world_size > 1 and not isinstance(model, BucketedDDP):
            model = self.model
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    def prediction_step(self, model: torch.nn.Module, inputs, prediction_loss_only: bool, ignore_keys=None):
        """The Trainer's step, with each batch's loss its own token mean.

        Averaging tokens across devices skews ``eval_loss`` once Accelerate drops duplicate samples.
        With eval batch size 1, ``eval_loss`` is then the per-sample mean on any world size.
        """
        averaging = self.args.average_tokens_across_devices
        self.args.average_tokens_across_devices = False
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        finally:
            self.args.average_tokens_across_devices = averaging

    def training_step(self, model: torch.nn.Module, inputs, num_items_in_batch=None) -> torch.Tensor:
        """The Trainer's step, refused for a multi-process model that is not BucketedDDP.

        On the synced micro-step it also records this rank's compute time.

        Raises:
            RuntimeError: world size > 1 and ``model`` is not a BucketedDDP.
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
        """The Trainer's ``train``, stopping with a checkpoint on SIGTERM or SIGUSR1.

        ``stopped_by`` names the signal.
        """
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
        self.accelerator.micro_batch_fix = trainer_fix
        # The Trainer bound these to the replaced accelerator.
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(
                self.gather_function, use_gather_object=self.args.eval_use_gather_object
            )
