"""Rows as people keep them -> chat-formatted ids -> label-masked samples -> per-rank batches.

One module per stage:

* ``sources``: ``load_source``, from the hub, a file, a folder or the synthetic meetings;
* ``formats``: the format found from the columns, rows in a standard shape;
* ``formatting``, ``conversation``: ``tokenize_dataset``, loss only on answers;
* ``prompts``: the same encoding cut before the answer, to generate from;
* ``loader``, ``epoch_steps``: the collator and ``EpochLoader``, the same steps on any world size;
* ``balance``: a step's samples split evenly over ranks;
* ``packing``: samples packed into rows without padding;
* ``settings``: ``DataSettings`` and shared constants.
"""

from .balance import balanced_plan, batch_width, micro_batch_cost, rank_costs, strided_plan
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
    "batch_width",
    "check_packed_model",
    "check_resume",
    "count_tokens",
    "describe_epoch",
    "load_raw_splits",
    "load_source",
    "make_collator",
    "micro_batch_cost",
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
