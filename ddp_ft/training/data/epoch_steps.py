"""How an epoch is cut into optimizer steps: the plain loop's whole steps, or the stock Trainer's.

The plain loop trains whole steps and leaves the trailing partial batch out. The stock Trainer follows
Accelerate's shard: with ``dataloader_drop_last=False`` it completes the last batch by repeating the epoch's
first samples; with ``True`` it drops it. Either way, whole steps cover the same positions on any world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EpochSteps:
    """The optimizer steps of one epoch and the positions each trains.

    Args:
        train_samples (int): samples in the training set.
        world_size (int): ranks.
        micro_batch (int): samples per forward on one rank.
        accumulation (int): micro-batches per rank in a whole step.
        trainer_drop_last (bool | None): the Trainer's ``dataloader_drop_last``; None for the plain loop. Default: None
    """

    train_samples: int
    world_size: int
    micro_batch: int
    accumulation: int
    trainer_drop_last: bool | None = None

    @property
    def effective_batch(self) -> int:
        """Samples of a whole step, over all ranks."""
        return self.world_size * self.micro_batch * self.accumulation

    @property
    def micro_batches_per_rank(self) -> int:
        """Micro-batches each rank trains in the epoch."""
        n, m, w = self.train_samples, self.micro_batch, self.world_size
        if self.trainer_drop_last is None:
            return n // self.effective_batch * self.accumulation
        if self.trainer_drop_last:
            return n // m // w
        return math.ceil(math.ceil(n / m) / w)  # the shard completes the last round with repeats

    @property
    def steps(self) -> int:
        """Optimizer steps in the epoch, the Trainer's ``num_update_steps_per_epoch``."""
        return math.ceil(self.micro_batches_per_rank / self.accumulation)

    @property
    def partial_last(self) -> bool:
        """Whether the last micro-batch may be short: the Trainer's on one process."""
        return self.trainer_drop_last is False and self.world_size == 1

    @property
    def samples(self) -> int:
        """Samples trained in the epoch over all ranks, repeats included."""
        if self.partial_last:
            return self.train_samples
        return self.micro_batches_per_rank * self.world_size * self.micro_batch

    @property
    def repeated(self) -> int:
        """Samples trained twice in the epoch."""
        return max(0, self.samples - self.train_samples)

    @property
    def left_out(self) -> int:
        """Samples not trained in the epoch: the last of its order."""
        return max(0, self.train_samples - self.samples)

    def accumulation_of(self, step: int) -> int:
        """Micro-batches per rank of step ``step``; the last may have fewer."""
        return min(self.accumulation, self.micro_batches_per_rank - step * self.accumulation)

    def positions(self, step: int) -> slice:
        """Positions of step ``step`` in the extended order."""
        start = step * self.effective_batch
        return slice(start, min(start + self.world_size * self.micro_batch * self.accumulation_of(step), self.samples))

    def extend(self, order: list[int]) -> list[int]:
        """The epoch's order as trained: cut, or cycled from its start as Accelerate's shard does."""
        if len(order) != self.train_samples:
            raise ValueError(f"an order of {len(order)} samples for an epoch of {self.train_samples}.")
        return [order[p % len(order)] for p in range(self.samples)]
