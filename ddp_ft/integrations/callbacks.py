"""The plugin's Trainer callbacks: throughput and comm stats, a safe wandb callback, a quiet progress bar."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.integrations import WandbCallback
from transformers.trainer_callback import ProgressCallback

from ..ddp import BucketedDDP, CommStats
from ..ddp.timeline import BackwardRecorder
from ..report.metrics import JsonlLogger, ThroughputMeter, WandbSwitch
from ..report.records import (
    METRICS_FILE,
    backward_record,
    bucket_choice_record,
    config_record,
    define_step_metrics,
    eval_record,
    host_record,
    train_record,
)
from ..training.model.compilation import CompileWatch, is_regionally_compiled
from .checkpointing import is_checkpointed

logger = logging.getLogger(__name__)


class ThroughputCallback(TrainerCallback):
    """Adds throughput, step time, peak memory, comm stats and rank balance to every Trainer log.

    Tokens are the Trainer's ``num_input_tokens_seen``, summed over ranks.
    Values average the steps since the previous log.
    Register it before the reporting callbacks so wandb and the console see the values.
    On rank 0 it also writes ``metrics.jsonl`` in the plain loop's format.
    That includes a ``backward`` record per step, for ``ddp-ft forecast``, as the plain loop writes them.
    ``elapsed_s`` is wall time since train begin, so time between steps counts there, not in ``step_time_s``.

    Args:
        wrapped_model (Callable[[], torch.nn.Module] | None): returns the training model, for comm stats. Default: None.
        ddp_config (dict | None): BucketedDDP settings for the run config. Default: None.
        wandb_switch (WandbSwitch | None): shared with the reporting callback. Default: its own.
        step_balance (Callable[[], dict[str, float] | None] | None): returns the step's rank balance. Default: None.
        record_backward (Callable[[torch.nn.Module], BackwardRecorder] | None): builds the one-process run's
            recorder of bucket readiness, removed at train end. Default: None, records nothing.
    """

    def __init__(
        self,
        wrapped_model: Callable[[], torch.nn.Module] | None = None,
        ddp_config: dict | None = None,
        wandb_switch: WandbSwitch | None = None,
        step_balance: Callable[[], dict[str, float] | None] | None = None,
        record_backward: Callable[[torch.nn.Module], BackwardRecorder] | None = None,
    ) -> None:
        self._wrapped_model = wrapped_model
        self._record_backward = record_backward
        self._recorder: BackwardRecorder | None = None
        self._step_balance = step_balance
        self._ddp_config = ddp_config or {}
        self._wandb_switch = wandb_switch
        self._reset()
        self._meter: ThroughputMeter | None = None
        self._memory: dict[str, float] = {}
        self._sink: JsonlLogger | None = None
        self._wandb_config: dict | None = None
        self._choice_logged = False
        self._train_began = time.perf_counter()
        self._step_ended = 0.0  # seconds from train begin to the last step's end
        self._compile_watch: CompileWatch | bool | None = None  # None: not looked yet; False: not compiled

    def _reset(self) -> None:
        self._seconds = 0.0
        self._tokens = 0
        self._steps = 0
        self._comm = CommStats()
        self._balances: list[dict[str, float]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self._reset()
        self._train_began = time.perf_counter()
        if not state.is_world_process_zero:
            return
        world_size = max(1, args.world_size)
        config = config_record(
            run_name=args.run_name,
            world_size=world_size,
            micro_batch=args.per_device_train_batch_size,
            accumulation=args.gradient_accumulation_steps,
            gradient_checkpointing=is_checkpointed(kwargs["model"]) if kwargs.get("model") is not None else None,
            total_steps=state.max_steps,
            resumed_from_step=state.global_step,
            **self._ddp_config,
            **host_record(torch.device(args.device).type, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))),
        )
        self._sink = JsonlLogger(Path(args.output_dir) / METRICS_FILE)
        self._sink.log(config)
        self._start_recording(args, kwargs.get("model"))
        self._wandb_config = {k: v for k, v in config.items() if k != "type"}
        if self._wandb_switch is None:
            self._wandb_switch = WandbSwitch(self._sink.path)

    def _start_recording(self, args, model: torch.nn.Module | None) -> None:
        """Records bucket readiness on one process; several have BucketedDDP's own timeline."""
        self._stop_recording()  # a failed train() left its recorder
        one_device = args.world_size <= 1 and args.n_gpu <= 1  # DataParallel replicates the hooks
        if self._record_backward is not None and model is not None and one_device:
            self._recorder = self._record_backward(model)

    def _stop_recording(self) -> None:
        if self._recorder is not None:
            self._recorder.remove_hooks()
            self._recorder = None

    def on_train_end(self, args, state, control, **kwargs):
        self._stop_recording()

    def _setup_wandb(self) -> None:
        """Configures wandb once the reporting callback has started its run."""
        if self._wandb_config is None:
            return
        try:
            import wandb
        except ImportError:
            return
        if wandb.run is not None:
            config, self._wandb_config = self._wandb_config, None
            self._wandb_switch.call("define_metric/config.update", self._point_wandb_at_samples, wandb, config)

    @staticmethod
    def _point_wandb_at_samples(wandb, config: dict) -> None:
        define_step_metrics(wandb)  # curves of different world sizes overlay by samples
        wandb.config.update(config, allow_val_change=True)

    def on_step_begin(self, args, state, control, **kwargs):
        if self._compile_watch is None:  # the first step: prepared, not yet compiled
            model = self._wrapped_model() if self._wrapped_model else None
            compiled = model is not None and is_regionally_compiled(getattr(model, "module", model))
            self._compile_watch = CompileWatch() if compiled else False
        if self._compile_watch:
            self._compile_watch.resume()
        if self._meter is None:
            self._meter = ThroughputMeter(max(1, args.world_size), torch.device(args.device))
        self._meter.start()
        self._tokens_at_step = state.num_input_tokens_seen

    def on_step_end(self, args, state, control, **kwargs):
        if self._compile_watch:
            self._compile_watch.pause()  # until the next step: an evaluation's graphs are not recompilations
        if self._meter is None:
            return
        step = self._meter.stop(state.num_input_tokens_seen - self._tokens_at_step)
        self._step_ended = time.perf_counter() - self._train_began
        self._seconds += step["step_time_s"]
        self._tokens += step["tokens"]
        for k, v in step.items():  # a GPU's peaks are reset at every step
            if k.startswith("peak_"):
                self._memory[k] = max(v, self._memory.get(k, 0.0))
        self._steps += 1
        model = self._wrapped_model() if self._wrapped_model else None
        if isinstance(model, BucketedDDP):
            self._comm = self._comm + model.pop_comm_stats()
            if model.bucket_choice is not None and self._sink is not None and not self._choice_logged:
                self._sink.log(bucket_choice_record(step=state.global_step, choice=model.bucket_choice))
                self._choice_logged = True
        balance = self._step_balance() if self._step_balance else None
        if balance is not None:
            self._balances.append(balance)
        source = model if isinstance(model, BucketedDDP) else self._recorder
        timeline = source.last_backward_timeline() if source is not None and self._sink is not None else None
        if timeline is not None:  # the step's last backward
            self._sink.log(backward_record(step=state.global_step, **asdict(timeline)))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._setup_wandb()
        if logs is not None and "eval_loss" in logs and self._sink is not None:
            self._sink.log(
                eval_record(
                    step=state.global_step, samples_seen=self._samples(args, state), eval_loss=logs["eval_loss"]
                )
            )
        if logs is None or self._steps == 0 or "loss" not in logs:
            return
        world_size = max(1, args.world_size)
        logs.update(
            {
                "step_time_s": self._seconds / self._steps,
                "tokens_per_s": self._tokens / self._seconds if self._seconds else 0.0,
                "tokens_per_s_per_device": self._tokens / self._seconds / world_size if self._seconds else 0.0,
                "tokens": self._tokens,
                **self._memory,
                "samples_seen": self._samples(args, state),
                "elapsed_s": self._step_ended,
            }
        )
        self._memory = {}
        if self._comm.synced_backwards:
            per_step = {k: v / self._steps for k, v in self._comm.as_dict().items() if k != "comm/overlap"}
            if self._comm.overlap is not None:
                per_step["comm/overlap"] = self._comm.overlap
            logs.update(per_step)
        if self._balances:
            logs.update({k: sum(b[k] for b in self._balances) / len(self._balances) for k in self._balances[0]})
        if self._compile_watch:
            logs.update(self._compile_watch.snapshot())
        steps = self._steps
        self._reset()
        if self._sink is not None:
            named = ("loss", "learning_rate", "grad_norm", "samples_seen")
            self._sink.log(
                train_record(
                    step=state.global_step,
                    samples_seen=logs["samples_seen"],
                    loss=logs["loss"],
                    lr=logs.get("learning_rate"),
                    grad_norm=logs.get("grad_norm"),
                    **{k: v for k, v in logs.items() if k not in named},
                    logged_steps=steps,  # the steps averaged; tokens sums them
                )
            )

    @staticmethod
    def _samples(args, state) -> int:
        world_size = max(1, args.world_size)
        return state.global_step * args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size


