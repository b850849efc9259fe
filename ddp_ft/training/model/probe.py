"""``--micro-batch auto`` by measurement: the largest micro-batch that fits, the same on every rank.

The arithmetic in ``memory`` knows one model family in one mode; the probe measures any causal LM as it trains.

1. One warm-up step, then one measured step at each of :data:`PROBE_POINTS`, at ``max_seq_len``.
2. A line through the peaks, with the steepest slope seen, raised above every point.
3. A candidate's expected peak: the line, plus AdamW's two moments the probe cannot see.
4. The choice: the largest divisor of the per-rank batch that fits ``device_bytes x (1 - margin)``.
   Ranks sharing one GPU over gloo each fill an equal part of it.
   One MIN all-reduce makes the smallest choice everyone's; a failed rank sends -1.

The training sees nothing of the probe: gradients and random generators are restored.
It runs on the unwrapped model, before BucketedDDP, so nothing is communicated.
Tests inject ``device_bytes`` and ``measure`` to run on the CPU.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist

from ...ddp.placement import every_rank_identity
from ...distributed import DistInfo
from ..batch import gradient_accumulation_steps
from .precision import Precision
from .probe_step import ProbeStep

logger = logging.getLogger(__name__)

# The margin covers what max_memory_allocated misses: the allocator's reserve, the CUDA context,
# and workspaces at sizes not probed (docs/own_data.md).
PROBE_MARGIN = 0.15
PROBE_POINTS = (1, 2, 4)  # three points show whether the line holds
LINEARITY_TOLERANCE = 0.05  # relative distance from the least-squares line that warns

# Runs a step at a micro-batch and returns its peak bytes.
Measure = Callable[[Callable[[], object], int], int]


def cuda_peak_bytes(device: torch.device) -> Measure:
    """The peak of ``torch.cuda.max_memory_allocated`` over a step on ``device``, counters reset before it."""

    def measure(step: Callable[[], object], micro_batch: int) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)

    return measure


def host_peak_bytes(model: torch.nn.Module) -> Measure:
    """On the CPU: ``model``'s resident bytes plus the step's peak above them.

    The matmuls answer with zeros, so a 4B-wide model's step takes seconds.
    """
    from .memory import parameter_bytes, step_peak_bytes

    def measure(step: Callable[[], object], micro_batch: int) -> int:
        return parameter_bytes(model) + step_peak_bytes(step)

    return measure


def device_total_bytes(device: torch.device) -> int:
    """The total memory of ``device``.

    Raises:
        ValueError: off CUDA, where the memory is the host's.
    """
    if device.type != "cuda":
        raise ValueError(
            f"--micro-batch auto fills a GPU's memory; this run is on {device.type}, whose memory is the host's: "
            "give --micro-batch a number."
        )
    return torch.cuda.mem_get_info(device)[1]


def device_share_bytes(info: DistInfo) -> tuple[int, int]:
    """The memory this rank may fill, and how many ranks train on its GPU.

    gloo lets ranks share one GPU. Each then fills an equal part, so that together they fit.
    Every rank of the group must call it.

    Raises:
        ValueError: off CUDA, as :func:`device_total_bytes`.
    """
    total = device_total_bytes(info.device)
    identities = every_rank_identity(info.device)
    sharing = identities.count(identities[info.rank]) if len(identities) > 1 else 1
    return total // sharing, sharing


@dataclass(frozen=True)
class MicroBatchProbe:
    """What the probe measured on this rank and what every rank chose.

    Bytes are this rank's; the effective batch is unchanged.
    """

    micro_batch: int
    accumulation: int
    world_size: int
    seq_len: int
    points: tuple[tuple[int, int], ...]  # (micro-batch, peak bytes), in order
    resident: int
    per_sample: int  # bytes per sequence
    optimizer_state: int  # AdamW's moments
    expected_peak: int
    budget: int
    device_bytes: int
    margin: float
    nonlinearity: float
    sharing: int = 1  # ranks training on this GPU

    def predict(self, micro_batch: int) -> int:
        """Expected peak bytes at ``micro_batch``."""
        return self.resident + self.per_sample * micro_batch + self.optimizer_state

    def describe(self) -> str:
        """One log line: the choice, the points, the line and the budget."""
        points = ", ".join(f"{m}: {p / 1e9:.3f} GB" for m, p in self.points)
        return (
            f"--micro-batch auto (probed): {self.micro_batch} (x {self.accumulation} accumulation x "
            f"{self.world_size} rank(s) = effective batch {self.micro_batch * self.accumulation * self.world_size}) "
            f"at {self.seq_len} tokens; measured peaks by micro-batch {points}; line {self.resident / 1e9:.3f} GB + "
            f"{self.per_sample / 1e9:.3f} GB/sample (off by {self.nonlinearity:.1%} at most) + "
            f"{self.optimizer_state / 1e9:.3f} GB optimizer state; expected peak {self.expected_peak / 1e9:.3f} GB of "
            f"a {self.budget / 1e9:.3f} GB budget ({self.device_text()} less {self.margin:.0%})"
        )

    def device_text(self) -> str:
        """The memory the budget comes from."""
        if self.sharing == 1:
            return f"{self.device_bytes / 1e9:.3f} GB device"
        return f"{self.device_bytes / 1e9:.3f} GB: this rank's 1/{self.sharing} of a GPU the ranks share over gloo"

    def as_record(self) -> dict:
        """The choice, points and expected peak in GB, for the run's config record."""
        return {
            "micro_batch": self.micro_batch,
            "points": [[m, p / 1e9] for m, p in self.points],
            "resident_gb": self.resident / 1e9,
            "per_sample_gb": self.per_sample / 1e9,
            "optimizer_state_gb": self.optimizer_state / 1e9,
            "expected_peak_gb": self.expected_peak / 1e9,
            "budget_gb": self.budget / 1e9,
            "device_gb": self.device_bytes / 1e9,
            "margin": self.margin,
            "nonlinearity": self.nonlinearity,
            "sharing": self.sharing,
        }


