"""A step's token counts without communication: the global order every rank can draw, summed per sample."""

from itertools import islice

import torch

from ddp_ft.training.data import EpochLoader, answer_tokens, count_tokens
from ddp_ft.training.data.step_tokens import StepTokenCounts, global_order


def _dataset(n=11):
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        length = 3 + int(torch.randint(0, 6, (1,), generator=g))
        labels = [-100] * (1 + i % 3) + list(range(length - 1 - i % 3))
        rows.append({"input_ids": list(range(length)), "labels": labels[:length]})
    return rows


def _collate(rows):
    width = max(len(r["input_ids"]) for r in rows)
    pad = [width - len(r["input_ids"]) for r in rows]
    return {
        "input_ids": torch.tensor([r["input_ids"] + [0] * p for r, p in zip(rows, pad, strict=True)]),
        "labels": torch.tensor([r["labels"] + [-100] * p for r, p in zip(rows, pad, strict=True)]),
        "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * p for r, p in zip(rows, pad, strict=True)]),
    }


def test_global_order_counts_equal_sum_of_rank_batches():
    data, world_size, micro, effective = _dataset(), 2, 1, 4
    counts = StepTokenCounts(data)
    for epoch in (0, 1):
        order = global_order(len(data), seed=7, epoch=epoch)
        loaders = [EpochLoader(data, _collate, micro, r, world_size, 7, effective_batch=effective) for r in (0, 1)]
        streams = [loader.epoch(epoch) for loader in loaders]
        for step in range(loaders[0].layout.steps_per_epoch):
            groups = [list(islice(s, effective // (world_size * micro))) for s in streams]
            batches = [b for g in groups for b in g]
            expected = (sum(answer_tokens(b) for b in batches), sum(count_tokens(b) for b in batches))
            assert counts.totals(order[step * effective : (step + 1) * effective]) == expected
