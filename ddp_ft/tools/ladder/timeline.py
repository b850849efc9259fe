"""Where one optimizer step's time goes: compute, communication hidden behind it, communication waited for, idle.

The numbers follow Holistic Trace Analysis (HTA), from two sets of intervals the rungs record per step:

* **communication** ``M``: each all-reduce from launch to completion;
* **blocked** ``B``: the training thread waiting for communication.

Over the step's window ``T`` on CPU/gloo:

* compute = ``|T| - |B|``;
* non-compute = ``|B ∩ M|``, the **exposed** communication;
* idle = ``|B \\ M|``, blocked with nothing in flight;
* overlap = ``|(T \\ B) ∩ M| / |M|``, the share of communication hidden.

On CUDA/NCCL :func:`profiled_intervals` reads both sets from the device trace instead.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

Interval = tuple[float, float]


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points; empty ones dropped."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(intervals: list[Interval]) -> float:
    return sum(e - s for s, e in union(intervals))


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Points in both (each side merged first)."""
    out, a, b = [], union(a), union(b)
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Points in ``a`` and not in ``b``."""
    out = []
    for start, end in union(a):
        cursor = start
        for s, e in union(b):
            if e <= cursor or s >= end:
                continue
            if s > cursor:
                out.append((cursor, s))
            cursor = max(cursor, e)
        if cursor < end:
            out.append((cursor, end))
    return out


@dataclass
class StepBreakdown:
    """One optimizer step's time in ms, split as HTA splits a trace.

    ``overlap`` is None without communication.
    """

    step_ms: float
    compute_ms: float
    exposed_ms: float
    idle_ms: float
    comm_ms: float
    overlap: float | None
    calls: int
    nbytes: int

    @classmethod
    def from_host(cls, window: Interval, comm: list[Interval], blocked: list[Interval], calls: int, nbytes: int):
        """Split a CPU/gloo step from the training thread's view."""
        comm = intersect(comm, [window])
        blocked = intersect(blocked, [window])
        computing = subtract([window], blocked)
        comm_ms = length(comm) * 1e3
        return cls(
            step_ms=(window[1] - window[0]) * 1e3,
            compute_ms=length(computing) * 1e3,
            exposed_ms=length(intersect(blocked, comm)) * 1e3,
            idle_ms=length(subtract(blocked, comm)) * 1e3,
            comm_ms=comm_ms,
            overlap=length(intersect(computing, comm)) * 1e3 / comm_ms if comm_ms > 0 else None,
            calls=calls,
            nbytes=nbytes,
        )

    @classmethod
    def from_device(cls, window: Interval, compute: list[Interval], comm: list[Interval], calls: int, nbytes: int):
        """Split a CUDA/NCCL step from its kernel intervals."""
        compute, comm = intersect(compute, [window]), intersect(comm, [window])
        comm_ms = length(comm) * 1e3
        busy = union(compute + comm)
        return cls(
            step_ms=(window[1] - window[0]) * 1e3,
            compute_ms=length(compute) * 1e3,
            exposed_ms=length(subtract(comm, compute)) * 1e3,
            idle_ms=(window[1] - window[0] - length(busy)) * 1e3,
            comm_ms=comm_ms,
            overlap=length(intersect(compute, comm)) * 1e3 / comm_ms if comm_ms > 0 else None,
            calls=calls,
            nbytes=nbytes,
        )

    def percent(self, part: str) -> float:
        """One part's share of the step, in percent."""
        value = {"compute": self.compute_ms, "non_compute": self.exposed_ms, "idle": self.idle_ms}[part]
        return 100.0 * value / self.step_ms if self.step_ms > 0 else 0.0


@dataclass
class Timeline:
    """The intervals a rung records during one step, on the host clock.

    Call :meth:`launched` and :meth:`completed` around each collective and :meth:`blocked` for waits.
    """

    comm: list[Interval] = field(default_factory=list)
    waits: list[Interval] = field(default_factory=list)
    calls: int = 0
    nbytes: int = 0
    _start: float = 0.0

    def step(self) -> None:
        self.comm, self.waits, self.calls, self.nbytes = [], [], 0, 0
        self._start = time.perf_counter()

    def launched(self, nbytes: int) -> float:
        self.calls += 1
        self.nbytes += nbytes
        return time.perf_counter()

    def completed(self, started: float) -> None:
        self.comm.append((started, time.perf_counter()))  # atomic, so safe from gloo's thread

    def blocked(self, start: float, end: float | None = None) -> None:
        self.waits.append((start, time.perf_counter() if end is None else end))

    def close(self) -> StepBreakdown:
        window = (self._start, time.perf_counter())
        return StepBreakdown.from_host(window, list(self.comm), list(self.waits), self.calls, self.nbytes)


def profiled_intervals(events) -> tuple[list[Interval], list[Interval]]:
    """Compute and NCCL kernel intervals in seconds from a CUDA profile's events.

    Memory copies and sets are left out, as HTA does.
    """
    compute: list[Interval] = []
    comm: list[Interval] = []
    for event in events:
        if getattr(event.device_type, "name", "") != "CUDA" or event.time_range.elapsed_us() <= 0:
            continue
        name = event.name.lower()
        if name.startswith(("memcpy", "memset")):
            continue
        interval = (event.time_range.start / 1e6, event.time_range.end / 1e6)
        (comm if "nccl" in name else compute).append(interval)
    return compute, comm


def summarize(steps: list[StepBreakdown]) -> dict[str, float | None]:
    """The table's columns over many steps: shares from the totals, per-step values as medians."""
    total = sum(s.step_ms for s in steps)
    comm = sum(s.comm_ms for s in steps)
    hidden = sum(s.comm_ms * s.overlap for s in steps if s.overlap is not None)
    return {
        "step_ms": statistics.median(s.step_ms for s in steps),
        "compute_pct": 100.0 * sum(s.compute_ms for s in steps) / total,
        "non_compute_pct": 100.0 * sum(s.exposed_ms for s in steps) / total,
        "idle_pct": 100.0 * sum(s.idle_ms for s in steps) / total,
        "overlap_pct": 100.0 * hidden / comm if comm > 0 else None,
        "allreduce_calls": statistics.median(s.calls for s in steps),
        "allreduce_ms": statistics.median(s.comm_ms for s in steps),
        "exposed_ms": statistics.median(s.exposed_ms for s in steps),
        "allreduce_bytes": statistics.median(s.nbytes for s in steps),
    }
