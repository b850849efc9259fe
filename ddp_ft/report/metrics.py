"""Throughput meter and rank-0 metric sinks.

Tokens are non-padding tokens, summed over ranks for the global rate.
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ..distributed import DistInfo
from .records import CONFIG, METRICS_FILE, define_step_metrics, wandb_payload

logger = logging.getLogger(__name__)


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """Peak memory since the last call on GPU, or since process start on CPU."""
    if device.type == "cuda":
        peaks = {
            "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9,
            "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9,
        }
        torch.cuda.reset_peak_memory_stats(device)
        return peaks
    return {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}


class ThroughputMeter:
    """Times optimizer steps and turns global token counts into rates.

    On CUDA it times with events, so the host waits only for the step's end.

    Args:
        world_size (int): ranks in the job.
        device (torch.device): for the timer and peak memory.
    """

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.device = device
        self._start: float | torch.cuda.Event | None = None

    def start(self) -> None:
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def _seconds(self) -> float:
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return self._start.elapsed_time(end) / 1000
        return time.perf_counter() - self._start

    def stop(self, global_tokens: int) -> dict[str, float]:
        """End the step and return its time, rates and peak memory."""
        seconds = self._seconds()
        return {
            "step_time_s": seconds,
            "tokens_per_s": global_tokens / seconds,
            "tokens_per_s_per_device": global_tokens / seconds / self.world_size,
            "tokens": global_tokens,
            **peak_memory_gb(self.device),
        }


class JsonlLogger:
    """Appends one JSON object per call to ``path``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def table(self, key: str, columns: list[str], rows: list[list]) -> None:
        """Tables go to wandb only."""

    def close(self) -> None:
        self._file.close()


class NullLogger:
    """What non-zero ranks log to."""

    def log(self, record: dict) -> None:
        pass

    def table(self, key: str, columns: list[str], rows: list[list]) -> None:
        pass

    def close(self) -> None:
        pass


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def timeline(records: list[dict]) -> list[dict]:
    """The records of the run as it finally went; a resume replaces the steps it redid."""
    kept: list[dict] = []
    for record in records:
        if record.get("type") == CONFIG and record.get("resumed_from_step") is not None:
            resumed = record["resumed_from_step"]
            kept = [r for r in kept if r.get("step") is None or r["step"] <= resumed]
        kept.append(record)
    return kept


def resolve_wandb_mode(environ: Mapping[str, str] | None = None) -> str:
    """A wandb mode that cannot block: ``offline`` unless an API key is set.

    Without a key an online init would prompt for a login.
    """
    environ = os.environ if environ is None else environ
    mode = environ.get("WANDB_MODE", "").strip().lower()
    if mode in ("offline", "dryrun", "disabled"):
        return "offline" if mode == "dryrun" else mode
    if not environ.get("WANDB_API_KEY"):
        return "offline"
    return mode or "online"


SECRET_NAME = re.compile(r"(_TOKEN|_KEY|_SECRET)$|PASSWORD", re.IGNORECASE)


def redact_secrets(text: str, environ: Mapping[str, str] | None = None) -> str:
    """Replace secret environment values in ``text`` with their names.

    Values under 8 characters stay, since replacing them would garble the text.
    """
    environ = os.environ if environ is None else environ
    for name, value in environ.items():
        if len(value) >= 8 and SECRET_NAME.search(name):
            text = text.replace(value, f"<{name}>")
    return text


class WandbSwitch:
    """Rank 0's wandb for one run, on until its first failure.

    The first failure logs one warning and turns wandb off. Training never stops for it.

    Args:
        metrics_path (str | Path): where the metrics still go.
    """

    def __init__(self, metrics_path: str | Path) -> None:
        self.metrics_path = metrics_path
        self.on = True

    def call(self, what: str, fn: Callable, *args, **kwargs):
        """Call ``fn``, or return None once wandb is off or fails."""
        if not self.on:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - wandb must never stop training
            self.on = False
            logger.warning(
                redact_secrets(
                    f"wandb failed in {what} ({type(error).__name__}: {error}); wandb is off for the rest of this run. "
                    f"Training goes on and its metrics still go to {self.metrics_path}. For the next run, fix the cause "
                    "(WANDB_API_KEY, network, WANDB_DIR), set WANDB_MODE=offline (kept on disk for `wandb sync`), or pass "
                    "--report-to none."
                )
            )
            return None