def fit_peak_line(points: Sequence[tuple[int, int]]) -> tuple[int, int, float]:
    """A line above every ``(micro_batch, peak)`` point, so curvature never makes it predict low.

    Args:
        points (Sequence[tuple[int, int]]): measured micro-batches and peak bytes.

    Returns:
        tuple[int, int, float]: intercept, slope and the largest relative residual.

    Raises:
        ValueError: no points.
    """
    if not points:
        raise ValueError("fit_peak_line: no points.")
    pairs = [(Fraction(m), Fraction(p)) for m, p in points]  # exact: bytes are integers
    if len({m for m, _ in pairs}) < 2:
        return 0, math.ceil(max(p / m for m, p in pairs)), 0.0
    mean_m = sum(m for m, _ in pairs) / len(pairs)
    mean_p = sum(p for _, p in pairs) / len(pairs)
    slope = sum((m - mean_m) * (p - mean_p) for m, p in pairs) / sum((m - mean_m) ** 2 for m, _ in pairs)
    intercept = mean_p - slope * mean_m
    residual = max(float(abs(p - intercept - slope * m) / p) for m, p in pairs) if len(pairs) > 2 else 0.0
    (m1, p1), (m2, p2) = sorted(pairs)[-2:]
    steepest = math.ceil(max(slope, (p2 - p1) / (m2 - m1), Fraction(0)))
    return math.ceil(max(p - steepest * m for m, p in pairs)), steepest, residual


def largest_fitting_divisor(per_rank: int, predict: Callable[[int], int], budget: int) -> int:
    """The largest divisor of ``per_rank`` whose prediction fits ``budget``; 0 if none."""
    for m in sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0), reverse=True):
        if predict(m) <= budget:
            return m
    return 0


def _measure_and_fit(
    model: torch.nn.Module,
    seq_len: int,
    info: DistInfo,
    precision: Precision | None,
    device_bytes: int | None,
    measure: Measure | None,
    margin: float,
    points: list[int],
    optimizer_state: int | None,
) -> MicroBatchProbe:
    """This rank's points and line, before the ranks agree."""
    device_bytes, sharing = device_share_bytes(info) if device_bytes is None else (device_bytes, 1)
    measure = cuda_peak_bytes(info.device) if measure is None else measure
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = sum(2 * p.numel() * p.element_size() for p in trainable) if optimizer_state is None else optimizer_state
    budget = int(device_bytes * (1.0 - margin))
    measured = _measure_points(ProbeStep(model, trainable, seq_len, info, precision), measure, points, budget - state)
    resident, per_sample, nonlinearity = fit_peak_line(measured) if measured else (0, 0, 0.0)
    return MicroBatchProbe(
        micro_batch=0,
        accumulation=0,
        world_size=info.world_size,
        seq_len=seq_len,
        points=tuple(measured),
        resident=resident,
        per_sample=per_sample,
        optimizer_state=state,
        expected_peak=0,
        budget=budget,
        device_bytes=device_bytes,
        margin=margin,
        nonlinearity=nonlinearity,
        sharing=sharing,
    )


