"""TRL's ``SFTTrainer`` with BucketedDDP; the only module of ddp_ft that imports trl.

TRL gathers four metrics on every micro-step. Here they ride on the step's one all-gather instead.
The logged values stay TRL's.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from torch.utils.data import IterableDataset
from trl import SFTConfig, SFTTrainer

from .accelerate import BucketedAccelerator
from .trainer import BucketedTrainer

logger = logging.getLogger(__name__)

__all__ = ["BucketedSFTTrainer", "SFTConfig"]  # re-exported: the recipe imports no trl

# What TRL's compute_loss (trl 1.16) gathers per micro-step, in order.
_METRICS = ("num_valid", "entropy_sum", "num_correct", "num_tokens")


class _MetricsAccelerator(BucketedAccelerator):
    """``BucketedAccelerator`` that can keep metrics on this rank instead of gathering them."""

    _kept: list[torch.Tensor] | None = None

    @contextmanager
    def metrics_kept(self, kept: list[torch.Tensor]):
        """Within the block, ``gather_for_metrics(x)`` appends ``x`` to ``kept`` and returns it."""
        self._kept = kept
        try:
            yield
        finally:
            self._kept = None

    def ranks_kept(self) -> int:
        """How many leading ranks' values ``gather_for_metrics`` keeps, fewer on a padded last batch."""
        state = self.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            return min(state.remainder, self.num_processes)
        return self.num_processes

    def gather_for_metrics(self, input_data, use_gather_object=False):
        if self._kept is None:
            return super().gather_for_metrics(input_data, use_gather_object=use_gather_object)
        self._kept.append(input_data.detach())
        return input_data


class BucketedSFTTrainer(BucketedTrainer, SFTTrainer):
    """``trl.SFTTrainer`` that trains multi-process runs with BucketedDDP.

    Nothing is gathered on ``no_sync`` micro-steps; the logged metrics match stock ``SFTTrainer``.

    Args:
        *args: passed to ``SFTTrainer``.
        balance_ranks (bool | None): train on the balanced plan (see ``BucketedTrainer``).
            Default: None, True unless ``train_dataset`` is iterable.
        **kwargs: passed to ``BucketedTrainer`` and ``SFTTrainer``.

    Raises:
        ValueError: ``balance_ranks=True`` with an iterable ``train_dataset``.

    Example:
        >>> trainer = BucketedSFTTrainer(model=model, args=SFTConfig(...), train_dataset=rows, peft_config=lora)
        >>> trainer.train()
    """

    accelerator_class = _MetricsAccelerator

    def __init__(self, *args, balance_ranks: bool | None = None, **kwargs) -> None:
        dataset = kwargs.get("train_dataset", args[3] if len(args) > 3 else None)
        iterable = isinstance(dataset, IterableDataset) or (dataset is not None and not hasattr(dataset, "__len__"))
        if balance_ranks and iterable:
            raise ValueError(
                "BucketedSFTTrainer: balance_ranks=True with an iterable train_dataset: the balanced plan needs every "
                "row of the epoch up front. Pass a map-style dataset, or balance_ranks=False (or leave it unset)."
            )
        self._micro_metrics: list[torch.Tensor] = []
        self._metric_dtypes: list[torch.dtype] = []
        super().__init__(*args, balance_ranks=not iterable if balance_ranks is None else balance_ranks, **kwargs)

    def _planned_token_counts(self, dataset):
        """Each row's answer tokens from the labels TRL's collator makes."""
        from ..training.data.step_tokens import (
            StepTokenCounts,  # the plugin imports no data pipeline until it trains
        )

        answers = []
        for row in dataset:
            labels = self.data_collator([row])["labels"]
            answers.append(int((labels[..., 1:] != -100).sum()))
        return StepTokenCounts(dataset, answers=answers)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss, keeping its metrics on this rank for the step's all-gather."""
        if not (self.model.training and self.args.world_size > 1) or self.aux_loss_enabled:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        metrics = self._metrics["train"]
        logged = {key: len(values) for key, values in metrics.items()}
        total_tokens = self._total_train_tokens
        kept: list[torch.Tensor] = []
        with self.accelerator.metrics_kept(kept):
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if len(kept) != len(_METRICS):
            raise RuntimeError(
                f"BucketedSFTTrainer: SFTTrainer.compute_loss gathered {len(kept)} values for its metrics, expected "
                f"{len(_METRICS)} ({', '.join(_METRICS)}, as in trl 1.16): this trl version is not supported."
            )
        # Undo TRL's local metrics: the step's gather brings every rank's.
        for key, values in metrics.items():
            del values[logged.get(key, 0) :]
        self._total_train_tokens = total_tokens
        metrics["num_tokens"] = [total_tokens]
        self._metric_dtypes = [value.dtype for value in kept]
        # Stock keeps a padded last batch's leading ranks; the plan spreads repeats over all.
        ranks = self.accelerator.ranks_kept() if self._plan_sampler is None else self.args.world_size
        ranks = torch.tensor(float(ranks), dtype=torch.float64, device=kept[0].device)
        self._micro_metrics.append(torch.stack([value.reshape(()).to(torch.float64) for value in kept] + [ranks]))
        return result

    def _step_values(self) -> torch.Tensor | None:
        if not self._micro_metrics:
            return None
        values = torch.stack(self._micro_metrics)
        self._micro_metrics = []
        return values

    def _read_step_values(self, per_rank: list[list[float]]) -> None:
        """Rebuilds TRL's per-micro-step metrics from every rank's values."""
        metrics, width = self._metrics["train"], len(_METRICS) + 1
        for start in range(0, len(per_rank[0]), width):
            kept = per_rank[: int(per_rank[0][start + len(_METRICS)])]
            num_valid, entropy_sum, num_correct, num_tokens = (
                torch.tensor([row[start + i] for row in kept], dtype=dtype).sum()
                for i, dtype in enumerate(self._metric_dtypes)
            )
            metrics["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
            metrics["mean_token_accuracy"].append((num_correct / num_valid).item() if num_valid > 0 else 0.0)
            self._total_train_tokens += num_tokens.item() // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
