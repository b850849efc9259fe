"""The recipe's evaluation over every held-out row, on each of its trainers (``ddp_ft.integrations.recipe``).

The recipe trains with ``dataloader_drop_last=True`` for whole steps, and the Trainer applies that flag to its eval
loader too: the short last batch would be dropped, and with fewer rows than one batch per rank, the whole eval set.
The recipe's trainers put :class:`EveryEvalRow` first in line instead, so a user's own ``TrainingArguments`` keep the
stock behaviour on ``BucketedTrainer``.
"""

from __future__ import annotations

import functools


class EveryEvalRow:
    """A Trainer mixin whose eval loader keeps its short last batch, whatever ``dataloader_drop_last`` says.

    The loader is the Trainer's otherwise: its eval sampler, batch size, collator and workers, prepared by Accelerate
    (as ``PlannedData`` builds the training loader). On several ranks
    Accelerate completes the last batches with repeated rows (``even_batches``), and ``gather_for_metrics`` drops
    them from the gathered losses (``tests/training/test_eval_uneven.py``).
    """

    def get_eval_dataloader(self, eval_dataset=None):
        """The Trainer's eval loader (``eval_dataset``: a dataset, a key of ``self.eval_dataset``, or None), with
        ``drop_last=False``."""
        from torch.utils.data import DataLoader

        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        dataset, args = self._remove_unused_columns(dataset, description="Evaluation"), self.args
        loader = DataLoader(
            dataset,
            batch_size=args.eval_batch_size,
            sampler=self._get_eval_sampler(dataset),
            collate_fn=self.data_collator,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            drop_last=False,
        )
        return self.accelerator.prepare(loader)


@functools.cache
def evaluating_every_row(trainer_class: type) -> type:
    """``trainer_class`` with :class:`EveryEvalRow` mixed in first, under the name ``Recipe<trainer_class>``."""
    return type(f"Recipe{trainer_class.__name__}", (EveryEvalRow, trainer_class), {"__module__": __name__})