class ExpectedPeakCallback(TrainerCallback):
    """Adds the probe's ``expected_peak_gb`` to every training log, beside the measured peak.

    Insert it ahead of :class:`ThroughputCallback`, so the value reaches ``metrics.jsonl``.

    Args:
        expected_peak_gb (float): the probe's expected peak, GB.
    """

    def __init__(self, expected_peak_gb: float) -> None:
        self.expected_peak_gb = expected_peak_gb

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs:
            logs["expected_peak_gb"] = self.expected_peak_gb


class GuardedWandbCallback(WandbCallback):
    """transformers' ``WandbCallback`` that never stops training.

    A wandb exception logs one warning and turns wandb off; training goes on.

    Args:
        switch (WandbSwitch): shared with :class:`ThroughputCallback`, which calls wandb too.
    """

    def __init__(self, switch: WandbSwitch) -> None:
        super().__init__()
        self.switch = switch

    def _event(self, name: str, args, state, control, **kwargs):
        return self.switch.call(f"WandbCallback.{name}", getattr(super(), name), args, state, control, **kwargs)

    def on_train_begin(self, args, state, control, **kwargs):
        return self._event("on_train_begin", args, state, control, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        return self._event("on_train_end", args, state, control, **kwargs)

    def on_log(self, args, state, control, **kwargs):
        return self._event("on_log", args, state, control, **kwargs)

    def on_save(self, args, state, control, **kwargs):
        return self._event("on_save", args, state, control, **kwargs)

    def on_predict(self, args, state, control, **kwargs):
        return self._event("on_predict", args, state, control, **kwargs)


class StepProgressCallback(ProgressCallback):
    """transformers' progress bar, showing each step's loss instead of printing every log."""

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        pass

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs and "loss" in logs:
            postfix = {"loss": f"{logs['loss']:.4f}"}
            if logs.get("tokens_per_s") is not None:
                postfix["tok_s"] = f"{logs['tokens_per_s']:.0f}"
            self.training_bar.set_postfix(postfix, refresh=False)


def with_step_progress(trainer):
    """``trainer`` with :class:`StepProgressCallback` in place of ``ProgressCallback``."""
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(StepProgressCallback())
    return trainer
