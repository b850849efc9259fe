"""``BucketedTrainer``'s data plan: the plain loop's rank-balanced micro-batches, and the step's answer tokens
counted from them with no collective (``balance_ranks=True``; see ``ddp_ft.training.data.balance``).

A mixin of :class:`~ddp_ft.integrations.trainer.BucketedTrainer`, which sets the attributes it reads
(``balance_ranks``, ``_plan_sampler``, ``_answer_counts``, ``_planned_answers``) and checks the planned count in the
step's one all-gather.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import TrainerCallback

from .trainer_rows import can_cost, row_lengths, uncostable_reason

if TYPE_CHECKING:
    from ..training.data import StepBatchSampler


class PlanEpochCallback(TrainerCallback):
    """Sets the epoch of the balanced plan before each epoch's batches are drawn. ``Trainer`` calls ``set_epoch``
    too, but not through the loader ``skip_first_batches`` builds on a resume mid-epoch on several ranks (its batch
    sampler wraps Accelerate's shard, which wraps ours); the epoch is ``global_step // steps`` (the Trainer's
    ``num_update_steps_per_epoch``), as the Trainer counts the epochs it resumes past."""

    def __init__(self, trainer: PlannedData) -> None:
        self._trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        sampler = self._trainer._plan_sampler
        if sampler is not None:
            sampler.set_epoch(state.global_step // sampler.loader.steps.steps)


class PlannedData:
    """The Trainer's training loader and loss divisor, from the balanced plan when ``balance_ranks`` is on."""

    balance_ranks: bool
    _plan_sampler: StepBatchSampler | None
    _answer_counts: object | None
    _planned_answers: tuple[int, int, torch.Tensor] | None

    def get_train_dataloader(self):
        """With ``balance_ranks``, a loader over the plain loop's plans (``StepBatchSampler``), prepared by Accelerate:
        its shard hands rank ``r`` the micro-batches ``EpochLoader(rank=r)`` reads, and the Trainer's
        ``skip_first_batches`` skips whole steps on a resume. The epoch is the stock Trainer's
        (``EpochLoader(trainer_drop_last=args.dataloader_drop_last)``, ``ddp_ft.training.data.epoch_steps``): the same
        micro-batches per rank, optimizer steps (a shorter last one included) and learning-rate schedule, every sample
        trained unless ``dataloader_drop_last``, the same samples repeated to complete the last step (the first of
        the epoch's order, as Accelerate's shard repeats the first of its own). Otherwise the Trainer's own loader. A
        ``PackedCollator`` (``ddp_ft.training.data.packing``) is first checked against the model, whose attention must
        keep its rows' sequences apart, and the plan balances its packed tokens. Rows of TRL's DPO, reward and KTO
        collators have no ``input_ids``: the plan balances each row's padded width as the collator makes it
        (``ddp_ft.integrations.trainer_rows``: the wider of chosen and rejected for a pair).

        Raises:
            ValueError: a ``PackedCollator`` for a model whose attention would mix packed sequences; with
                ``balance_ranks``, a setting the plan cannot honour (:func:`check_plan_settings`). Before any step.
        """
        from ..training.data import PackedCollator  # here: the plugin imports no data pipeline until it trains

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
        lengths = row_lengths(dataset, self.data_collator)  # None: the plan reads input_ids
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
        """Each training row's answer tokens, for the loss divisor summed from the plan: from the rows' labels
        (``StepTokenCounts``), None when the rows have none (the Trainer then counts, with its all-gather)."""
        if not (len(dataset) and "labels" in dataset[0]):
            return None
        from ..training.data.step_tokens import StepTokenCounts

        return StepTokenCounts(dataset)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The step's loss-carrying tokens over all ranks, with no collective on a balanced run.

        With ``average_tokens_across_devices`` on several processes, the Trainer all-gathers each rank's count
        before every optimizer step: a collective, a host read, and a wait for the slowest rank before the step's
        compute starts. With ``balance_ranks`` every rank knows every sample of the step
        (``StepBatchSampler.step_samples``), so the count is summed from the training rows' labels
        (``StepTokenCounts``: labels other than -100 after the causal shift, the Trainer's rule for a causal LM),
        as the plain loop does. This rank's count by the Trainer's own rule, on the batches it drew, rides on the
        step's one all-gather (:meth:`_gather_step`), which stops the run before its optimizer step if the two
        differ (a collator that rewrites the labels, say). Elsewhere (no plan, rows without labels, a loss that
        does not shift the labels, one process, averaging off) it is the Trainer's own count.
        """
        counts, sampler = self._answer_counts, self._plan_sampler
        planned = (
            self.args.average_tokens_across_devices
            and self.args.world_size > 1
            and getattr(self, "_loss_shifts_labels", False)  # a causal LM's rule (transformers 5.23)
            and counts is not None
            and sampler is not None
        )
        if not planned:
            return super()._get_num_items_in_batch(batch_samples, device)
        self.args.average_tokens_across_devices = False
        try:
            local = super()._get_num_items_in_batch(batch_samples, device)  # this rank's batches, the Trainer's rule
        finally:
            self.args.average_tokens_across_devices = True
        if local is None:  # the Trainer passes no count to this model's loss
            return None
        step = self.state.global_step
        answers = counts.totals(sampler.step_samples(step))[0]
        self._planned_answers = (step + 1, answers, local)
        return torch.tensor(float(answers), device=device)  # the gathered int64 sum over 1, as the Trainer returns it


def check_plan_columns(dataset, trainer_name: str, collator=None) -> None:
    """Refuse ``balance_ranks`` for training rows the plan cannot cost.

    The plan balances each row's padded tokens: ``input_ids``, or for TRL's preference and reward trainers (DPO,
    KTO, reward) the width their collators give the row from its ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` or
    ``completion_ids`` (:func:`~ddp_ft.integrations.trainer_rows.row_lengths`). Other rows are refused: counting
    any other column would balance the wrong thing. A dataset that names no columns is left to the plan.

    Args:
        dataset: the training set, after the trainer prepared it.
        trainer_name (str): the trainer's class, for the message.
        collator: the trainer's ``data_collator``. Default: None (rows must have ``input_ids``)

    Raises:
        ValueError: naming ``balance_ranks``, the rows' columns, why, and the way out.
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
    """Refuse, before any step, what the balanced plan cannot honour as the stock Trainer would.

    The plan replaces the Trainer's sampler and deals whole micro-batches of ``per_device_train_batch_size``, the same
    number to every rank. So it cannot keep:

    - ``train_sampling_strategy`` other than ``random`` (``sequential``, ``group_by_length``, ``batch_rebalance``):
      the plan's order is a seeded shuffle, its micro-batches grouped by length within each step;
    - Accelerate's ``split_batches=True``: each batch would be split over the ranks again;
    - ``even_batches=False`` on an epoch whose batches do not fill every rank: stock then gives the ranks unequal or
      partial batches, where the plan completes them.

    Args:
        args (TrainingArguments): the Trainer's.
        accelerator: the Trainer's accelerator (its ``split_batches`` and ``even_batches``).
        train_samples (int): rows of the training set.

    Raises:
        ValueError: naming ``balance_ranks=False`` (``--no-balance-ranks``) and the setting.
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
