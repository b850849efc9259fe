"""``bucket_cap_mb="auto"``: try a few bucket layouts in the first synced steps and keep the fastest.

Every candidate layout is a pure function of the trainable parameters (:func:`compute_bucket_assignment` with caps
derived from their total gradient bytes), so every rank computes the same list without talking; the construction
check (:func:`~ddp_ft.ddp.verify.verify_across_ranks`) already proved the parameters are the same everywhere.

The trial is ordinary training: every step's gradients are averaged exactly as with a fixed layout. What is timed is
each synced backward from the moment it reaches the wrapper's output (or, failing that, its first ready gradient) to
the end of the finalizer's wait: the part of a step the layout changes (hook work and exposed communication), without
the forward's noise. On CPU it is wall time; on CUDA a pair of events on the current stream, read once at the decision
(no synchronisation during the trial). After one warm-up synced backward, the candidates take turns, one synced backward
each, for :data:`TRIAL_ROUNDS` rounds (A B C A B C ...). Layouts are switched only at the end of a synced backward's
finalizer, after its wait: no rank is mid-backward, and the optimizer step that follows reads the averaged gradients
from the new buffers. After the last round the ranks meet twice, once: an all-reduce (max) of the timings, since a step
waits for its slowest rank, and a broadcast of rank 0's choice (lowest median, ties to the earlier candidate; torch's
default unless beaten by :data:`MIN_GAIN`), which every rank adopts.
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
        bucket_cap_mb (float): cap of every bucket but the first, in MiB.
        first_bucket_cap_mb (float): cap of the first bucket, in MiB.
        buckets (int): number of buckets these caps give.
    """

    bucket_cap_mb: float
    first_bucket_cap_mb: float
    buckets: int


@dataclass(frozen=True)
class BucketChoice:
    """What ``bucket_cap_mb="auto"`` tried and kept (:attr:`BucketedDDP.bucket_choice`).

    Args:
        candidates (tuple[BucketCandidate, ...]): the distinct layouts, torch's default caps first.
        timings_ms (tuple[tuple[float, ...], ...]): per candidate, each timed synced backward in ms, the slowest
            rank's; empty when there was no trial (one distinct layout, or one rank).
        chosen (int): index of the kept candidate.
    """

    candidates: tuple[BucketCandidate, ...]
    timings_ms: tuple[tuple[float, ...], ...]
    chosen: int

    @property
    def medians_ms(self) -> tuple[float | None, ...]:
        """Median time per candidate (None without a trial)."""
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
        """One line per candidate: caps, buckets, median and range; the chosen one marked if ``mark_choice``."""
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
    """The distinct layouts to try, with their caps: torch's default (25 MiB, first bucket ``first_bucket_cap_mb``)
    first, then caps of total gradient bytes / n for n in :data:`BUCKET_COUNTS`; a cap whose layout an earlier one
    already gives is dropped. Pure: the same list on every rank.

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
    """Index of the candidate with the lowest median time (ties go to the earlier candidate), unless it beats the
    first one, torch's default, by less than :data:`MIN_GAIN`: then the first."""
    medians = [statistics.median(t) for t in timings_ms]
    best = medians.index(min(medians))
    return best if medians[best] < (1 - MIN_GAIN) * medians[0] else 0


class BucketAutotuner:
    """Runs ``bucket_cap_mb="auto"``'s trial on one rank (see the module docstring).

    Once :meth:`attach`-ed, the reducer calls :meth:`after_synced_backward` at the end of each synced backward's
    finalizer while the trial runs, and no longer afterwards. The tuner holds no reference to the reducer (it is
    handed one each call), so a dropped wrapper is freed at once, as without it.

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
        """Record the backward that just finished under the current candidate, then switch ``reducer`` to the next
        candidate or, after the last round, decide and detach."""
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
        """The slowest rank's time of every timed backward (all-reduce max), rank 0's choice (broadcast)."""
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
    """Refuse a comm hook whose state is kept per bucket index, which a change of layout would scramble.

    Raises:
        ValueError: for torch's PowerSGD, naming ``bucket_cap_mb`` and the fix.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    if isinstance(state, PowerSGDState) or "powerSGD" in getattr(hook, "__name__", ""):
        raise ValueError(
            "bucket_cap_mb='auto' cannot be combined with PowerSGD: its error-feedback and low-rank state is kept per "
            "bucket index, which the trial's layout changes would scramble. Give bucket_cap_mb a number (e.g. the one "
            "an 'auto' run without PowerSGD logged), or use another comm hook."
        )
