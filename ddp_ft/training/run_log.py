"""What the plain loop reports while it trains: config, per-step and eval records, and rank 0's progress bar."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

import torch.distributed as dist
from tqdm.auto import tqdm

from ..ddp import BucketedDDP
from ..report.metrics import ThroughputMeter, open_metric_sink
from ..report.records import (
    STOP,
    backward_record,
    bucket_choice_record,
    config_record,
    eval_record,
    host_record,
    predict_record,
    run_identity,
    train_record,
)
from .predict import Prediction, prediction_table
from .run import Run
from .steps import StepResult, rank_balance

logger = logging.getLogger(__name__)


class RunLog:
    """The run's records and progress bar, opened on every rank; only rank 0 writes."""

    def __init__(self, run: Run) -> None:
        self.run = run
        t = run.settings.train
        self.identity = identity = run_identity(
            t.wandb_project, t.wandb_group, t.run_name, run.settings.preset, run.info.world_size
        )
        config = _config_record(run, identity.name)
        self.sink = open_metric_sink(
            run.info, run.output_dir, identity.wandb_run(config) if t.report_to == "wandb" else None
        )
        self.sink.log(config)
        self.meter = ThroughputMeter(run.info.world_size, run.info.device)  # started by the loop each step
        self.progress = tqdm(
            total=run.total_steps,
            initial=run.state.global_step,
            disable=not run.info.is_main_process,
            desc=identity.name,
        )
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.choice_logged = False  # bucket_cap_mb=auto's choice, written once
        self.started = time.perf_counter()  # elapsed_s: wall time, the gaps between steps included
        logger.info(
            "%s: %d steps of %d samples (%d ranks x micro-batch %d x accumulation %d); %s",
            identity.name,
            run.total_steps,
            t.effective_batch,
            run.info.world_size,
            run.resolved.micro_batch,
            run.resolved.accumulation,
            run.parts.truncation,
        )

    def step(self, result: StepResult) -> None:
        """The step's record to the sink and progress bar."""
        run = self.run
        state, wrapped, probe = run.state, run.wrapped, run.resolved.probe
        record = train_record(
            step=state.global_step,
            samples_seen=state.samples_seen,
            loss=result.loss,
            lr=result.lr,
            grad_norm=result.grad_norm,
            epoch=state.epoch,
            **self.meter.stop(result.input_tokens),
            **rank_balance(result.compute_ms, run.info.rank),
            **({"expected_peak_gb": probe.expected_peak / 1e9} if probe else {}),  # beside peak_mem_gb
            elapsed_s=time.perf_counter() - self.started,
        )
        if run.resolved.precision.loss_scaling:
            record.update({"loss_scale": result.loss_scale, "skipped": int(result.skipped)})
        if isinstance(wrapped, BucketedDDP):
            record.update(wrapped.pop_comm_stats().as_dict())
        record.update(run.compile_watch.snapshot() if run.compile_watch else {})
        self.sink.log(record)
        self._backward(state.global_step)
        if isinstance(wrapped, BucketedDDP) and wrapped.bucket_choice is not None and not self.choice_logged:
            self.sink.log(bucket_choice_record(step=state.global_step, choice=wrapped.bucket_choice))
            self.choice_logged = True
        self.first_loss = result.loss if self.first_loss is None else self.first_loss
        self.last_loss = result.loss
        self.progress.update(1)
        self.progress.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")

    def _backward(self, step: int) -> None:
        """The step's ``backward`` record: when each bucket was ready (rank 0 only)."""
        run = self.run
        source = run.wrapped if isinstance(run.wrapped, BucketedDDP) else run.recorder
        timeline = source.last_backward_timeline() if source is not None and run.info.is_main_process else None
        if timeline is not None:
            self.sink.log(backward_record(step=step, **asdict(timeline)))

    def evaluation(self, eval_loss: float) -> None:
        state = self.run.state
        self.sink.log(eval_record(step=state.global_step, samples_seen=state.samples_seen, eval_loss=eval_loss))

    def predictions(self, predictions: list[Prediction], rouge_l: float | None) -> None:
        """``--predict``'s count and ROUGE-L as a record, its rows as a wandb table."""
        state = self.run.state
        samples = len(predictions)
        self.sink.log(
            predict_record(step=state.global_step, samples_seen=state.samples_seen, samples=samples, rouge_l=rouge_l)
        )
        self.sink.table("eval/predictions", *prediction_table(predictions))

    def stop(self, signal: str, checkpoint: str | None) -> None:
        state = self.run.state
        record = {"step": state.global_step, "samples_seen": state.samples_seen, "signal": signal}
        self.sink.log({"type": STOP, **record, "checkpoint": checkpoint})

    def close(self) -> None:
        self.progress.close()
        self.sink.close()


def _config_record(run: Run, name: str) -> dict:
    """The run's config record, with each rank's first samples; a collective, on every rank."""
    settings, info = run.settings, run.info
    first_indices = next(run.loader.plans(run.state.epoch))[info.rank][0]
    all_first = [first_indices] * info.world_size
    if info.is_distributed:
        dist.all_gather_object(all_first, first_indices)
    return config_record(
        run_name=name,
        world_size=info.world_size,
        micro_batch=run.resolved.micro_batch,
        accumulation=run.resolved.accumulation,
        gradient_checkpointing=run.resolved.checkpointing,
        total_steps=run.total_steps,
        resumed_from_step=run.state.global_step,
        bucket_cap_mb=settings.ddp.bucket_cap_mb,
        comm_hook=settings.ddp.comm_hook,
        backend=info.backend,
        buckets=len(run.wrapped.bucket_sizes) if isinstance(run.wrapped, BucketedDDP) else 0,
        train_samples=len(run.parts.train_set),
        eval_samples=len(run.parts.eval_set),
        truncation=str(run.parts.truncation),
        preset=settings.preset,
        first_batch_indices=all_first,
        **({"micro_batch_probe": run.resolved.probe.as_record()} if run.resolved.probe else {}),
        **host_record(info.device.type, info.local_world_size),
    )
