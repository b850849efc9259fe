"""A run's identity and the ``metrics.jsonl`` records it writes, shared by both entry points and the report.

A record is a flat dict whose ``type`` is one of:

* ``config``: once per launch and again after a resume.
* ``train``: one per logged optimizer step; a Trainer's averages its ``logged_steps``.
* ``eval``: step, samples seen and ``eval_loss``.
* ``stop``: the plain loop, when a signal stopped the run.
* ``bucket_choice``: once, when ``bucket_cap_mb="auto"`` has decided.
* ``backward``: per step, each bucket's bytes and ready time, for ``ddp-ft forecast``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

METRICS_FILE = "metrics.jsonl"  # a run's records, a JSON object a line, in its --output-dir

CONFIG = "config"
TRAIN = "train"
EVAL = "eval"
STOP = "stop"
PREDICT = "predict"
BUCKET_CHOICE = "bucket_choice"
BACKWARD = "backward"

# What ``tokens`` and ``tokens_per_s`` count on both paths.
TOKENS_COUNTED = "non-padding input tokens (attention mask)"

# Curves plot against samples seen, so world sizes overlay.
STEP_METRIC = "train/samples_seen"


@dataclass(frozen=True)
class RunIdentity:
    """How a run appears in wandb and in ``metrics.jsonl``."""

    project: str
    group: str  # the experiment
    job_type: str  # ``single-1``, ``ddp-2``, ...
    name: str  # ``<group>-<job_type>`` by default

    def wandb_run(self, config: dict) -> dict:
        """``wandb.init``'s arguments for this run."""
        fields = {"project": self.project, "group": self.group, "job_type": self.job_type, "name": self.name}
        return fields | {"config": {k: v for k, v in config.items() if k != "type"}}


def run_identity(project: str, wandb_group: str, run_name: str, preset: str | None, world_size: int) -> RunIdentity:
    """The identity of a run of ``world_size`` processes.

    Args:
        project (str): ``--wandb-project``.
        wandb_group (str): ``--wandb-group``, else the preset, else ``custom``.
        run_name (str): ``--run-name``, else ``<group>-<job_type>``.
        preset (str | None): ``--preset``.
        world_size (int): processes in the run.

    Returns:
        RunIdentity: the run's names.

    Example:
        >>> run_identity("ddp-ft", "", "", None, 2).name
        'custom-ddp-2'
    """
    job_type = f"{'ddp' if world_size > 1 else 'single'}-{world_size}"
    group = wandb_group or preset or "custom"
    return RunIdentity(project=project, group=group, job_type=job_type, name=run_name or f"{group}-{job_type}")


def config_record(
    *,
    run_name: str,
    world_size: int,
    micro_batch: int,
    accumulation: int,
    total_steps: int,
    resumed_from_step: int,
    **extra: object,
) -> dict:
    """The ``config`` record: the report's fields, then the entry point's extras."""
    return {
        "type": CONFIG,
        "run_name": run_name,
        "world_size": world_size,
        "micro_batch": micro_batch,
        "accumulation": accumulation,
        "effective_batch": micro_batch * accumulation * world_size,
        "total_steps": total_steps,
        "tokens_counted": TOKENS_COUNTED,
        "resumed_from_step": resumed_from_step,
        **extra,
    }


def host_record(device_type: str, local_world_size: int) -> dict:
    """What sets a run's speed besides its settings, for the ``config`` record.

    Args:
        device_type (str): ``cpu`` or ``cuda``.
        local_world_size (int): this run's processes on this host.

    Returns:
        dict: threads, device type, local world size, usable CPUs and load.
    """
    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "threads_per_process": torch.get_num_threads(),
        "device_type": device_type,
        "local_world_size": local_world_size,
        "usable_cpus": usable_cpus(),
        "host_load_1m": None if load is None else round(load, 2),
    }


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup quota."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return count if quota == "max" else max(1, min(count, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        return count


def train_record(
    *, step: int, samples_seen: int, loss: float, lr: float | None, grad_norm: float | None, **metrics: object
) -> dict:
    """A ``train`` record for one logged optimizer step."""
    return {
        "type": TRAIN,
        "step": step,
        "samples_seen": samples_seen,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        **metrics,
    }


def eval_record(*, step: int, samples_seen: int, eval_loss: float) -> dict:
    return {"type": EVAL, "step": step, "samples_seen": samples_seen, "eval_loss": eval_loss}


def predict_record(*, step: int, samples_seen: int, samples: int, rouge_l: float | None) -> dict:
    """A ``predict`` record: samples generated and their ROUGE-L."""
    return {"type": PREDICT, "step": step, "samples_seen": samples_seen, "samples": samples, "rouge_l": rouge_l}


def bucket_choice_record(*, step: int, choice) -> dict:
    """A ``bucket_choice`` record from a :class:`~ddp_ft.ddp.BucketChoice`."""
    return {
        "type": BUCKET_CHOICE,
        "step": step,
        "bucket_cap_mb": choice.bucket_cap_mb,
        "first_bucket_cap_mb": choice.first_bucket_cap_mb,
        "buckets": choice.buckets,
        "candidates": [[c.bucket_cap_mb, c.first_bucket_cap_mb, c.buckets] for c in choice.candidates],
        "median_ms": list(choice.medians_ms),
    }


def backward_record(
    *,
    step: int,
    bucket_bytes: list[int] | tuple[int, ...],
    ready_ms: list[float] | tuple[float, ...],
    backward_ms: float,
    forward_ms: float | None = None,
) -> dict:
    """A ``backward`` record: the buckets of the step's last backward.

    Args:
        step (int): the optimizer step.
        bucket_bytes (list[int]): bytes per bucket, in launch order.
        ready_ms (list[float]): when each bucket was ready.
        backward_ms (float): when backward ended.
        forward_ms (float | None): the forward's duration. Default: None
    """
    return {
        "type": BACKWARD,
        "step": step,
        "bucket_bytes": list(bucket_bytes),
        "bucket_ready_ms": list(ready_ms),
        "backward_ms": backward_ms,
        "forward_ms": forward_ms,
    }


def micro_step_ms(backward: dict) -> float | None:
    """A ``backward`` record's micro-step: its forward and backward, or None where the forward was not timed."""
    forward = backward.get("forward_ms")
    return None if forward is None else forward + backward["backward_ms"]


def of_type(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r.get("type") == kind]


def timed_train_records(records: list[dict], skip_first: int) -> list[dict]:
    """The train records after ``skip_first`` warm-up steps of each segment, else all."""
    timed, since_config = [], 0
    for record in records:
        if record.get("type") == CONFIG:
            since_config = 0
        elif record.get("type") == TRAIN:
            if since_config >= skip_first:
                timed.append(record)
            since_config += 1
    return timed or of_type(records, TRAIN)


def define_step_metrics(run) -> None:
    """Plot ``train/*`` and ``eval/*`` against samples seen."""
    run.define_metric(STEP_METRIC)
    run.define_metric("train/*", step_metric=STEP_METRIC)
    run.define_metric("eval/*", step_metric=STEP_METRIC)


def wandb_payload(record: dict) -> dict | None:
    """A record under the Trainer's wandb keys, or None if wandb skips it."""
    if record.get("type") == TRAIN:
        return {f"train/{k}": v for k, v in record.items() if k != "type" and isinstance(v, int | float)}
    if record.get("type") == EVAL:
        return {"eval/loss": record["eval_loss"], STEP_METRIC: record["samples_seen"]}
    if record.get("type") == PREDICT and record["rouge_l"] is not None:
        return {"eval/rouge_l": record["rouge_l"], STEP_METRIC: record["samples_seen"]}
    return None
