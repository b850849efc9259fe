"""Batches: the padding collator, token counts, and ``EpochLoader``, one rank's share of each step."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ..batch import gradient_accumulation_steps
from .balance import WIDTH_MULTIPLE, Plan, balanced_plan, micro_batch_cost, strided_plan
from .epoch_steps import EpochSteps
from .settings import IGNORE_INDEX
from .step_tokens import global_order


def make_collator(tokenizer):
    """Right-padding collator: pad token in ``input_ids``, -100 in ``labels``, widths a multiple of 8."""
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(
        tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, pad_to_multiple_of=WIDTH_MULTIPLE
    )


def count_tokens(batch: dict, pad_token_id: int | None = None) -> int:
    """Non-padding tokens of a collated batch, what throughput counts.

    Without a mask (packed rows), counts tokens other than ``pad_token_id``, as the Trainer does.
    """
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    ids = batch["input_ids"]
    return int(ids.numel() if pad_token_id is None else (ids != pad_token_id).sum())


def answer_tokens(batch: dict) -> int:
    """Tokens that carry loss, after the causal shift."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class DataLayout:
    """What fixes an epoch's global order; stored in every checkpoint.

    Epoch ``e`` is one permutation, seeded by ``seed + e``, the same on every world size. Step ``s`` trains
    positions ``[s * E, (s + 1) * E)`` of it. So a resume position means the same on any world size and
    micro-batch dividing ``E``. Balancing reorders samples only within a step, so the layout does not record it.

    Args:
        train_samples (int): samples in the training set.
        seed (int): shuffle seed.
        effective_batch (int): samples per optimizer step, over all ranks.
        world_size (int): ranks.
        micro_batch (int): samples per forward on one rank.

    Raises:
        ValueError: sizes below 1, or ``effective_batch`` not a multiple of ``micro_batch * world_size``.
    """

    train_samples: int
    seed: int
    effective_batch: int
    world_size: int
    micro_batch: int

    def __post_init__(self) -> None:
        for name in ("train_samples", "effective_batch", "world_size", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"DataLayout.{name}={getattr(self, name)}: must be >= 1.")
        gradient_accumulation_steps(self.effective_batch, self.micro_batch, self.world_size)

    @property
    def accumulation(self) -> int:
        """Micro-batches per rank per optimizer step."""
        return gradient_accumulation_steps(self.effective_batch, self.micro_batch, self.world_size)

    @property
    def steps_per_epoch(self) -> int:
        """Whole steps per epoch; the trailing partial batch is dropped."""
        return self.train_samples // self.effective_batch

    def describe(self) -> str:
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        return (
            f"effective batch {self.effective_batch} = {ranks} x micro-batch {self.micro_batch} x accumulation "
            f"{self.accumulation}, {self.train_samples} training samples, seed {self.seed}"
        )


def check_resume(saved: DataLayout, current: DataLayout, sample_in_epoch: int) -> None:
    """Refuse a resume that cannot continue the data exactly.

    Args:
        saved (DataLayout): the checkpoint's.
        current (DataLayout): this run's.
        sample_in_epoch (int): the checkpoint's position in its epoch.

    Raises:
        ValueError: naming both layouts and the setting to change.
    """
    if saved.effective_batch != current.effective_batch:
        fix = (
            f"the position ({sample_in_epoch} samples into the epoch) and every step after it are counted in steps of "
            f"{saved.effective_batch} samples. Resume with --effective-batch {saved.effective_batch} (any "
            f"--micro-batch and world size that divide it)"
        )
    elif saved.train_samples != current.train_samples:
        fix = (
            f"the training set changed ({saved.train_samples} -> {current.train_samples} samples), so the shuffled "
            "order differs. Resume on the same data (--source, --eval-fraction, --max-seq-len, --data-seed)"
        )
    elif saved.seed != current.seed:
        fix = f"the shuffle seed changed, so the order differs. Resume with --seed {saved.seed}"
    else:
        return
    raise ValueError(
        f"cannot resume exactly: the checkpoint was written with {saved.describe()}; this run has "
        f"{current.describe()}: {fix}, or start a new run in another --output-dir."
    )


