"""``BucketedTrainer``'s data plan: rank-balanced micro-batches and planned answer-token counts.

A mixin of :class:`~ddp_ft.integrations.trainer.BucketedTrainer`, which sets the attributes it reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import TrainerCallback

from .trainer_rows import can_cost, row_lengths, uncostable_reason

if TYPE_CHECKING:
    from ..training.data import StepBatchSampler


class PlanEpochCallback(TrainerCallback):
    """Sets the balanced plan's epoch before each epoch's batches are drawn.

    The Trainer's ``set_epoch`` misses the loader ``skip_first_batches`` builds on a resume.
    """

    def __init__(self, trainer: PlannedData) -> None:
        self._trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        sampler = self._trainer._plan_sampler
        if sampler is not None:
            sampler.set_epoch(state.global_step // sampler.loader.steps.steps)


class PlannedData:
    """The Trainer's training loader and loss divisor, from the balanced plan."""

    balance_ranks: bool
    _plan_sampler: StepBatchSampler | None
    _answer_counts: object | None
    _planned_answers: tuple[int, int, torch.Tensor] | None

    def get_train_dataloader(self):
        """Builds the training loader, from the balanced plan when ``balance_ranks`` is on.

        The plan keeps the stock Trainer's micro-batches per rank, optimizer steps and schedule.
        A ``PackedCollator`` is first checked against the model's attention.

        Raises:
            ValueError: packing would mix sequences, or the plan cannot honour a setting.
        """
        from ..training.data import PackedCollator  # the plugin imports no data pipeline until it trains

        packed = isinstance(self.data_collator, PackedCollator)
        if packed:
            from ..training.data import check_packed_model

            check_packed_model(self.model)
        if not self.balance_ranks:
            return super().get_train_dataloader()
        from torch.utils.data import DataLoader

        from ..training.data import EpochLoader, StepBatchSampler

        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        args = self.args
        check_plan_columns(self.train_dataset, type(self).__name__, self.data_collator)
        dataset = self._remove_unused_columns(self.train_dataset, description="Training")
        lengths = row_lengths(dataset, self.data_collator)
        micro, world = args.per_device_train_batch_size, args.world_size
        check_plan_settings(args, self.accelerator, len(dataset))
        plans = EpochLoader(
            dataset,
            None,
            micro,
            0,
            world,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            effective_batch=micro * args.gradient_accumulation_steps * world,
            lengths=lengths,
            cost=self.data_collator.cost if packed else None,
            trainer_drop_last=args.dataloader_drop_last,
        )
        self._plan_sampler = StepBatchSampler(plans)
        self._answer_counts = self._planned_token_counts(dataset)
        loader = DataLoader(
            dataset,
            batch_sampler=self._plan_sampler,
            collate_fn=self.data_collator,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
        )
        return self.accelerator.prepare(loader)

    def _planned_token_counts(self, dataset):
        """Each row's answer tokens from its labels, or None without labels."""
        if not (len(dataset) and "labels" in dataset[0]):
            return None
        from ..training.data.step_tokens import StepTokenCounts

        return StepTokenCounts(dataset)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The step's loss-carrying tokens over all ranks, with no collective on a balanced run.

        Every rank knows the step's samples, so the count is summed from the rows' labels.
        The step's all-gather checks it against the Trainer's own count.
        """
        counts, sampler = self._answer_counts, self._plan_sampler
        planned = (
            self.args.average_tokens_across_devices
            and self.args.world_size > 1
            and getattr(self, "_loss_shifts_labels", False)
            and counts is not None
            and sampler is not None
        )
        if not planned:
            return super()._get_num_items_in_batch(batch_samples, device)
        self.args.average_tokens_across_devices = False
        try:
            local = super()._get_num_items_in_batch(batch_samples, device)
        finally:
            self.args.average_tokens_across_devices = True
        if local is None:
            return None
        step = self.state.global_step
        answers = counts.totals(sampler.step_samples(step))[0]
        self._planned_answers = (step + 1, answers, local)
        return torch.tensor(float(answers), device=device)


def check_plan_columns(dataset, trainer_name: str, collator=None) -> None:
    """Refuses ``balance_ranks`` for training rows the plan cannot cost.

    Args:
        dataset: the training set, as the trainer prepared it.
        trainer_name (str): the trainer's class, for the message.
        collator: the trainer's ``data_collator``. Default: None.

    Raises:
        ValueError: the rows have neither ``input_ids`` nor TRL's DPO, reward or KTO columns.
    """
    columns = getattr(dataset, "column_names", None)
    if columns is None or "input_ids" in columns or can_cost(dataset, collator):
        return
    raise ValueError(
        f"{trainer_name}: balance_ranks=True needs training rows whose tokens the balanced plan can count: "
        f"input_ids, or the rows of TRL's DPO, reward or KTO collator; these rows have {', '.join(columns)}, and "
        f"{uncostable_reason(dataset, collator)}. Pass balance_ranks=False (the default) for the stock Trainer's "
        "sampling."
    )


def check_plan_settings(args, accelerator, train_samples: int) -> None:
    """Refuses settings the balanced plan cannot honour, before any step.

    Args:
        args (TrainingArguments): the Trainer's.
        accelerator: the Trainer's accelerator.
        train_samples (int): rows of the training set.

    Raises:
        ValueError: a non-random sampling strategy, ``split_batches``, or uneven batches without ``even_batches``.
    """
    strategy = getattr(args, "train_sampling_strategy", "random")
    drop = ", or drop the setting."
    micro, world = args.per_device_train_batch_size, args.world_size
    uneven = not args.dataloader_drop_last and (train_samples % micro or -(-train_samples // micro) % world)
    if strategy != "random":
        setting = f"train_sampling_strategy={strategy!r}: the plan orders the samples itself (a seeded shuffle)"
    elif world > 1 and accelerator.split_batches:
        setting = "Accelerate's split_batches=True: the plan deals whole micro-batches to the ranks"
    elif world > 1 and not accelerator.even_batches and uneven:
        setting = (
            f"Accelerate's even_batches=False on {train_samples} rows in batches of {micro} on {world} ranks: stock "
            "gives the ranks unequal batches there, where the plan completes the last step with repeats"
        )
        drop = " (the Trainer never joins: where the ranks' batch counts differ that is refused too), keep "
        drop += "even_batches=True, or set dataloader_drop_last=True."
    else:
        return
    raise ValueError(
        f"balance_ranks=True cannot honour {setting}. Pass balance_ranks=False to the trainer (--no-balance-ranks "
        f"on ddp-ft / the recipe) for the stock Trainer's sampling{drop}"
    )
