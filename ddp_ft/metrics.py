"""Throughput meter and rank-0 metric sinks.

Tokens are counted from the attention mask: non-padding tokens only (padding is not work the model had
to do for the data), summed over ranks for the global rate.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from collections.abc import Mapping
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def peak_memory_gb(device: torch.device) -> tuple[str, float]:
    """Peak memory of this process: CUDA allocator peak on GPU, peak resident set size on CPU.

    Returns:
        tuple[str, float]: the metric's name (``peak_mem_gb`` or ``peak_rss_gb``) and its value in GB.
    """
    if device.type == "cuda":
        return "peak_mem_gb", torch.cuda.max_memory_allocated(device) / 1e9
    return "peak_rss_gb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


class ThroughputMeter:
    """Times optimizer steps and turns global token counts into rates.

    Args:
        world_size (int): ranks in the job, for the per-device rate.
        device (torch.device): for peak memory.
    """

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.device = device
        self._start: float | None = None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._start = time.perf_counter()

    def stop(self, global_tokens: int) -> dict[str, float]:
        """End the step; return step time, global and per-device tokens/s, and peak memory."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self._start
        memory_name, memory = peak_memory_gb(self.device)
        return {
            "step_time_s": seconds,
            "tokens_per_s": global_tokens / seconds,
            "tokens_per_s_per_device": global_tokens / seconds / self.world_size,
            "tokens": global_tokens,
            memory_name: memory,
        }


class JsonlLogger:
    """Appends one JSON object per call to ``path`` (rank 0 only; other ranks get :class:`NullLogger`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class NullLogger:
    """What non-zero ranks log to."""

    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def timeline(records: list[dict]) -> list[dict]:
    """The records of the run as it finally went: a resumed segment (a ``config`` record with ``resumed_from_step``
    s) replaces what earlier segments logged after step s, the steps a crash or a stop lost and the resume redid.
    So every step appears once, from the attempt whose checkpoint the run continued from."""
    kept: list[dict] = []
    for record in records:
        if record.get("type") == "config" and record.get("resumed_from_step") is not None:
            resumed = record["resumed_from_step"]
            kept = [r for r in kept if r.get("step") is None or r["step"] <= resumed]
        kept.append(record)
    return kept


def resolve_wandb_mode(environ: Mapping[str, str] | None = None) -> str:
    """wandb mode that cannot block: ``offline`` unless an API key is set, an explicit WANDB_MODE respected.

    ``WANDB_MODE=offline``/``dryrun``/``disabled`` always wins; without ``WANDB_API_KEY`` the run is
    offline (an online init without credentials would prompt for a login); with a key, WANDB_MODE or online.
    """
    environ = os.environ if environ is None else environ
    mode = environ.get("WANDB_MODE", "").strip().lower()
    if mode in ("offline", "dryrun", "disabled"):
        return "offline" if mode == "dryrun" else mode
    if not environ.get("WANDB_API_KEY"):
        return "offline"
    return mode or "online"


class WandbLogger:
    """Rank 0's wandb run for the plain loop, laid out like the Trainer's so the runs compare in one place.

    Train records go under ``train/`` and eval under ``eval/``, both plotted against ``train/samples_seen``
    (``define_metric``) so curves of different world sizes overlay. ``wandb.log`` hands records to wandb's
    background service: training does not wait on the network. A wandb failure is logged and logging stops;
    it never stops training.

    Args:
        project (str): wandb project.
        group (str): the experiment (its single and DDP runs share it).
        job_type (str): e.g. ``single-1`` or ``ddp-2``.
        name (str): run name.
        config (dict): recorded run settings (world size, batch arithmetic, bucket cap, comm hook, ...).
        output_dir (str | Path): where the offline run is kept (``<output_dir>/wandb``) unless WANDB_DIR is set.
    """

    def __init__(self, project: str, group: str, job_type: str, name: str, config: dict, output_dir: str | Path):
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=project, group=group, job_type=job_type, name=name, config=config,
                               mode=resolve_wandb_mode(), dir=os.environ.get("WANDB_DIR", str(output_dir)),
                               reinit="finish_previous")  # fmt: skip
        self._run.define_metric("train/samples_seen")
        self._run.define_metric("train/*", step_metric="train/samples_seen")
        self._run.define_metric("eval/*", step_metric="train/samples_seen")

    def log(self, record: dict) -> None:
        if self._run is None:
            return
        kind = record.get("type")
        if kind == "train":
            payload = {f"train/{k}": v for k, v in record.items() if k != "type" and isinstance(v, int | float)}
        elif kind == "eval":
            payload = {"eval/loss": record["eval_loss"], "train/samples_seen": record["samples_seen"]}
        else:
            return
        try:
            self._run.log(payload)
        except Exception as error:  # noqa: BLE001 - wandb must never stop training
            logger.warning("wandb logging failed, continuing without it: %s", error)
            self._run = None

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class MultiLogger:
    """Sends every record to several sinks."""

    def __init__(self, *sinks) -> None:
        self.sinks = sinks

    def log(self, record: dict) -> None:
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