class WandbLogger:
    """Rank 0's wandb run for the plain loop, laid out like the Trainer's.

    Curves plot against ``train/samples_seen`` so world sizes overlay.

    Args:
        project (str): wandb project.
        group (str): the experiment.
        job_type (str): e.g. ``ddp-2``.
        name (str): run name.
        config (dict): recorded run settings.
        output_dir (str | Path): where the offline run is kept.
    """

    def __init__(self, project: str, group: str, job_type: str, name: str, config: dict, output_dir: str | Path):
        self._switch = WandbSwitch(Path(output_dir) / METRICS_FILE)
        self._run = self._switch.call(
            "wandb.init",
            self._start,
            project=project,
            group=group,
            job_type=job_type,
            name=name,
            config=config,
            mode=resolve_wandb_mode(),
            dir=os.environ.get("WANDB_DIR", str(output_dir)),
        )

    @staticmethod
    def _start(**init_kwargs):
        import wandb

        run = wandb.init(**init_kwargs, reinit="finish_previous")
        define_step_metrics(run)
        return run

    def log(self, record: dict) -> None:
        if self._run is None:
            return
        payload = wandb_payload(record)
        if payload is not None:
            self._switch.call("run.log", self._run.log, payload)

    def table(self, key: str, columns: list[str], rows: list[list]) -> None:
        """Log ``rows`` as a ``wandb.Table`` under ``key``."""
        if self._run is not None:
            self._switch.call("run.log", lambda: self._run.log({key: wandb_table(columns, rows)}))

    def close(self) -> None:
        if self._run is not None:  # after a failure the switch skips this
            self._switch.call("run.finish", self._run.finish)
            self._run = None


def wandb_table(columns: list[str], rows: list[list]):
    """A ``wandb.Table`` of ``rows``."""
    import wandb

    return wandb.Table(columns=columns, data=rows)


def log_to_active_wandb(metrics_path: str | Path, record: dict, table: tuple[list[str], list[list]]) -> None:
    """Log a record and a table to this process's wandb run, if any; never raises."""
    import sys

    wandb = sys.modules.get("wandb")
    if wandb is None or wandb.run is None:
        return
    payload = (wandb_payload(record) or {}) | {"eval/predictions": wandb_table(*table)}
    WandbSwitch(metrics_path).call("wandb.log", wandb.run.log, payload)


class MultiLogger:
    """Sends every record to several sinks."""

    def __init__(self, *sinks) -> None:
        self.sinks = sinks

    def log(self, record: dict) -> None:
        for sink in self.sinks:
            sink.log(record)

    def table(self, key: str, columns: list[str], rows: list[list]) -> None:
        for sink in self.sinks:
            sink.table(key, columns, rows)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_metric_sink(info: DistInfo, output_dir: str | Path, wandb_run: dict | None = None):
    """This rank's metric sink: ``metrics.jsonl`` and wandb on rank 0, nothing elsewhere.

    Args:
        info (DistInfo): this process's rank.
        output_dir (str | Path): where ``metrics.jsonl`` goes.
        wandb_run (dict | None): :class:`WandbLogger` arguments. Default: None.

    Returns:
        JsonlLogger | MultiLogger | NullLogger: the sink.

    Example:
        >>> sink = open_metric_sink(info, "out")
    """
    if not info.is_main_process:
        return NullLogger()
    sink = JsonlLogger(Path(output_dir) / METRICS_FILE)
    if wandb_run is None:
        return sink
    return MultiLogger(sink, WandbLogger(**wandb_run, output_dir=output_dir))
