"""Throughput meter and rank-0 metric sinks.

Tokens are counted from the attention mask: non-padding tokens only (padding is not work the model had
to do for the data), summed over ranks for the global rate.
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
from .records import CONFIG, define_step_metrics, wandb_payload

logger = logging.getLogger(__name__)


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """Peak memory of this process since the previous call: on GPU the CUDA allocator's peaks, allocated
    (``peak_mem_gb``) and reserved (``peak_reserved_gb``), which this call resets so each logging interval reports
    its own; on CPU the peak resident set size since the process started (``peak_rss_gb``; the kernel keeps no
    resettable counter the rusage API reads)."""
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

    On CUDA a step is timed by a pair of CUDA events on the current stream, not by ``torch.cuda.synchronize``: the
    host waits only for the step's own end event, and in the plain loop not even that, since the step's one
    transfer of logged scalars has already waited for it. On CPU, by the wall clock.

    Args:
        world_size (int): ranks in the job, for the per-device rate.
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
        """End the step; return step time, global and per-device tokens/s, and peak memory since the last stop."""
        seconds = self._seconds()
        return {
            "step_time_s": seconds,
            "tokens_per_s": global_tokens / seconds,
            "tokens_per_s_per_device": global_tokens / seconds / self.world_size,
            "tokens": global_tokens,
            **peak_memory_gb(self.device),
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

    def table(self, key: str, columns: list[str], rows: list[list]) -> None:
        """Tables go to wandb only: ``metrics.jsonl`` holds numbers, and the rows have a file of their own."""

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
    """The records of the run as it finally went: a resumed segment (a ``config`` record with ``resumed_from_step``
    s) replaces what earlier segments logged after step s, the steps a crash or a stop lost and the resume redid.
    So every step appears once, from the attempt whose checkpoint the run continued from."""
    kept: list[dict] = []
    for record in records:
        if record.get("type") == CONFIG and record.get("resumed_from_step") is not None:
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


SECRET_NAME = re.compile(r"(_TOKEN|_KEY|_SECRET)$|PASSWORD", re.IGNORECASE)


def redact_secrets(text: str, environ: Mapping[str, str] | None = None) -> str:
    """``text`` with the value of every secret-named environment variable (``*_TOKEN``, ``*_KEY``, ``*_SECRET``,
    ``*PASSWORD*``: WANDB_API_KEY, HF_TOKEN, ...) replaced by ``<NAME>``, for messages that quote a library's error.

    Values under 8 characters are left alone: no credential is that short, and replacing e.g. ``1`` would garble
    the message.
    """
    environ = os.environ if environ is None else environ
    for name, value in environ.items():
        if len(value) >= 8 and SECRET_NAME.search(name):
            text = text.replace(value, f"<{name}>")
    return text


class WandbSwitch:
    """Rank 0's wandb for one run, on until its first failure; shared by everything of the run that calls wandb.

    wandb fails at start (``wandb.init``: a bad key, no network, its service not starting) or mid-run (a log call
    raising once the network or the service is gone). Calls made through :meth:`call` never raise: the first
    failure logs one warning naming it (secrets redacted) and turns wandb off for the rest of the run, so no
    later call is even tried. Training and ``metrics.jsonl`` carry on.

    Args:
        metrics_path (str | Path): where the metrics still go, named in the warning.
    """

    def __init__(self, metrics_path: str | Path) -> None:
        self.metrics_path = metrics_path
        self.on = True

    def call(self, what: str, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)``, or None once wandb is off or if it raises; ``what`` names it in the warning."""
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
    """Rank 0's wandb run for the plain loop, laid out like the Trainer's so the runs compare in one place.

    Train records go under ``train/`` and eval under ``eval/``, both plotted against ``train/samples_seen``
    (``define_metric``) so curves of different world sizes overlay. ``wandb.log`` hands records to wandb's
    background service: training does not wait on the network. Every wandb call goes through a
    :class:`WandbSwitch`: a failure, at init or later, is logged once and turns wandb off; it never stops training.

    Args:
        project (str): wandb project.
        group (str): the experiment (its single and DDP runs share it).
        job_type (str): e.g. ``single-1`` or ``ddp-2``.
        name (str): run name.
        config (dict): recorded run settings (world size, batch arithmetic, bucket cap, comm hook, ...).
        output_dir (str | Path): where the offline run is kept (``<output_dir>/wandb``) unless WANDB_DIR is set.
    """

    def __init__(self, project: str, group: str, job_type: str, name: str, config: dict, output_dir: str | Path):
        self._switch = WandbSwitch(Path(output_dir) / "metrics.jsonl")
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
        if self._run is not None:  # after a failure the switch is off: the run is left, its service may be gone
            self._switch.call("run.finish", self._run.finish)
            self._run = None


def wandb_table(columns: list[str], rows: list[list]):
    """A ``wandb.Table`` of ``rows``."""
    import wandb

    return wandb.Table(columns=columns, data=rows)


def log_to_active_wandb(metrics_path: str | Path, record: dict, table: tuple[list[str], list[list]]) -> None:
    """Log a record and a table (``eval/predictions``) to the wandb run this process has (the Trainer's), if any.

    A process that never started wandb has nothing to log to, and wandb is not imported. A failure is warned once
    through a :class:`WandbSwitch`; it never raises.
    """
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
    """This rank's metric sink: on rank 0 ``<output_dir>/metrics.jsonl``, and wandb too when ``wandb_run`` (the
    :class:`WandbLogger` arguments but ``output_dir``) is given; a :class:`NullLogger` on every other rank, so no
    other rank ever imports or starts wandb.

    Returns:
        JsonlLogger | MultiLogger | NullLogger: ``log(record)`` and ``close()``.
    """
    if not info.is_main_process:
        return NullLogger()
    sink = JsonlLogger(Path(output_dir) / "metrics.jsonl")
    if wandb_run is None:
        return sink
    return MultiLogger(sink, WandbLogger(**wandb_run, output_dir=output_dir))