def probe_micro_batch(
    model: torch.nn.Module,
    *,
    seq_len: int,
    effective_batch: int,
    info: DistInfo,
    precision: Precision | None = None,
    device_bytes: int | None = None,
    measure: Measure | None = None,
    margin: float = PROBE_MARGIN,
    points: Sequence[int] = PROBE_POINTS,
    optimizer_state: int | None = None,
) -> MicroBatchProbe:
    """Measures ``model``'s peak at a few micro-batches and chooses the largest that fits.

    Call it on every rank, on the unwrapped model as it trains, before the optimizer exists.

    Args:
        model (torch.nn.Module): a causal LM taking ``labels`` and ``num_items_in_batch``.
        seq_len (int): tokens per sequence, the run's ``max_seq_len``.
        effective_batch (int): samples per optimizer step over all ranks.
        info (DistInfo): this rank, its device and the world size.
        precision (Precision | None): the run's autocast. Default: None.
        device_bytes (int | None): the memory to fill. Default: :func:`device_share_bytes`.
        measure (Measure | None): runs a step, returns its peak bytes. Default: :func:`cuda_peak_bytes`.
        margin (float): share of ``device_bytes`` left free. Default: :data:`PROBE_MARGIN`.
        points (Sequence[int]): micro-batches to measure, ascending. Default: :data:`PROBE_POINTS`.
        optimizer_state (int | None): bytes the optimizer adds. Default: twice the trainable bytes.

    Returns:
        MicroBatchProbe: the smallest choice over ranks, with this rank's measurements.

    Raises:
        ValueError: a bad batch or margin, no device memory, or micro-batch 1 does not fit.
        RuntimeError: the probe failed on another rank.
    """
    per_rank = gradient_accumulation_steps(effective_batch, 1, info.world_size)
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin={margin}: must be in [0, 1).")
    failure, probe = None, None
    try:  # a failing rank still joins the all-reduce below
        fitting = [m for m in points if m <= per_rank] or [1]
        probe = _measure_and_fit(
            model, seq_len, info, precision, device_bytes, measure, margin, fitting, optimizer_state
        )
        mine = largest_fitting_divisor(per_rank, probe.predict, probe.budget) if probe.points else 0
    except Exception as error:  # noqa: BLE001  (re-raised after the all-reduce)
        failure, mine = error, -1
    chosen = _smallest_over_ranks(mine, info)
    if failure is not None:
        raise failure
    if chosen < 0:
        raise RuntimeError("--micro-batch auto: the probe failed on another rank (its log has the error).")
    if chosen == 0:
        raise ValueError(_none_fits(probe, mine, info))
    if probe.nonlinearity > LINEARITY_TOLERANCE and info.is_main_process:
        logger.warning(
            "--micro-batch auto: the measured peaks are %.1f%% off a straight line in the micro-batch; the choice "
            "extrapolates along the steepest part, above every point.",
            100 * probe.nonlinearity,
        )
    probe = _with_choice(probe, chosen, per_rank)
    if info.is_main_process:
        logger.info("%s", probe.describe())
    return probe


def _with_choice(probe: MicroBatchProbe, chosen: int, per_rank: int) -> MicroBatchProbe:
    from dataclasses import replace

    return replace(probe, micro_batch=chosen, accumulation=per_rank // chosen, expected_peak=probe.predict(chosen))


def _none_fits(probe: MicroBatchProbe | None, mine: int, info: DistInfo) -> str:
    if mine > 0 or probe is None:
        return (
            f"--micro-batch auto: micro-batch 1 does not fit on another rank's device (rank {info.rank}'s fits; "
            "the ranks choose together). See that rank's log; lower --max-seq-len, or give --micro-batch a number."
        )
    measured = ", ".join(f"{m}: {p / 1e9:.3f} GB" for m, p in probe.points) or "none finished (out of memory)"
    return (
        f"--micro-batch auto: even micro-batch 1 does not fit on rank {info.rank}: measured peaks {measured} at "
        f"{probe.seq_len} tokens, plus {probe.optimizer_state / 1e9:.3f} GB optimizer state, against a "
        f"{probe.budget / 1e9:.3f} GB budget ({probe.device_text()} less {probe.margin:.0%}). "
        "Lower --max-seq-len, keep gradient checkpointing on, use a larger device"
        + (", run fewer processes on the shared GPU" if probe.sharing > 1 else "")
        + ", or give --micro-batch 1 to train without the margin."
    )


def _smallest_over_ranks(value: int, info: DistInfo) -> int:
    if not (info.is_distributed and dist.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=info.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def _measure_points(step: ProbeStep, measure: Measure, points: list[int], budget: int) -> list[tuple[int, int]]:
    """Measures peaks at each point, stopping where the line predicts no fit."""
    measured: list[tuple[int, int]] = []
    with step:
        try:
            step.run(points[0])  # warm-up: compilation and lazy state
        except torch.OutOfMemoryError:
            step.release()
            return measured
        for m in points:
            if len(measured) >= 2:
                resident, per_sample, _ = fit_peak_line(measured)
                if resident + per_sample * m > budget:
                    break
            try:
                peak = measure(lambda m=m: step.run(m), m)
            except torch.OutOfMemoryError:
                step.release()
                break
            measured.append((m, peak))
            if peak > budget:
                break
    return measured
