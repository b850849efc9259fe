"""Balanced ranks: which rank trains which samples of an optimizer step.

The loss is normalised over the whole global batch, so a step's gradient depends only on its samples, not on
their split. A rank with longer samples makes the others wait at the all-reduce. ``balanced_plan`` evens the
padded tokens per rank. Every rank computes the same plan, with no communication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Plan = list[list[list[int]]]  # plan[rank][micro_step] -> sample indices
# Batch widths round up to this: on a GPU sdpa's mask must be aligned to 8 elements, and TorchInductor guards on it,
# so widths off it would compile the layers again (docs/own_data.md).
WIDTH_MULTIPLE = 8


def _check(indices: Sequence[int], world_size: int, micro_batch: int, accumulation: int) -> None:
    if min(world_size, micro_batch, accumulation) < 1:
        raise ValueError(f"world_size={world_size}, micro_batch={micro_batch}, accumulation={accumulation}: need >= 1.")
    if world_size == 1 and (accumulation - 1) * micro_batch < len(indices) <= accumulation * micro_batch:
        return  # one rank: its last micro-batch may be partial
    if len(indices) != world_size * micro_batch * accumulation:
        raise ValueError(
            f"a step of {len(indices)} samples is not world_size={world_size} x micro_batch={micro_batch} x "
            f"accumulation={accumulation}."
        )


def strided_plan(indices: Sequence[int], world_size: int, micro_batch: int, accumulation: int) -> Plan:
    """The unbalanced split: rank ``r`` reads positions ``r, r + world_size, ...`` of the step."""
    _check(indices, world_size, micro_batch, accumulation)
    shards = [list(indices[rank::world_size]) for rank in range(world_size)]
    return [[shard[k * micro_batch : (k + 1) * micro_batch] for k in range(accumulation)] for shard in shards]


def batch_width(longest: int) -> int:
    """The width of a micro-batch whose longest row holds ``longest`` tokens: the next multiple of 8."""
    return -(-longest // WIDTH_MULTIPLE) * WIDTH_MULTIPLE


def micro_batch_cost(lengths: Sequence[int]) -> int:
    """Padded tokens of a right-padded micro-batch: size times its width."""
    return len(lengths) * batch_width(max(lengths))


def rank_costs(
    plan: Plan, length_of: dict[int, int], cost: Callable[[Sequence[int]], int] = micro_batch_cost
) -> list[int]:
    """Tokens each rank of ``plan`` computes in the step, padding included."""
    return [sum(cost([length_of[i] for i in batch]) for batch in batches) for batches in plan]


def balanced_plan(
    indices: Sequence[int],
    lengths: Sequence[int],
    world_size: int,
    micro_batch: int,
    accumulation: int,
    cost: Callable[[Sequence[int]], int] = micro_batch_cost,
) -> Plan:
    """Split one step's samples into micro-batches per rank, balancing padded tokens.

    Sorted samples are cut into micro-batches of similar lengths, dealt longest first to the least loaded rank,
    then swapped while that helps. The slowest rank never pads more than with ``strided_plan``. Each rank runs
    its costliest micro-batch first, so a memory peak shows on the first micro-step.

    Args:
        indices (Sequence[int]): the step's sample indices, in global order.
        lengths (Sequence[int]): their token lengths.
        world_size (int): ranks.
        micro_batch (int): samples per micro-batch.
        accumulation (int): micro-batches per rank.
        cost (Callable): tokens one micro-batch computes from its lengths. Default: ``micro_batch_cost``

    Returns:
        Plan: ``plan[rank][micro_step]``, sample indices; on one rank the last may be partial.

    Raises:
        ValueError: the step size does not match the arguments, or lengths not aligned.

    Example:
        >>> balanced_plan([0, 1, 2, 3], [9, 1, 8, 2], world_size=2, micro_batch=2, accumulation=1)
        [[[2, 0]], [[1, 3]]]
    """
    _check(indices, world_size, micro_batch, accumulation)
    if len(lengths) != len(indices):
        raise ValueError(f"{len(lengths)} lengths for {len(indices)} samples: one length per sample.")
    by_length = sorted(range(len(indices)), key=lambda p: (lengths[p], p))
    count = world_size * accumulation
    candidates = [[by_length[g * micro_batch : (g + 1) * micro_batch] for g in range(count)]]
    if cost is not micro_batch_cost:
        # Packed rows fill better when lengths mix: also try a snake deal over the sorted samples.
        snake = [[] for _ in range(count)]
        for i, p in enumerate(by_length):
            turn, g = divmod(i, count)
            snake[g if turn % 2 == 0 else count - 1 - g].append(p)
        candidates.append(snake)
    best = None  # ((slowest rank, step total), groups, assignment, totals)
    for groups in candidates:
        assigned, totals = _deal(groups, [cost([lengths[p] for p in g]) for g in groups], world_size, accumulation)
        if best is None or (max(totals), sum(totals)) < best[0]:
            best = ((max(totals), sum(totals)), groups, assigned, totals)
    _, groups, assigned, totals = best
    plan = [[[indices[p] for p in groups[g]] for g in rank_groups] for rank_groups in assigned]
    # The heuristic rarely loses to the strided split; keep that one then.
    strided = strided_plan(indices, world_size, micro_batch, accumulation)
    length_of = dict(zip(indices, lengths, strict=True))
    return strided if max(rank_costs(strided, length_of, cost)) < max(totals) else plan


def _deal(
    groups: list[list[int]], costs: list[int], world_size: int, accumulation: int
) -> tuple[list[list[int]], list[int]]:
    """Deal micro-batches to ranks, longest first, then refine by swaps."""
    totals, assigned = [0] * world_size, [[] for _ in range(world_size)]
    for g in sorted(range(len(groups)), key=lambda g: (-costs[g], -g)):
        rank = min((r for r in range(world_size) if len(assigned[r]) < accumulation), key=lambda r: (totals[r], r))
        assigned[rank].append(g)
        totals[rank] += costs[g]
    _refine(assigned, totals, costs)
    for rank_groups in assigned:
        rank_groups.sort(key=lambda g: (-costs[g], -g))
    return assigned, totals


def _refine(assigned: list[list[int]], totals: list[int], costs: list[int]) -> None:
    """Swap micro-batches between the most loaded rank and another while that helps."""
    while True:
        top = max(range(len(totals)), key=lambda r: (totals[r], -r))
        best = None  # (pair's new larger cost, other rank, i, j)
        for other in range(len(totals)):
            for i, g in enumerate(assigned[top]):
                for j, h in enumerate(assigned[other]):
                    delta = costs[g] - costs[h]
                    if other == top or delta <= 0:
                        continue
                    larger = max(totals[top] - delta, totals[other] + delta)
                    if larger < totals[top] and (best is None or larger < best[0]):
                        best = (larger, other, i, j)
        if best is None:
            return
        _, other, i, j = best
        g, h = assigned[top][i], assigned[other][j]
        assigned[top][i], assigned[other][j] = h, g
        totals[top] += costs[h] - costs[g]
        totals[other] += costs[g] - costs[h]