class EpochLoader:
    """This rank's micro-batches, one epoch at a time.

    An epoch is ``floor(len(dataset) / effective_batch)`` steps on any world size, and no sample trains twice.
    ``trainer_drop_last`` gives the stock Trainer's steps instead (see ``epoch_steps``). Only ``epoch()``
    iterates, and it calls ``sampler.set_epoch`` first, so every epoch gets a new order. ``balance=True`` evens
    padded tokens over ranks within a step; the step's samples stay the same.

    Args:
        dataset: a map-style dataset of tokenized samples.
        collate_fn: e.g. ``make_collator(tokenizer)``.
        micro_batch (int): samples per batch.
        rank (int): this rank.
        world_size (int): number of ranks.
        seed (int): shuffle seed, the same on every rank.
        shuffle (bool): shuffle each epoch. Default: True
        effective_batch (int | None): samples per optimizer step over all ranks. Default: ``micro_batch * world_size``
        pin_memory (bool): collate into page-locked memory for async copies. Default: False
        balance (bool): balance ranks within each step. Default: True
        lengths (Sequence[int] | None): token length of every sample. Default: read from the dataset
        cost (Callable | None): tokens a micro-batch computes from its lengths. Default: ``micro_batch_cost``
        trainer_drop_last (bool | None): the stock Trainer's epoch with this ``dataloader_drop_last``. Default: None

    Raises:
        ValueError: bad sizes, a dataset smaller than one step, or lengths not one per sample.

    Example:
        >>> loader = EpochLoader(ds, make_collator(tok), micro_batch=4, rank=0, world_size=2, seed=0)
        >>> for batch in loader.epoch(0):
        ...     ...
    """

    def __init__(
        self,
        dataset,
        collate_fn,
        micro_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        effective_batch: int | None = None,
        pin_memory: bool = False,
        balance: bool = True,
        lengths: Sequence[int] | None = None,
        cost: Callable[[Sequence[int]], int] | None = None,
        trainer_drop_last: bool | None = None,
    ) -> None:
        from torch.utils.data import DistributedSampler

        if micro_batch < 1:
            raise ValueError(f"micro_batch={micro_batch}: must be >= 1.")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: need world_size >= 1 and 0 <= rank < world_size.")
        if len(dataset) == 0:
            raise ValueError("EpochLoader got an empty dataset.")
        effective_batch = micro_batch * world_size if effective_batch is None else effective_batch
        self.layout = layout = DataLayout(len(dataset), seed, effective_batch, world_size, micro_batch)
        self.steps = EpochSteps(len(dataset), world_size, micro_batch, layout.accumulation, trainer_drop_last)
        if self.steps.steps == 0:
            raise ValueError(
                f"the dataset has {len(dataset)} samples, fewer than one effective batch "
                f"(effective_batch={effective_batch}): lower --effective-batch or use more data."
                if trainer_drop_last is None
                else f"the dataset has {len(dataset)} samples, fewer than one batch of per_device_train_batch_size="
                f"{micro_batch} on each of {world_size} ranks: with dataloader_drop_last=True no step is left. "
                "Use more data, a smaller batch, or dataloader_drop_last=False."
            )
        self.dataset, self.collate_fn, self.micro_batch, self.rank = dataset, collate_fn, micro_batch, rank
        self.pin_memory = pin_memory
        self.balance, self.cost = balance, cost or micro_batch_cost
        self.lengths = (list(lengths) if lengths is not None else sample_lengths(dataset)) if balance else None
        if self.lengths is not None and len(self.lengths) != len(dataset):
            raise ValueError(f"{len(self.lengths)} lengths for {len(dataset)} samples: give one length per sample.")
        # One replica: the whole permutation, the same on every rank.
        self.sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed, drop_last=True)

    @property
    def samples_per_epoch(self) -> int:
        """Samples trained per epoch over all ranks."""
        return self.steps.samples

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank."""
        return self.steps.micro_batches_per_rank

    def describe_epoch(self) -> str:
        """One line: the epoch's steps and any samples left out."""
        return describe_epoch(self.layout, self.steps)

    def __iter__(self):
        raise TypeError(
            "EpochLoader is not iterable: use `for batch in loader.epoch(epoch)` so the shuffle changes "
            "every epoch (it calls sampler.set_epoch)."
        )

    def plans(self, epoch: int, start_step: int = 0) -> Iterator[Plan]:
        """Every rank's micro-batches of each step of ``epoch``, from ``start_step`` on."""
        steps = self.steps
        self.sampler.set_epoch(epoch)
        order = steps.extend([int(i) for i in self.sampler])
        W, m = steps.world_size, steps.micro_batch
        for step in range(start_step, steps.steps):
            indices, A = order[steps.positions(step)], steps.accumulation_of(step)
            if self.lengths is None:
                yield strided_plan(indices, W, m, A)
            else:
                yield balanced_plan(indices, [self.lengths[i] for i in indices], W, m, A, self.cost)

    def epoch(self, epoch: int, start_sample: int = 0) -> Iterator[dict]:
        """The batches of ``epoch`` on this rank, from global position ``start_sample`` on.

        Raises:
            ValueError: ``start_sample`` off a step boundary or past the epoch, or a negative ``epoch``.
        """
        import torch
        from torch.utils.data import DataLoader

        if epoch < 0:
            raise ValueError(f"epoch={epoch}: must be >= 0.")
        layout = self.layout
        if start_sample % layout.effective_batch or not 0 <= start_sample <= self.steps.steps * layout.effective_batch:
            raise ValueError(
                f"start_sample={start_sample}: a resume position must be a multiple of the effective batch "
                f"({layout.effective_batch}) within the epoch's {self.steps.steps} steps of "
                f"{layout.effective_batch} samples ({layout.train_samples} samples, {self.steps.left_out} left out)."
            )
        batches = [b for plan in self.plans(epoch, start_sample // layout.effective_batch) for b in plan[self.rank]]
        # A private generator: the global RNG would shift dropout masks in a resumed run.
        generator = torch.Generator().manual_seed(self.sampler.seed + epoch)
        loader = DataLoader(
            self.dataset,
            batch_sampler=batches,
            collate_fn=self.collate_fn,
            num_workers=0,
            generator=generator,
            pin_memory=self.pin_memory,
        )
        return iter(loader)


def sample_lengths(dataset) -> list[int]:
    """Tokens of every sample, read once."""
    if hasattr(dataset, "column_names"):
        return [len(ids) for ids in dataset["input_ids"]]
    return [len(dataset[i]["input_ids"]) for i in range(len(dataset))]


class StepBatchSampler:
    """Every rank's micro-batches, interleaved for Accelerate's ``BatchSamplerShard``.

    That shard deals batch ``i`` to rank ``i % world_size``. So each Trainer rank reads what ``loader.epoch``
    gives it, and the Trainer's resume skips whole steps.

    Args:
        loader (EpochLoader): the plans.
    """

    def __init__(self, loader: EpochLoader) -> None:
        self.loader = loader
        self.batch_size, self.drop_last = loader.micro_batch, True  # read by BatchSamplerShard
        self.epoch = 0
        self._order: tuple[int, list[int]] | None = None

    def step_samples(self, step: int) -> list[int]:
        """Every rank's samples of optimizer step ``step``, counted from the run's start."""
        layout, steps = self.loader.layout, self.loader.steps
        epoch, within = divmod(step, steps.steps)
        if self._order is None or self._order[0] != epoch:
            shuffle = self.loader.sampler.shuffle
            self._order = (epoch, steps.extend(global_order(layout.train_samples, layout.seed, epoch, shuffle)))
        return self._order[1][steps.positions(within)]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.loader) * self.loader.layout.world_size

    def __iter__(self) -> Iterator[list[int]]:
        for plan in self.loader.plans(self.epoch):
            for k in range(len(plan[0])):  # the last step's may be shorter
                for rank in range(len(plan)):
                    yield plan[rank][k]


def describe_epoch(layout: DataLayout, steps: EpochSteps | None = None) -> str:
    """One line: the epoch's steps and any samples left out.

    Args:
        layout (DataLayout): the run's data layout.
        steps (EpochSteps | None): the epoch's steps. Default: the plain loop's
    """
    if steps is None:
        steps = EpochSteps(layout.train_samples, layout.world_size, layout.micro_batch, layout.accumulation)
    line = f"an epoch is {steps.steps} optimizer steps of {layout.effective_batch} samples"
    if steps.left_out:
        line += (
            f": the last {steps.left_out} of the {layout.train_samples} training samples in each epoch's shuffled "
            "order are left out (a different few every epoch), so every world size trains the same whole steps "
            "and no sample twice in an epoch"
        )
    return line
