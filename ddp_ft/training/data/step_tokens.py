"""A step's token counts from the tokenized samples, on every rank alike and without communication.

Every rank can see the whole step: the epoch's global order is a ``DistributedSampler`` permutation every rank can
draw, and a step is a slice of it (``DataLayout``). Summing the step's per-sample counts gives the same global
numbers the all-reduce of per-rank counts gave, whichever rank reads which sample of the step.
"""

from __future__ import annotations

from .settings import IGNORE_INDEX


def global_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The epoch's global order of sample indices: the permutation ``EpochLoader``'s sampler shards (its first
    ``floor(n / world_size) * world_size`` entries are what the ranks read, a prefix the same on any world size)."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(num_samples), num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


class StepTokenCounts:
    """Per-sample answer and input token counts of a tokenized dataset, summed for any set of samples.

    Answer tokens carry loss: labels other than ``IGNORE_INDEX`` after the causal shift (``labels[1:]``, as
    ``answer_tokens`` counts a right-padded batch). Input tokens: ``len(input_ids)`` (no padding).

    Args:
        dataset: a tokenized dataset whose rows have ``input_ids`` and, unless ``answers`` is given, ``labels``.
        answers (list[int] | None): each row's answer tokens, counted by the caller (e.g. on the row as a collator
            turns it into a batch, for a collator that sets the labels itself). Default: from the rows' labels.
    """

    def __init__(self, dataset, answers: list[int] | None = None) -> None:
        if answers is None:
            answers = [sum(label != IGNORE_INDEX for label in row["labels"][1:]) for row in dataset]
        self._answers = answers
        self._inputs = [len(row["input_ids"]) for row in dataset]

    def totals(self, indices: list[int]) -> tuple[int, int]:
        """[answer tokens, input tokens] summed over the samples ``indices``."""
        return sum(self._answers[i] for i in indices), sum(self._inputs[i] for i in indices)
