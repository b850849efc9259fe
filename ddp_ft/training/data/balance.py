"""Balanced ranks: which rank trains which samples of an optimizer step, and in which micro-batches.

A step's gradient depends only on *which* samples it holds (the loop normalises the loss by the answer tokens of the
whole global batch), not on how they are split over ranks and micro-batches. So the split is free to choose: a rank
that drew the longer samples makes every other rank wait at the step's all-reduce. ``balanced_plan`` sorts the
step's samples by length, cuts them into micro-batches of similar lengths (less padding) and deals the micro-batches
to ranks so that every rank pads to about the same number of tokens. It is a pure function of the step's samples and
their lengths: every rank computes the same plan, with no communication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Plan = list[list[list[int]]]  # plan[rank][micro_step] -> the sample indices of that micro-batch


def _check(indices: Sequence[int], world_size: int, micro_batch: int, accumulation: int) -> None:
    if min(world_size, micro_batch, accumulation) < 1:
        raise ValueError(f"world_size={world_size}, micro_batch={micro_batch}, accumulation={accumulation}: need >= 1.")
    if world_size == 1 and (accumulation - 1) * micro_batch < len(indices) <= accumulation * micro_batch:
        return  # one rank: its last micro-batch may be partial (the Trainer's last batch on one process)
    if len(indices) != world_size * micro_batch * accumulation:
        raise ValueError(
            f"a step of {len(indices)} samples is not world_size={world_size} x micro_batch={micro_batch} x "
            f"accumulation={accumulation}."
        )


def strided_plan(indices: Sequence[int], world_size: int, micro_batch: int, accumulation: int) -> Plan:
    """The unbalanced split, in global order: rank ``r`` reads positions ``r, r + world_size, ...`` of the step,
    ``micro_batch`` at a time (a ``DistributedSampler`` shard)."""
    _check(indices, world_size, micro_batch, accumulation)
    shards = [list(indices[rank::world_size]) for rank in range(world_size)]
    return [[shard[k * micro_batch : (k + 1) * micro_batch] for k in range(accumulation)] for shard in shards]


def micro_batch_cost(lengths: Sequence[int]) -> int:
    """Padded tokens of one right-padded micro-batch: its size times its longest sample."""
    return len(lengths) * max(lengths)


def rank_costs(
    plan: Plan, length_of: dict[int, int], cost: Callable[[Sequence[int]], int] = micro_batch_cost
) -> list[int]:
    """Tokens each rank of ``plan`` computes in the step, padding included (``length_of``: sample index -> tokens;
    ``cost``: a micro-batch's tokens from its lengths, padded by default)."""
    return [sum(cost([length_of[i] for i in batch]) for batch in batches) for batches in plan]


def balanced_plan(
    indices: Sequence[int],
    lengths: Sequence[int],
    world_size: int,
    micro_batch: int,
    accumulation: int,
    cost: Callable[[Sequence[int]], int] = micro_batch_cost,
) -> Plan:
    """Split one optimizer step's samples into ``accumulation`` micro-batches of ``micro_batch`` per rank, grouping
    similar lengths and balancing the padded tokens per rank.

    The samples are sorted by length (ties by their position in the step, so the result is deterministic) and cut
    into ``world_size * accumulation`` micro-batches of consecutive samples. The micro-batches go to ranks most
    expensive first (cost = size x longest sample), each to the rank with the least cost so far among those with
    fewer than ``accumulation`` (longest processing time first, with a capacity; ties to the lower rank); then
    micro-batches are swapped between the most loaded rank and another while that lowers the larger of the two.
    Each rank trains its micro-batches most expensive first, so a memory peak shows on the first micro-step. Every
    sample of the step appears exactly once; with ``world_size=1`` the micro-batches still group similar lengths.
    Guarantees: the slowest rank pads to no more tokens than with ``strided_plan`` (which is returned on the rare
    step where the heuristic does worse), and the step pads to no more tokens in all (consecutive runs of the
    sorted lengths minimise the sum of the micro-batch costs).

    Args:
        indices (Sequence[int]): the step's sample indices, in global order.
        lengths (Sequence[int]): their token lengths, aligned with ``indices``.
        world_size (int): ranks.
        micro_batch (int): samples per micro-batch.
        accumulation (int): micro-batches per rank.
        cost (Callable[[Sequence[int]], int]): tokens one micro-batch computes, from its lengths; packed batches
            give ``PackedCollator.cost``, so the ranks get about the same packed tokens, and the micro-batches are
            cut as above or dealt in a snake over the sorted samples (mixing long and short), whichever leaves the
            slowest rank fewer tokens. Default: ``micro_batch_cost`` (right padding; the optimality of the sorted cut
            above is for this cost)

    Returns:
        Plan: ``plan[rank][micro_step]``, a list of ``micro_batch`` sample indices (on one rank the last may hold
        fewer: a step of fewer than ``micro_batch * accumulation`` samples, the stock Trainer's last on one process).

    Raises:
        ValueError: ``len(indices) != world_size * micro_batch * accumulation`` (on one rank: not within its last
            micro-batch), or lengths not aligned.
    """
    _check(indices, world_size, micro_batch, accumulation)
    if len(lengths) != len(indices):
        raise ValueError(f"{len(lengths)} lengths for {len(indices)} samples: one length per sample.")
    by_length = sorted(range(len(indices)), key=lambda p: (lengths[p], p))
    count = world_size * accumulation
    candidates = [[by_length[g * micro_batch : (g + 1) * micro_batch] for g in range(count)]]
    if cost is not micro_batch_cost:
        # Packed rows fill up when long and short samples share a micro-batch: also try the sorted samples dealt
        # out in a snake (0, 1, .., n-1, n-1, .., 0, ...), which mixes them, and keep the better of the two.
        snake = [[] for _ in range(count)]
        for i, p in enumerate(by_length):
            turn, g = divmod(i, count)
            snake[g if turn % 2 == 0 else count - 1 - g].append(p)
        candidates.append(snake)
    best = None  # ((slowest rank's cost, the step's cost), micro-batches, each rank's, each rank's cost)
    for groups in candidates:
        assigned, totals = _deal(groups, [cost([lengths[p] for p in g]) for g in groups], world_size, accumulation)
        if best is None or (max(totals), sum(totals)) < best[0]:
            best = ((max(totals), sum(totals)), groups, assigned, totals)
    _, groups, assigned, totals = best
    plan = [[[indices[p] for p in groups[g]] for g in rank_groups] for rank_groups in assigned]
    # LPT and single swaps are a heuristic: on rare draws (seen with micro_batch 1 only) the strided split is a
    # few tokens better. Keep it then, so the slowest rank is never slower than unbalanced.
    strided = strided_plan(indices, world_size, micro_batch, accumulation)
    length_of = dict(zip(indices, lengths, strict=True))
    return strided if max(rank_costs(strided, length_of, cost)) < max(totals) else plan


def _deal(
    groups: list[list[int]], costs: list[int], world_size: int, accumulation: int
) -> tuple[list[list[int]], list[int]]:
    """Micro-batches to ranks, longest processing time first with a capacity, then refined by swaps; each rank's
    micro-batches most expensive first. Returns each rank's micro-batch numbers and its total cost."""
    totals, assigned = [0] * world_size, [[] for _ in range(world_size)]
    for g in sorted(range(len(groups)), key=lambda g: (-costs[g], -g)):  # ties: the longer lengths first
        rank = min((r for r in range(world_size) if len(assigned[r]) < accumulation), key=lambda r: (totals[r], r))
        assigned[rank].append(g)
        totals[rank] += costs[g]
    _refine(assigned, totals, costs)
    for rank_groups in assigned:
        rank_groups.sort(key=lambda g: (-costs[g], -g))
    return assigned, totals


def _refine(assigned: list[list[int]], totals: list[int], costs: list[int]) -> None:
    """Swap micro-batches between the most loaded rank and another while that lowers the pair's larger cost."""
    while True:
        top = max(range(len(totals)), key=lambda r: (totals[r], -r))
        best = None  # (new larger cost of the pair, other rank, position on top, position on other)
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
