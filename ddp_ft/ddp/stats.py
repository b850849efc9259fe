"""Communication statistics of BucketedDDP: what one backward (or one optimizer step) cost on the wire."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class CommStats:
    """Counters of gradient communication.

    Args:
        allreduce_calls (int): comm-hook launches (one per bucket per synced backward).
        allreduce_bytes (int): bytes handed to the collective (after compression, if any).
        exposed_comm_ms (float): milliseconds backward spent waiting for communication after the last
            gradient was ready: the part of communication that did not overlap with compute.
        comm_window_ms (float): milliseconds from the first all-reduce launch to the end of the final wait
            (the last completion whenever any communication was exposed), per synced backward, summed.
            Measured on CPU/gloo; 0 on CUDA, where the host's wait ends before the GPU finished.
        synced_backwards (int): backward passes that communicated.
        backwards (int): all backward passes, no_sync ones included.
    """

    allreduce_calls: int = 0
    allreduce_bytes: int = 0
    exposed_comm_ms: float = 0.0
    comm_window_ms: float = 0.0
    synced_backwards: int = 0
    backwards: int = 0

    @property
    def overlap(self) -> float | None:
        """Fraction of the communication window hidden behind backward compute, or None if not measured."""
        if self.comm_window_ms <= 0:
            return None
        return max(0.0, 1.0 - self.exposed_comm_ms / self.comm_window_ms)

    def __add__(self, other: CommStats) -> CommStats:
        return CommStats(**{k: getattr(self, k) + getattr(other, k) for k in asdict(self)})

    def as_dict(self, prefix: str = "comm/") -> dict[str, float]:
        values = {f"{prefix}{k}": v for k, v in asdict(self).items()}
        if self.overlap is not None:
            values[f"{prefix}overlap"] = self.overlap
        return values


Measurement = float | tuple  # milliseconds (CPU) or a pair of recorded CUDA events, read lazily


def start_timer(device: torch.device) -> object:
    """Start timing the end-of-backward wait on ``device``'s current stream."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def stop_timer(device: torch.device, token: object) -> Measurement:
    """Stop a timer from :func:`start_timer`.

    On CPU this is wall time in ms. On CUDA the host does not block on a collective (``Future.wait``
    only orders streams), so the wait is timed with CUDA events on the current stream and read by
    :func:`elapsed_ms` later, when someone asks, to keep a device synchronisation out of the step.
    """
    if device.type == "cuda":
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return (token, end)
    return (time.perf_counter() - token) * 1e3


def elapsed_ms(measurement: Measurement) -> float:
    if isinstance(measurement, tuple):
        start, end = measurement
        end.synchronize()
        return start.elapsed_time(end)
    return measurement
