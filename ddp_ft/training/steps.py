"""One optimizer step of the plain loop, and evaluation.

Each micro-batch's loss is normalised by the answer tokens of the whole effective batch. So one process with
accumulation 2k and two with k compute the same gradient.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed import DistInfo
from .data import answer_tokens, count_tokens
from .model.precision import Precision


def _count_tokens(group: list[dict], device: torch.device, pad_token_id: int | None = None) -> torch.Tensor:
    """[answer tokens, non-padding input tokens] of a list of micro-batches."""
    answers = sum(answer_tokens(b) for b in group)
    inputs = sum(count_tokens(b, pad_token_id) for b in group)
    return torch.tensor([answers, inputs], dtype=torch.float64, device=device)


def _sum_over_ranks(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.is_distributed:
        dist.all_reduce(t)
    return t


def step_counts(
    group: list[dict], info: DistInfo, stop_flag: float = 0.0, pad_token_id: int | None = None
) -> torch.Tensor:
    """[answer tokens, input tokens, ranks asking to stop] of one step, summed over ranks.

    One collective, for callers that lack the step's global counts. Packed batches need ``pad_token_id``.
    """
    local = torch.cat(
        [
            _count_tokens(group, info.device, pad_token_id),
            torch.tensor([stop_flag], dtype=torch.float64, device=info.device),
        ]
    )
    return _sum_over_ranks(local, info)


@dataclass
class StepOutcome:
    """What :func:`forward_backward_timed` leaves on the device for one transfer."""

    loss: torch.Tensor  # global token-mean loss (0-d)
    counts: torch.Tensor  # [answer tokens, input tokens] summed over ranks
    compute_ms: torch.Tensor  # each rank's ms to its last gradient
    stop_flags: torch.Tensor  # each rank's stop flag


def rank_balance(compute_ms: list[float], rank: int) -> dict[str, float]:
    """How unevenly the ranks computed one step.

    Returns:
        dict[str, float]: ``compute_max_ms``, ``compute_min_ms``, ``imbalance`` (max / min), and
        ``wait_for_slowest_ms``, this rank's wait at the all-reduce.
    """
    slowest, fastest = max(compute_ms), min(compute_ms)
    return {
        "compute_max_ms": slowest,
        "compute_min_ms": fastest,
        "imbalance": slowest / fastest if fastest > 0 else 1.0,
        "wait_for_slowest_ms": slowest - compute_ms[rank],
    }


def forward_backward(
    model: torch.nn.Module,
    group: list[dict],
    info: DistInfo,
    counts: torch.Tensor | None = None,
    precision: Precision | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate the gradient of one optimizer step over this rank's micro-batches.

    ``no_sync()`` wraps every micro-batch but the last. The loss is scaled by the world size, since DDP averages.

    Args:
        counts (torch.Tensor | None): ``step_counts(group, info)``. Default: reduced here
        precision (Precision | None): autocast of the forward. Default: the model's own dtypes
        scaler (torch.amp.GradScaler | None): scales a float16 loss. Default: None

    Returns:
        tuple[torch.Tensor, torch.Tensor]: the global token-mean loss, on the device, and the token counts.

    Example:
        >>> loss, counts = forward_backward(model, micro_batches, info)
    """
    outcome = forward_backward_timed(model, group, info, counts, precision, scaler)
    return outcome.loss, outcome.counts


def forward_backward_timed(
    model: torch.nn.Module,
    group: list[dict],
    info: DistInfo,
    counts: torch.Tensor | None = None,
    precision: Precision | None = None,
    scaler: torch.amp.GradScaler | None = None,
    stop_flag: Callable[[], float] | None = None,
) -> StepOutcome:
    """:func:`forward_backward`, also gathering each rank's compute ms.

    Loss, compute time and stop flag share one all-gather after backward. So every rank sees a stop signal at
    the same step boundary.

    Args:
        stop_flag (Callable[[], float] | None): this rank's stop flag, read after the last backward. Default: never
    """
    started = time.perf_counter()
    counts = step_counts(group, info) if counts is None else counts
    answer_tokens = counts[0].clamp(min=1).to(torch.float32)
    local_loss = torch.zeros((), dtype=torch.float64, device=info.device)
    autocast = precision.autocast_context() if precision is not None else nullcontext()
    for i, batch in enumerate(group):
        batch = {k: v.to(info.device, non_blocking=True) for k, v in batch.items()}  # pinned on CUDA: async
        last = i == len(group) - 1
        with model.no_sync() if (info.is_distributed and not last) else nullcontext(), autocast:
            loss = model(**batch, num_items_in_batch=answer_tokens).loss
            scaled = loss * info.world_size
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        local_loss += loss.detach().double()
    ready = getattr(model, "last_gradient_ready_at", None)
    compute_ms = ((ready if ready is not None and ready > started else time.perf_counter()) - started) * 1e3
    stop = stop_flag() if stop_flag is not None else 0.0
    extra = torch.tensor([compute_ms, stop], dtype=torch.float64, device=info.device)
    mine = torch.cat([local_loss.unsqueeze(0), extra])
    if info.is_distributed:
        per_rank = [torch.empty_like(mine) for _ in range(info.world_size)]
        dist.all_gather(per_rank, mine)
        gathered = torch.stack(per_rank)
    else:
        gathered = mine.unsqueeze(0)
    return StepOutcome(gathered[:, 0].sum(), counts[:2], gathered[:, 1], gathered[:, 2])


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, dataset, collate_fn, micro_batch: int, info: DistInfo, precision: Precision | None = None
) -> float:
    """Token-mean loss over ``dataset``, each rank on ``rank::world_size``.

    ``model`` is unwrapped: only the two sums are communicated.
    """
    was_training = model.training
    model.eval()
    indices = list(range(info.rank, len(dataset), info.world_size))
    totals = torch.zeros(2, dtype=torch.float64, device=info.device)
    autocast = precision.autocast_context() if precision is not None else nullcontext()
    for start in range(0, len(indices), micro_batch):
        batch = collate_fn([dataset[i] for i in indices[start : start + micro_batch]])
        batch = {k: v.to(info.device) for k, v in batch.items()}
        tokens = answer_tokens(batch)
        with autocast:
            totals[0] += model(**batch, num_items_in_batch=1).loss.double()  # summed token loss
        totals[1] += tokens
    _sum_over_ranks(totals, info)
    model.train(was_training)
    return (totals[0] / totals[1].clamp(min=1)).item()


@dataclass
class StepResult:
    """One optimizer step's scalars, read from the device in one transfer."""

    loss: float
    grad_norm: float
    lr: float
    input_tokens: int
    compute_ms: list[float]  # every rank's forward/backward time, for rank_balance
    stop_flags: list[float]  # every rank's stop flag at this step's gather
    loss_scale: float | None  # float16 only
    skipped: bool  # float16 overflow skipped the step
