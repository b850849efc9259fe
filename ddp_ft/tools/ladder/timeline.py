"""Where one optimizer step's time goes: compute, communication hidden behind it, communication waited for, idle.

The reference write-ups measure each rung with the torch profiler and Holistic Trace Analysis on GPUs. The same
four numbers are defined here from two sets of intervals per step, recorded by the rungs themselves:

* **communication** ``M``: each all-reduce from its launch to its completion (a callback on the future, which gloo
  runs on its communication thread the moment the collective is done, the wait for the peer included);
* **blocked** ``B``: the training thread waiting for communication: a blocking all-reduce, a ``wait()``, or, for
  torch DDP and BucketedDDP, whose wait is inside ``backward()``, the time from the step's last gradient to the end
  of ``backward()`` (what :class:`~ddp_ft.tools.bench.ExposedWaitProbe` measures).

Over the step's wall window ``T``, on CPU/gloo, where one thread computes and another communicates:

* compute = ``|T| - |B|`` (the training thread is working: forward, backward, launches, the optimizer);
* non-compute = ``|B ∩ M|``: communication the step waited for, the **exposed** communication;
* idle = ``|B \\ M|``: blocked with nothing in flight (the gap between a completion and the wait noticing it);
* overlap = ``|(T \\ B) ∩ M| / |M|``: the share of communication time during which the step kept computing.

These are HTA's definitions (compute and non-compute kernel time, idle time, and computation-communication
overlap), with the training thread in the role of the compute stream and gloo's thread in the role of the
communication stream. On CUDA/NCCL the host's view says nothing about the device, so :func:`profiled_intervals`
takes both sets from the profiler's device trace instead: compute = union of non-NCCL kernels, ``M`` = union of
NCCL kernels, and the formulas become HTA's (non-compute = ``|M \\ C|``, idle = ``|T| - |C ∪ M|``).
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
    """One optimizer step's time, split as HTA splits a trace (milliseconds).

    ``comm_ms`` is the union of communication intervals (what the reference's "all-reduce ms" column sums);
    ``exposed_ms`` the part the step waited for (non-compute); ``overlap`` the share of ``comm_ms`` hidden behind
    compute, or None without communication.
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
        """CPU/gloo: the training thread's view (see the module docstring)."""
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
        """CUDA/NCCL: kernel intervals of the device trace, HTA's formulas."""
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
        """``compute``, ``non_compute`` (exposed) or ``idle`` as a share of the step, in percent."""
        value = {"compute": self.compute_ms, "non_compute": self.exposed_ms, "idle": self.idle_ms}[part]
        return 100.0 * value / self.step_ms if self.step_ms > 0 else 0.0


@dataclass
class Timeline:
    """The intervals a rung records during one step (host clock: ``time.perf_counter``).

    Rungs call :meth:`launched` when a collective starts and :meth:`completed` from its future's callback;
    :meth:`blocked` brackets the training thread's waits. :meth:`step` opens a step and :meth:`close` returns its
    :class:`StepBreakdown` and clears the record.
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
        self.comm.append((started, time.perf_counter()))  # list.append is atomic: safe from gloo's thread

    def blocked(self, start: float, end: float | None = None) -> None:
        self.waits.append((start, time.perf_counter() if end is None else end))

    def close(self) -> StepBreakdown:
        window = (self._start, time.perf_counter())
        return StepBreakdown.from_host(window, list(self.comm), list(self.waits), self.calls, self.nbytes)


def profiled_intervals(events) -> tuple[list[Interval], list[Interval]]:
    """Compute and communication kernel intervals (seconds) from a CUDA profile's ``prof.events()``.

    A kernel whose name contains ``nccl`` is communication (NCCL's kernels are ``ncclDevKernel_*`` /
    ``ncclKernel_*``); every other device kernel is compute. Memory copies and sets are left out, as HTA counts them
    apart from both.
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
    """The columns over many steps: shares of time (compute, non-compute, idle, overlap) from the totals, as a trace
    of all the steps would give them (they add up to 100); per-step quantities (calls, ms, bytes) as medians."""
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
