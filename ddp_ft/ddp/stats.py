"""Communication statistics of BucketedDDP per backward or optimizer step."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class CommStats:
    """Counters of gradient communication.

    Args:
        allreduce_calls (int): comm-hook launches.
        allreduce_bytes (int): bytes sent, after any compression.
        exposed_comm_ms (float): ms spent waiting after the last gradient was ready.
        comm_window_ms (float): ms from the first launch to the end of the final wait; 0 on CUDA.
        synced_backwards (int): backward passes that communicated.
        backwards (int): all backward passes.
    """

    allreduce_calls: int = 0
    allreduce_bytes: int = 0
    exposed_comm_ms: float = 0.0
    comm_window_ms: float = 0.0
    synced_backwards: int = 0
    backwards: int = 0

    @property
    def overlap(self) -> float | None:
        """Fraction of the communication window hidden behind compute, or None if not measured."""
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


Measurement = float | tuple  # ms on CPU, or a pair of CUDA events read lazily


def start_timer(device: torch.device) -> object:
    """Start timing the end-of-backward wait on ``device``'s current stream."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def stop_timer(device: torch.device, token: object) -> Measurement:
    """Stop a timer from :func:`start_timer`.

    On CUDA ``Future.wait`` only orders streams, so events time it, read later without syncing the step.
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


# End-of-backward waits kept unread until pop(); older ones are folded into ms.
MAX_PENDING_WAITS = 64


class CommRecorder:
    """Communication of the latest backward and of everything since the last :meth:`pop`.

    Held waits stay bounded when nobody pops; events that old are complete, so folding them never blocks.
    """

    def __init__(self) -> None:
        self._last, self._last_waits = CommStats(), []
        self._pending, self._pending_waits = CommStats(), []

    def start_backward(self, synced: bool) -> None:
        """Start the latest backward's record and count it in the pending one."""
        self._last, self._last_waits = CommStats(backwards=1, synced_backwards=int(synced)), []
        self._pending.backwards += 1
        self._pending.synced_backwards += int(synced)

    def add_allreduce(self, nbytes: int) -> None:
        for stats in (self._last, self._pending):
            stats.allreduce_calls += 1
            stats.allreduce_bytes += nbytes

    def add_wait(self, wait: Measurement) -> None:
        self._last_waits.append(wait)
        self._pending_waits.append(wait)
        if len(self._pending_waits) > MAX_PENDING_WAITS:
            first, second = self._pending_waits[:2]
            self._pending_waits[:2] = [elapsed_ms(first) + elapsed_ms(second)]

    def add_window(self, window_ms: float) -> None:
        self._last.comm_window_ms += window_ms
        self._pending.comm_window_ms += window_ms

    def last(self) -> CommStats:
        """The most recent backward."""
        return _with_waits(self._last, self._last_waits)

    def pop(self) -> CommStats:
        """Everything since the previous pop; resets."""
        stats = _with_waits(self._pending, self._pending_waits)
        self._pending, self._pending_waits = CommStats(), []
        return stats

    @property
    def held_waits(self) -> int:
        """Wait measurements kept until the next :meth:`pop`."""
        return len(self._pending_waits)


def _with_waits(stats: CommStats, waits: list[Measurement]) -> CommStats:
    return CommStats(**{**vars(stats), "exposed_comm_ms": sum(elapsed_ms(w) for w in waits)})
