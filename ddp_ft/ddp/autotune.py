"""``bucket_cap_mb="auto"``: time a few bucket layouts in the first synced steps and keep the fastest.

Candidates are pure functions of the verified parameters, so every rank builds the same list.
The trial is ordinary training; only the backward from output to final wait is timed.
After a warm-up, candidates take turns for :data:`TRIAL_ROUNDS` rounds.
The slowest rank's times decide, and every rank adopts rank 0's choice.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .buckets import MB, BucketSpec, ParamSpec, compute_bucket_assignment
from .stats import Measurement, elapsed_ms

if TYPE_CHECKING:
    from .reducer import Reducer

logger = logging.getLogger(__name__)

AUTO = "auto"
"""The ``bucket_cap_mb`` value that asks for the trial."""

BUCKET_COUNTS = (1, 2, 4, 8)
"""Candidates besides torch's default: caps of total gradient bytes / n, for about n equal buckets."""

TRIAL_ROUNDS = 3
"""Synced backward passes timed per candidate (the median is kept)."""

TORCH_DEFAULT_CAP_MB = 25.0

MIN_GAIN = 0.03
"""A layout replaces torch's default only if its median is at least this fraction below the default's: within the
noise the default stays, so runs of one workload keep one layout."""


@dataclass(frozen=True)
class BucketCandidate:
    """One layout ``bucket_cap_mb="auto"`` tries.

    Args:
        bucket_cap_mb (float): cap of every later bucket, in MiB.
        first_bucket_cap_mb (float): cap of the first bucket, in MiB.
        buckets (int): number of buckets these caps give.
    """

    bucket_cap_mb: float
    first_bucket_cap_mb: float
    buckets: int


@dataclass(frozen=True)
class BucketChoice:
    """What ``bucket_cap_mb="auto"`` tried and kept.

    Args:
        candidates (tuple[BucketCandidate, ...]): the distinct layouts, torch's default first.
        timings_ms (tuple[tuple[float, ...], ...]): the slowest rank's times per candidate; empty without a trial.
        chosen (int): index of the kept candidate.
    """

    candidates: tuple[BucketCandidate, ...]
    timings_ms: tuple[tuple[float, ...], ...]
    chosen: int

    @property
    def medians_ms(self) -> tuple[float | None, ...]:
        """Median time per candidate; None without a trial."""
        return tuple(statistics.median(t) if t else None for t in self.timings_ms)

    @property
    def bucket_cap_mb(self) -> float:
        return self.candidates[self.chosen].bucket_cap_mb

    @property
    def first_bucket_cap_mb(self) -> float:
        return self.candidates[self.chosen].first_bucket_cap_mb

    @property
    def buckets(self) -> int:
        return self.candidates[self.chosen].buckets

    def describe(self, mark_choice: bool = True) -> str:
        """One line per candidate: caps, buckets, median and range."""
        lines = []
        for i, (c, times) in enumerate(zip(self.candidates, self.timings_ms, strict=True)):
            timing = f"median {statistics.median(times):.2f} ms [{min(times):.2f}, {max(times):.2f}]" if times else ""
            mark = "  <- chosen" if mark_choice and i == self.chosen else ""
            lines.append(
                f"  cap {c.bucket_cap_mb:.4g} MiB, first {c.first_bucket_cap_mb:.4g} MiB: {c.buckets} bucket(s)"
                f"{', ' if timing else ''}{timing}{mark}"
            )
        return "\n".join(lines)


def bucket_candidates(
    specs: list[ParamSpec], first_bucket_cap_mb: float = 1.0
) -> list[tuple[BucketCandidate, list[BucketSpec]]]:
    """The distinct layouts to try: torch's default first, then caps of total gradient bytes / n.

    Args:
        specs (list[ParamSpec]): trainable parameters in registration order.
        first_bucket_cap_mb (float): first-bucket cap of the torch-default candidate. Default: 1.

    Returns:
        list[tuple[BucketCandidate, list[BucketSpec]]]: at least one candidate and its layout.
    """
    total_mb = sum(s.nbytes for s in specs) / MB
    caps = [(TORCH_DEFAULT_CAP_MB, first_bucket_cap_mb)] + [(total_mb / n, total_mb / n) for n in BUCKET_COUNTS]
    found: dict[tuple, tuple[BucketCandidate, list[BucketSpec]]] = {}
    for cap, first in caps:
        layout = compute_bucket_assignment(specs, cap, first)
        key = tuple(b.param_indices for b in layout)
        if key not in found:
            found[key] = (BucketCandidate(cap, first, len(layout)), layout)
    return list(found.values())


def choose(timings_ms: list[list[float]]) -> int:
    """Index of the lowest median, unless it beats torch's default (index 0) by less than :data:`MIN_GAIN`."""
    medians = [statistics.median(t) for t in timings_ms]
    best = medians.index(min(medians))
    return best if medians[best] < (1 - MIN_GAIN) * medians[0] else 0


