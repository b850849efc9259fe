"""A step's token counts from the tokenized samples, on every rank alike, without communication.

Every rank can draw the epoch's global order, and a step is a slice of it. So summing per-sample counts gives
the global numbers an all-reduce would.
"""

from __future__ import annotations

from .settings import IGNORE_INDEX


def global_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The epoch's global order of sample indices, the same on any world size."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(num_samples), num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


class StepTokenCounts:
    """Per-sample answer and input token counts, summed for any set of samples.

    Args:
        dataset: tokenized rows with ``input_ids`` and, unless ``answers`` is given, ``labels``.
        answers (list[int] | None): each row's answer tokens. Default: from the rows' labels
    """

    def __init__(self, dataset, answers: list[int] | None = None) -> None:
        if answers is None:
            answers = [sum(label != IGNORE_INDEX for label in row["labels"][1:]) for row in dataset]
        self._answers = answers
        self._inputs = [len(row["input_ids"]) for row in dataset]

    def totals(self, indices: list[int]) -> tuple[int, int]:
        """[answer tokens, input tokens] summed over ``indices``."""
        return sum(self._answers[i] for i in indices), sum(self._inputs[i] for i in indices)
