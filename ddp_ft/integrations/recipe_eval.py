"""The recipe's evaluation over every held-out row.

The recipe trains with ``dataloader_drop_last=True``, which the Trainer also applies to evaluation.
The recipe's trainers keep every eval row; a user's ``BucketedTrainer`` keeps the stock behaviour.
"""

from __future__ import annotations

import functools


class EveryEvalRow:
    """A Trainer mixin whose eval loader keeps its short last batch.

    Accelerate pads the last batches with repeats, and ``gather_for_metrics`` drops them.
    """

    def get_eval_dataloader(self, eval_dataset=None):
        """The Trainer's eval loader, with ``drop_last=False``."""
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
    """``trainer_class`` with :class:`EveryEvalRow` mixed in first."""
    return type(f"Recipe{trainer_class.__name__}", (EveryEvalRow, trainer_class), {"__module__": __name__})
