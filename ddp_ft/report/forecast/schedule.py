"""BucketedDDP's schedule, simulated: one measured optimizer step of one process, replayed on N ranks over a link.

Pure: numbers in, numbers out. The schedule is the Reducer's. Only the synced (last) micro-step of a step
communicates. Its buckets launch in index order, each once it and every bucket before it hold their gradients, and
one all-reduce runs at a time (a process group runs its collectives in order). What is still running when backward
ends is exposed: the step waits for it. The synced backward also waits for the slowest rank (:func:`rank_wait_ms`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BucketSchedule:
    """When each bucket's all-reduce ran in one synced backward, in ms from its start.

    Args:
        launch_ms (tuple[float, ...]): each bucket's launch.
        done_ms (tuple[float, ...]): each bucket's end.
        exposed_ms (float): how long the last all-reduce ran past the end of backward (0 if none did).
    """

    launch_ms: tuple[float, ...]
    done_ms: tuple[float, ...]
    exposed_ms: float

    @property
    def comm_ms(self) -> float:
        """Time the link was busy."""
        return sum(d - s for s, d in zip(self.launch_ms, self.done_ms, strict=True))


def schedule_buckets(
    bucket_bytes: Sequence[int], ready_ms: Sequence[float], backward_ms: float, cost_ms: Callable[[int], float]
) -> BucketSchedule:
    """BucketedDDP's all-reduces in one synced backward.

    Args:
        bucket_bytes (Sequence[int]): bytes of each bucket, in launch order.
        ready_ms (Sequence[float]): when each bucket's last gradient was ready, from the start of backward.
        backward_ms (float): when backward's last gradient was ready.
        cost_ms (Callable[[int], float]): ms one all-reduce of that many bytes takes.

    Returns:
        BucketSchedule: launches, ends and the exposed tail.
    """
    launches, ends = [], []
    link_free = prefix_ready = 0.0
    for nbytes, ready in zip(bucket_bytes, ready_ms, strict=True):
        prefix_ready = max(prefix_ready, ready)  # index order: a bucket waits for its predecessors
        start = max(prefix_ready, link_free)
        link_free = start + cost_ms(nbytes)
        launches.append(start)
        ends.append(link_free)
    end_of_backward = max([backward_ms, *ready_ms])
    return BucketSchedule(tuple(launches), tuple(ends), max(0.0, link_free - end_of_backward))


@dataclass(frozen=True)
class MeasuredStep:
    """One optimizer step of the one-process run.

    Args:
        step_ms (float): the whole step (``step_time_s``).
        micro_ms (float): forward and backward of one of its micro-steps.
        accumulation (int): its micro-steps.
        tokens (float): tokens it trained on.
        bucket_bytes (tuple[int, ...]): bytes of each bucket BucketedDDP would send.
        ready_ms (tuple[float, ...]): when each bucket was ready in the step's last backward.
        backward_ms (float): when that backward's last gradient was ready.
    """

    step_ms: float
    micro_ms: float
    accumulation: int
    tokens: float
    bucket_bytes: tuple[int, ...]
    ready_ms: tuple[float, ...]
    backward_ms: float


@dataclass(frozen=True)
class PredictedStep:
    """One step on N ranks.

    Args:
        step_ms (float): the step.
        exposed_ms (float): communication the step waited for.
        comm_ms (float): time the link was busy.
        tokens (float): tokens per step over all ranks.
    """

    step_ms: float
    exposed_ms: float
    comm_ms: float
    tokens: float


def expected_max_of_normals(n: int, points: int = 8001) -> float:
    """The expected maximum of ``n`` independent standard normal draws (0 for one), by the trapezoid rule."""
    if n <= 1:
        return 0.0
    lo, hi = -10.0, 10.0
    width = (hi - lo) / (points - 1)
    total = 0.0
    for i in range(points):
        x = lo + i * width
        density = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        below = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        weight = 0.5 if i in (0, points - 1) else 1.0
        total += weight * x * n * density * below ** (n - 1)
    return total * width


def rank_wait_ms(micro_ms: Sequence[float], ranks: int, accumulation: int) -> float:
    """How long a step waits, on average, for its slowest rank.

    Each rank's step is ``accumulation`` micro-steps drawn from the measured ones, independently; their sum is
    taken as normal, so the slowest of ``ranks`` exceeds the mean by the expected maximum of that many normals. The
    micro-steps' spread is robust (1.4826 x their median absolute deviation): a step that stalled the whole host (a
    collection, a checkpoint) stalls every rank alike and is no rank-to-rank spread.

    Args:
        micro_ms (Sequence[float]): the measured micro-steps (one per timed step).
        ranks (int): ranks in the ring.
        accumulation (int): micro-steps per rank per step.

    Returns:
        float: ms; 0 for one rank or fewer than two measured micro-steps.
    """
    if ranks <= 1 or len(micro_ms) < 2:
        return 0.0
    middle = statistics.median(micro_ms)
    spread = 1.4826 * statistics.median(abs(m - middle) for m in micro_ms)
    return spread * math.sqrt(accumulation) * expected_max_of_normals(ranks)


def predict_step(
    measured: MeasuredStep, ranks: int, accumulation: int, cost_ms: Callable[[int], float], wait_ms: float = 0.0
) -> PredictedStep:
    """``measured`` on ``ranks`` ranks of ``accumulation`` micro-steps each.

    Every micro-step costs what it cost in the measured run, and so does the rest of the step (optimizer, clipping,
    logging). The buckets go out once, in the last micro-step's backward; the others run under ``no_sync``.

    Args:
        measured (MeasuredStep): the one-process step.
        ranks (int): ranks in the ring.
        accumulation (int): micro-steps per rank.
        cost_ms (Callable[[int], float]): ms one all-reduce of that many bytes takes over the ring.
        wait_ms (float): the synced backward's wait for the slowest rank (:func:`rank_wait_ms`); a rank's
            all-reduce cannot finish before it, so it counts as exposed. Default: 0.

    Returns:
        PredictedStep: the step, its exposed and total communication, its tokens.
    """
    rest_ms = measured.step_ms - measured.micro_ms * measured.accumulation
    schedule = schedule_buckets(measured.bucket_bytes, measured.ready_ms, measured.backward_ms, cost_ms)
    exposed = schedule.exposed_ms + wait_ms if ranks > 1 else 0.0
    comm = schedule.comm_ms if ranks > 1 else 0.0
    tokens = measured.tokens / measured.accumulation * accumulation * ranks
    return PredictedStep(rest_ms + measured.micro_ms * accumulation + exposed, exposed, comm, tokens)
