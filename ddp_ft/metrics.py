"""Throughput meter and rank-0 metric sinks.

Tokens are counted from the attention mask: non-padding tokens only (padding is not work the model had
to do for the data), summed over ranks for the global rate.
"""

from __future__ import annotations

import json
import logging
import resource
import time
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
