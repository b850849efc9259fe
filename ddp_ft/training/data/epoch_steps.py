"""How an epoch is cut into optimizer steps: the plain loop's whole steps, or the stock Trainer's.

Two policies, both pure functions of the epoch's size and the batch shape:

- The plain loop (``trainer_drop_last=None``): ``floor(train samples / effective batch)`` whole steps; the trailing
  partial batch is left out, so every world size trains the same steps and no sample twice in an epoch.
- The stock Trainer on Accelerate (``trainer_drop_last`` = its ``dataloader_drop_last``): the epoch is cut into
  per-device batches of ``micro_batch``, dealt to the ranks by Accelerate's ``BatchSamplerShard``
  (``even_batches=True``), and ``Trainer._inner_training_loop`` makes ``ceil(batches per rank / accumulation)``
  optimizer steps of them, the last one shorter when the accumulation does not divide the batches. With
  ``dataloader_drop_last=False`` the shard completes the last partial batch, and gives every rank as many batches,
  with samples from the start of the epoch's order (Accelerate's ``initial_data``, cycled): every sample is trained,
  the first ``repeated`` ones twice. With ``True`` the partial batch and the batches that would leave a rank without
  one are dropped. On one process nothing is sharded: the last batch is partial, as the Trainer's is, and no sample
  is repeated.

Positions count in the epoch's global order extended by those repeats (:meth:`EpochSteps.extend`): step ``s`` trains
positions ``[s * E, s * E + samples of the step)``, ``E`` the effective batch, so the whole steps are the same
positions on any world size and with either policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EpochSteps:
    """The optimizer steps of one epoch and the positions of the epoch's order each trains.

    Args:
        train_samples (int): samples in the training set.
        world_size (int): ranks.
        micro_batch (int): samples per forward on one rank.
        accumulation (int): micro-batches per rank in a whole step.
        trainer_drop_last (bool | None): None: the plain loop's whole steps. A bool: the stock Trainer's epoch with
            that ``dataloader_drop_last``. Default: None
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
        """Micro-batches each rank trains in the epoch (the Trainer's ``len(train_dataloader)`` on that rank)."""
        n, m, w = self.train_samples, self.micro_batch, self.world_size
        if self.trainer_drop_last is None:
            return n // self.effective_batch * self.accumulation
        if self.trainer_drop_last:
            return n // m // w  # DataLoader(drop_last=True), then a shard of whole rounds of ranks
        return math.ceil(math.ceil(n / m) / w)  # the shard completes the last round with repeats

    @property
    def steps(self) -> int:
        """Optimizer steps in the epoch: ``ceil(micro_batches_per_rank / accumulation)``, the Trainer's
        ``num_update_steps_per_epoch``."""
        return math.ceil(self.micro_batches_per_rank / self.accumulation)

    @property
    def partial_last(self) -> bool:
        """Whether the last micro-batch may hold fewer than ``micro_batch`` samples: the Trainer's on one process,
        whose loader Accelerate does not shard, so nothing completes it."""
        return self.trainer_drop_last is False and self.world_size == 1

    @property
    def samples(self) -> int:
        """Samples trained in the epoch over all ranks, repeats included."""
        if self.partial_last:
            return self.train_samples
        return self.micro_batches_per_rank * self.world_size * self.micro_batch

    @property
    def repeated(self) -> int:
        """Samples trained twice in the epoch: the first ``repeated`` of its order (``dataloader_drop_last=False``)."""
        return max(0, self.samples - self.train_samples)

    @property
    def left_out(self) -> int:
        """Samples of the training set not trained in the epoch: the last ``left_out`` of its order."""
        return max(0, self.train_samples - self.samples)

    def accumulation_of(self, step: int) -> int:
        """Micro-batches per rank of step ``step`` (within the epoch): ``accumulation``, or fewer for the last."""
        return min(self.accumulation, self.micro_batches_per_rank - step * self.accumulation)

    def positions(self, step: int) -> slice:
        """Positions of step ``step`` (within the epoch) in the extended order (:meth:`extend`)."""
        start = step * self.effective_batch
        return slice(start, min(start + self.world_size * self.micro_batch * self.accumulation_of(step), self.samples))

    def extend(self, order: list[int]) -> list[int]:
        """The epoch's order as trained: cut to ``samples``, or continued from its start (as Accelerate's shard
        completes the epoch, cycling when the set is smaller than one round of batches)."""
        if len(order) != self.train_samples:
            raise ValueError(f"an order of {len(order)} samples for an epoch of {self.train_samples}.")
        return [order[p % len(order)] for p in range(self.samples)]
