"""TRL's ``SFTTrainer`` with BucketedDDP: ``BucketedSFTTrainer`` (the only module of ddp_ft that imports trl).

``BucketedSFTTrainer`` is ``BucketedTrainer`` mixed in before ``trl.SFTTrainer``: TRL prepares the data (prompt-
completion, conversational, packing), builds the PEFT model from ``peft_config`` (or takes a ready ``PeftModel``)
and computes the loss; the Trainer's accelerator is adopted so that the model trains wrapped in BucketedDDP.

What changes against stock ``SFTTrainer`` on several processes is where TRL's training metrics are summed. Its
``compute_loss`` all-gathers four numbers on every micro-step (the answer tokens, their summed entropy, the correct
top-1 predictions, the input tokens), ``no_sync`` micro-steps included. Here each micro-step keeps its numbers on
this rank, and they ride on ``BucketedTrainer``'s one all-gather per optimizer step (``_step_values``), from which
``entropy``, ``mean_token_accuracy`` and ``num_tokens`` are computed as TRL computes them: the same per-micro-step
values, the same sums over the same ranks in the same dtypes, so the same logs.
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

__all__ = ["BucketedSFTTrainer", "SFTConfig"]  # SFTConfig re-exported for the recipe, which imports no trl itself

# What TRL's compute_loss (trl 1.16) passes to gather_for_metrics on a training micro-step, in call order.
_METRICS = ("num_valid", "entropy_sum", "num_correct", "num_tokens")


class _MetricsAccelerator(BucketedAccelerator):
    """``BucketedAccelerator`` whose ``gather_for_metrics``, while :meth:`metrics_kept` is active, returns this rank's
    value and keeps it instead of gathering; everywhere else it gathers as usual."""

    _kept: list[torch.Tensor] | None = None

    @contextmanager
    def metrics_kept(self, kept: list[torch.Tensor]):
        """Within the block, ``gather_for_metrics(x)`` appends ``x`` (detached) to ``kept`` and returns it."""
        self._kept = kept
        try:
            yield
        finally:
            self._kept = None

    def ranks_kept(self) -> int:
        """How many leading ranks' values ``gather_for_metrics`` keeps now: all, but once the loader reached the
        end of an epoch whose last batches Accelerate pads with duplicates, ``GradientState.remainder`` at most."""
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

    Takes ``SFTTrainer``'s arguments (``model``, ``args`` as an ``SFTConfig``, ``train_dataset``, ``peft_config``...)
    and ``BucketedTrainer``'s (``ddp_settings``, ``balance_ranks``). Per optimizer step on several processes: the
    bucket all-reduces and one small all-gather after the last backward (plus, with ``balance_ranks=False``, the
    Trainer's all-gather of the step's answer-token count before its first forward); nothing on ``no_sync``
    micro-steps. The logged ``entropy``, ``mean_token_accuracy`` and ``num_tokens`` are stock ``SFTTrainer``'s with
    ``balance_ranks=False``, on an epoch's uneven last step too (only the ranks whose values stock's
    ``gather_for_metrics`` keeps are summed). The final ``train_loss`` is the ranks' mean, the same on every rank,
    where stock adds each rank's own loss since the last log (``BucketedTrainer._finalize_training``).

    Args:
        *args: passed to ``SFTTrainer``.
        balance_ranks (bool): split each optimizer step's rows over ranks and micro-batches by the plain loop's
            balanced plan (see ``BucketedTrainer``): the ranks wait less for each other on rows of mixed lengths, and
            every rank knows every row of the step, so the loss's divisor (the step's answer tokens) is summed from
            each row as TRL's collator makes it, with no collective; packed rows too. False: stock ``SFTTrainer``'s
            sample order (adapters bitwise those of stock with torch DDP), and the Trainer's count all-gather before
            every step. Default: None, True unless ``train_dataset`` is iterable (it has no plan: its own order).
        **kwargs: passed to ``BucketedTrainer`` and ``SFTTrainer``.

    Raises:
        ValueError: ``balance_ranks=True`` with an iterable ``train_dataset``, before the model loads.
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
        # This rank's _METRICS, then the ranks stock keeps, of each micro-step since the last gather.
        self._micro_metrics: list[torch.Tensor] = []
        self._metric_dtypes: list[torch.dtype] = []
        super().__init__(*args, balance_ranks=not iterable if balance_ranks is None else balance_ranks, **kwargs)

    def _planned_token_counts(self, dataset):
        """Each row's answer tokens as TRL's collator makes its labels (it may set them: the first token of each
        packed or flattened sequence is masked), counted by the Trainer's rule (after the causal shift). A collator
        whose labels depend on how rows share a batch would differ from the ranks' batches, and the step's check in
        the gather stops the run, naming ``balance_ranks=False``."""
        from ..training.data.step_tokens import (
            StepTokenCounts,  # here: the plugin imports no data pipeline until it trains
        )

        answers = []
        for row in dataset:
            labels = self.data_collator([row])["labels"]
            answers.append(int((labels[..., 1:] != -100).sum()))
        return StepTokenCounts(dataset, answers=answers)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss; on a multi-process training micro-step, its metrics are kept on this rank for the step's
        all-gather instead of being gathered now (an MoE model whose auxiliary loss TRL logs keeps TRL's gathers)."""
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
        # TRL logged this rank's own ratios and counted its own tokens: undone; the step's gather brings every rank's.
        for key, values in metrics.items():
            del values[logged.get(key, 0) :]
        self._total_train_tokens = total_tokens
        metrics["num_tokens"] = [total_tokens]
        self._metric_dtypes = [value.dtype for value in kept]
        # Stock keeps the leading ranks of a padded last batch. The balanced plan spreads its repeats: every rank.
        ranks = self.accelerator.ranks_kept() if self._plan_sampler is None else self.args.world_size
        ranks = torch.tensor(float(ranks), dtype=torch.float64, device=kept[0].device)
        self._micro_metrics.append(torch.stack([value.reshape(()).to(torch.float64) for value in kept] + [ranks]))
        return result

    def _step_values(self) -> torch.Tensor | None:
        if not self._micro_metrics:
            return None
        values = torch.stack(self._micro_metrics)  # [micro-steps, _METRICS]
        self._micro_metrics = []
        return values

    def _read_step_values(self, per_rank: list[list[float]]) -> None:
        """TRL's per-micro-step metrics from every rank's values: each micro-step's sums over the ranks stock's
        ``gather_for_metrics`` keeps (on an epoch's padded last step, the leading ones), taken in the dtypes TRL's own
        gather sums them in, then the ratios and token count TRL computes from them."""
        metrics, width = self._metrics["train"], len(_METRICS) + 1  # each micro-step's values, then its ranks kept
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
