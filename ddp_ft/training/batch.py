"""Batch arithmetic: the accumulation that keeps the effective batch on every world size."""

from __future__ import annotations


def gradient_accumulation_steps(effective_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-steps per optimizer step, so every world size trains the same effective batch.

    Args:
        effective_batch (int): samples per optimizer step.
        micro_batch (int): samples per forward per rank.
        world_size (int): ranks.

    Returns:
        int: the accumulation.

    Raises:
        ValueError: a size below 1, or ``effective_batch`` not a multiple of ``micro_batch * world_size``.

    Example:
        >>> gradient_accumulation_steps(32, 4, 2)
        4
    """
    for name, value in (("effective_batch", effective_batch), ("micro_batch", micro_batch), ("world_size", world_size)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1.")
    per_step = micro_batch * world_size
    if effective_batch % per_step:
        lower = max(per_step, effective_batch // per_step * per_step)
        divisors = [m for m in range(1, effective_batch + 1) if effective_batch % (m * world_size) == 0]
        hint = f"--micro-batch one of {divisors}" if divisors else f"--effective-batch a multiple of {world_size}"
        raise ValueError(
            f"effective_batch={effective_batch} is not divisible by micro_batch={micro_batch} x world_size="
            f"{world_size} = {per_step}: the runs would not train on the same batch. Use --effective-batch "
            f"{lower} or {lower + per_step}, or {hint}."
        )
    return effective_batch // per_step
