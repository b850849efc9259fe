"""Replay one measured single-process step on N ranks with BucketedDDP's schedule.

Only the last micro-step communicates. Buckets launch in index order, one all-reduce at a time.
Communication still running when backward ends is exposed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BucketSchedule:
    """When each bucket's all-reduce ran, in ms from the start of backward.

    Args:
        launch_ms (tuple[float, ...]): each bucket's launch.
        done_ms (tuple[float, ...]): each bucket's end.
        exposed_ms (float): time past the end of backward.
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
    """Schedule the all-reduces of one synced backward.

    Args:
        bucket_bytes (Sequence[int]): bytes per bucket, in launch order.
        ready_ms (Sequence[float]): when each bucket was ready.
        backward_ms (float): when backward ended.
        cost_ms (Callable[[int], float]): ms for one all-reduce of N bytes.

    Returns:
        BucketSchedule: launches, ends and the exposed tail.

    Example:
        >>> schedule_buckets([4096], [1.0], 2.0, lambda n: 0.5).exposed_ms
        0.0
    """
    launches, ends = [], []
    link_free = prefix_ready = 0.0
    for nbytes, ready in zip(bucket_bytes, ready_ms, strict=True):
        prefix_ready = max(prefix_ready, ready)  # a bucket waits for its predecessors
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
        step_ms (float): the whole step.
        micro_ms (float): one micro-step's forward and backward.
        accumulation (int): micro-steps per step.
        tokens (float): tokens trained on.
        bucket_bytes (tuple[int, ...]): bytes per bucket.
        ready_ms (tuple[float, ...]): when each bucket was ready.
        backward_ms (float): when the last backward ended.
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
        exposed_ms (float): communication waited for.
        comm_ms (float): time the link was busy.
        tokens (float): tokens over all ranks.
    """

    step_ms: float
    exposed_ms: float
    comm_ms: float
    tokens: float


def expected_max_of_normals(n: int, points: int = 8001) -> float:
    """The expected maximum of ``n`` standard normal draws."""
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

    The spread is robust (MAD), since a host-wide stall hits every rank alike.

    Args:
        micro_ms (Sequence[float]): the measured micro-steps.
        ranks (int): ranks in the ring.
        accumulation (int): micro-steps per rank per step.

    Returns:
        float: the wait in ms.
    """
    if ranks <= 1 or len(micro_ms) < 2:
        return 0.0
    middle = statistics.median(micro_ms)
    spread = 1.4826 * statistics.median(abs(m - middle) for m in micro_ms)
    return spread * math.sqrt(accumulation) * expected_max_of_normals(ranks)


def predict_step(
    measured: MeasuredStep, ranks: int, accumulation: int, cost_ms: Callable[[int], float], wait_ms: float = 0.0
) -> PredictedStep:
    """Predict ``measured`` on ``ranks`` ranks.

    Args:
        measured (MeasuredStep): the one-process step.
        ranks (int): ranks in the ring.
        accumulation (int): micro-steps per rank.
        cost_ms (Callable[[int], float]): ms for one all-reduce of N bytes.
        wait_ms (float): wait for the slowest rank, counted as exposed. Default: 0.

    Returns:
        PredictedStep: the predicted step.
    """
    rest_ms = measured.step_ms - measured.micro_ms * measured.accumulation
    schedule = schedule_buckets(measured.bucket_bytes, measured.ready_ms, measured.backward_ms, cost_ms)
    exposed = schedule.exposed_ms + wait_ms if ranks > 1 else 0.0
    comm = schedule.comm_ms if ranks > 1 else 0.0
    tokens = measured.tokens / measured.accumulation * accumulation * ranks
    return PredictedStep(rest_ms + measured.micro_ms * accumulation + exposed, exposed, comm, tokens)