class BucketAutotuner:
    """Runs the ``bucket_cap_mb="auto"`` trial on one rank.

    Layouts switch only after a synced backward's wait, so no rank is mid-backward.
    The tuner holds no reference to the reducer, so a dropped wrapper is freed at once.

    Args:
        specs (list[ParamSpec]): trainable parameters in registration order.
        first_bucket_cap_mb (float): see :func:`bucket_candidates`.
        process_group (ProcessGroup | None): group of the wrapper.
    """

    def __init__(self, specs: list[ParamSpec], first_bucket_cap_mb: float, process_group: dist.ProcessGroup | None):
        found = bucket_candidates(specs, first_bucket_cap_mb)
        self.candidates = tuple(c for c, _ in found)
        self.layouts = [layout for _, layout in found]
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        world_size = dist.get_world_size(process_group)
        trial = len(found) > 1 and world_size > 1
        self.schedule = [c for _ in range(TRIAL_ROUNDS) for c in range(len(found))] if trial else []
        self._samples: list[list[Measurement]] = [[] for _ in found]
        self._current = 0  # index of the layout in use
        self._synced = 0  # synced backward passes seen, the warm-up included
        self.choice: BucketChoice | None = None
        if not trial:
            self.choice = BucketChoice(self.candidates, tuple(() for _ in found), 0)
        if self.rank == 0:
            if trial:
                logger.info(
                    "bucket_cap_mb='auto': timing %d layouts over %d rounds of synced backward passes:\n%s",
                    len(found),
                    TRIAL_ROUNDS,
                    BucketChoice(self.candidates, tuple(() for _ in found), 0).describe(mark_choice=False),
                )
            elif world_size == 1:
                logger.info(
                    "bucket_cap_mb='auto' on one rank: nothing is communicated, no trial: %s", self.candidates[0]
                )
            else:
                logger.info("bucket_cap_mb='auto': one distinct layout, no trial: %s", self.candidates[0])

    @property
    def initial_layout(self) -> list[BucketSpec]:
        return self.layouts[0]

    @property
    def active(self) -> bool:
        """Whether synced backward passes still feed the trial."""
        return self.choice is None

    def attach(self, reducer: Reducer) -> None:
        """Have ``reducer`` report its synced backward passes while the trial runs."""
        if self.active:
            reducer.on_synced_backward = self.after_synced_backward

    def after_synced_backward(self, reducer: Reducer, measurement: Measurement) -> None:
        """Record the finished backward, then switch to the next candidate or decide and detach."""
        step = self._synced
        self._synced += 1
        if step >= 1:  # step 0 is the warm-up
            self._samples[self.schedule[step - 1]].append(measurement)
        if step < len(self.schedule):
            self._switch(self.schedule[step], reducer)
        else:
            reducer.on_synced_backward = None
            self._decide(reducer)

    def _switch(self, index: int, reducer: Reducer) -> None:
        if index != self._current:
            reducer.relayout(self.layouts[index])
            self._current = index

    def _decide(self, reducer: Reducer) -> None:
        """Take the slowest rank's timings and broadcast rank 0's choice."""
        device = torch.device(self.layouts[0][0].device)
        timings = torch.tensor([[elapsed_ms(m) for m in s] for s in self._samples], dtype=torch.float64, device=device)
        dist.all_reduce(timings, op=dist.ReduceOp.MAX, group=self.process_group)
        rows = timings.tolist()
        chosen = torch.tensor([choose(rows)], dtype=torch.int64, device=device)
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        dist.broadcast(chosen, src=src, group=self.process_group)
        self.choice = BucketChoice(self.candidates, tuple(tuple(r) for r in rows), int(chosen))
        self._switch(self.choice.chosen, reducer)
        if self.rank == 0:
            logger.info(
                "bucket_cap_mb='auto': kept bucket_cap_mb=%.4g, first_bucket_cap_mb=%.4g (%d bucket(s)); time from "
                "backward reaching the output to the end of the final wait, slowest rank, per candidate:\n%s",
                self.choice.bucket_cap_mb,
                self.choice.first_bucket_cap_mb,
                self.choice.buckets,
                self.choice.describe(),
            )


def check_comm_hook(state: object, hook: object) -> None:
    """Refuse a comm hook with per-bucket-index state, which a layout change would scramble.

    Raises:
        ValueError: for torch's PowerSGD.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    if isinstance(state, PowerSGDState) or "powerSGD" in getattr(hook, "__name__", ""):
        raise ValueError(
            "bucket_cap_mb='auto' cannot be combined with PowerSGD: its error-feedback and low-rank state is kept per "
            "bucket index, which the trial's layout changes would scramble. Give bucket_cap_mb a number (e.g. the one "
            "an 'auto' run without PowerSGD logged), or use another comm hook."
        )
