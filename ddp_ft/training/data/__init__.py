"""Rows as people keep them -> chat-formatted ids -> fitted, label-masked samples -> per-rank batches.

The pipeline, one module per stage:

* ``sources``: ``load_source`` (hub id, local file or folder (``folders``), or the embedded synthetic meetings; the
  format found from the columns (``formats``) and the rows in its standard shape, rows with nothing to learn
  dropped, an eval split found, given (``eval_source``) or held out);
* ``formatting``: ``tokenize_dataset`` (chat template, loss only on the answers: a pair cut by
  ``truncate_example``, a conversation fitted by ``conversation``, a text split into windows); ``prompts``: the
  same encoding cut before the last answer, to generate from;
* ``loader``: ``make_collator`` (right padding, labels padded with -100), the token counts, and ``EpochLoader`` (a
  ``DistributedSampler`` that cannot be iterated without choosing the epoch; the same steps on every world size, no
  sample twice; exact resume inside an epoch on any world size, see ``DataLayout``);
* ``epoch_steps``: ``EpochSteps`` (an epoch's optimizer steps: the plain loop's whole steps, or the stock Trainer's
  for ``dataloader_drop_last``, every sample trained and a shorter last step);
* ``balance``: ``balanced_plan`` (a step's samples split over ranks and micro-batches: similar lengths together,
  the same padded tokens on every rank, the step's samples unchanged);
* ``packing``: ``PackedCollator`` (a micro-batch's samples packed whole into rows without padding, kept apart by
  restarting ``position_ids``), ``packing_problem`` (models whose attention would mix them) and ``resolve_packing``.

``settings`` holds ``DataSettings`` and the constants the stages share.
"""

from .balance import balanced_plan, rank_costs, strided_plan
from .epoch_steps import EpochSteps
from .formatting import (
    TruncatedExample,
    TruncationReport,
    template_overhead,
    tokenize_dataset,
    truncate_example,
)
from .loader import (
    DataLayout,
    EpochLoader,
    StepBatchSampler,
    answer_tokens,
    check_resume,
    count_tokens,
    describe_epoch,
    make_collator,
    sample_lengths,
)
from .packing import PackedCollator, check_packed_model, pack_rows, packed_cost, packing_problem, resolve_packing
from .settings import (
    FILE_BUILDERS,
    IGNORE_INDEX,
    MIN_MAX_SEQ_LEN,
    SYNTHETIC,
    DataSettings,
)
from .sources import RawData, load_raw_splits, load_source, settings_from_record

__all__ = [
    "FILE_BUILDERS",
    "IGNORE_INDEX",
    "MIN_MAX_SEQ_LEN",
    "SYNTHETIC",
    "DataLayout",
    "DataSettings",
    "EpochLoader",
    "EpochSteps",
    "PackedCollator",
    "RawData",
    "StepBatchSampler",
    "TruncatedExample",
    "TruncationReport",
    "answer_tokens",
    "balanced_plan",
    "check_packed_model",
    "check_resume",
    "count_tokens",
    "describe_epoch",
    "load_raw_splits",
    "load_source",
    "make_collator",
    "pack_rows",
    "packed_cost",
    "packing_problem",
    "rank_costs",
    "resolve_packing",
    "sample_lengths",
    "settings_from_record",
    "strided_plan",
    "template_overhead",
    "tokenize_dataset",
    "truncate_example",
]
