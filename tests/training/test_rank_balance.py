"""Seeing the wait: each rank's compute per step gathered with the loss (the plain loop) or with the token count (the
Trainer), a slow rank's delay shown on the fast one."""

import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddp_ft.distributed import DistInfo
from ddp_ft.training.steps import rank_balance

from ..helpers.dist_harness import run_distributed
from ..helpers.trainers import TokenRegressor, as_accelerate_rank, gloo_trainer_args, padded_rows

DELAY_S = 0.3
BALANCE = ("compute_max_ms", "compute_min_ms", "imbalance", "wait_for_slowest_ms")


def test_imbalance_is_max_over_min_wait_max_minus_own():
    assert rank_balance([100.0, 150.0], rank=0) == {
        "compute_max_ms": 150.0,
        "compute_min_ms": 100.0,
        "imbalance": 1.5,
        "wait_for_slowest_ms": 50.0,
    }
    assert rank_balance([100.0, 150.0], rank=1)["wait_for_slowest_ms"] == 0.0
    assert rank_balance([0.0], rank=0)["imbalance"] == 1.0


class _SlowOnRank1(torch.nn.Module):
    """A model called as the loop calls a causal LM; rank 1 sleeps in every forward."""

    def __init__(self, rank):
        super().__init__()
        self.rank = rank
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, input_ids, labels, attention_mask, num_items_in_batch):
        if self.rank == 1:
            time.sleep(DELAY_S)
        out = self.linear(input_ids.float().unsqueeze(-1)).squeeze(-1)
        return SimpleNamespace(loss=((out - labels.float()) ** 2).sum() / num_items_in_batch)


def _slow_rank(rank, world_size):
    from ddp_ft.ddp import BucketedDDP
    from ddp_ft.training.steps import forward_backward_timed

    torch.manual_seed(0)
    ddp = BucketedDDP(_SlowOnRank1(rank))
    batch = {
        "input_ids": torch.ones(2, 4, dtype=torch.long),
        "labels": torch.ones(2, 4, dtype=torch.long),
        "attention_mask": torch.ones(2, 4, dtype=torch.long),
    }
    info = DistInfo(rank, rank, world_size)
    ddp.pop_comm_stats()
    outcome = forward_backward_timed(ddp, [batch, batch], info)
    exposed = ddp.pop_comm_stats().exposed_comm_ms
    return rank_balance(outcome.compute_ms.tolist(), rank), exposed, outcome.loss.item()


@pytest.mark.distributed
def test_slow_rank_shows_as_imbalance_and_fast_wait():
    fast, slow = run_distributed(_slow_rank)
    delay_ms = 2 * DELAY_S * 1e3  # two micro-batches, each forward sleeps on rank 1
    assert fast[0] == slow[0] | {"wait_for_slowest_ms": fast[0]["wait_for_slowest_ms"]}  # the same numbers
    assert fast[0]["imbalance"] > 1.5
    assert fast[0]["wait_for_slowest_ms"] == pytest.approx(delay_ms, rel=0.3)
    assert slow[0]["wait_for_slowest_ms"] == 0.0
    # the fast rank's wait is where it shows in the comm stats: the exposed wait after its last gradient
    assert fast[1] == pytest.approx(delay_ms, rel=0.3) and slow[1] < 0.5 * delay_ms
    assert fast[2] == slow[2]


class _TokensSlowOnRank1(TokenRegressor):
    """A model the Trainer counts tokens for; rank 1 sleeps in every forward."""

    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def forward(self, input_ids, attention_mask, x, y):
        if self.rank == 1:
            time.sleep(DELAY_S)
        return super().forward(input_ids, attention_mask, x, y)


def _slow_rank_trainer(rank, world_size):
    as_accelerate_rank(rank, world_size)
    from transformers import TrainerCallback

    from ddp_ft.integrations import BucketedTrainer
    from ddp_ft.report.metrics import read_jsonl

    logged = []

    class Logs(TrainerCallback):  # after ThroughputCallback, which BucketedTrainer puts first
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                logged.append(dict(logs))

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out:
        args = gloo_trainer_args(out, max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2)
        trainer = BucketedTrainer(
            model=_TokensSlowOnRank1(rank), args=args, train_dataset=padded_rows(), callbacks=[Logs()]
        )
        trainer.train()
        records = [r for r in read_jsonl(Path(out) / "metrics.jsonl") if r["type"] == "train"] if rank == 0 else []
    return logged, records


@pytest.mark.distributed
def test_trainer_shows_slow_rank_imbalance_each_step():
    """The Trainer path records the loop's balance fields, from the token count's all-gather after the step's last
    backward: every logged step, in the logs (wandb's ``train/``) and in rank 0's ``metrics.jsonl``."""
    (fast, records), (slow, _) = run_distributed(_slow_rank_trainer, timeout=180)
    delay_ms = 2 * DELAY_S * 1e3  # accumulation 2, each forward sleeps on rank 1
    assert [r["step"] for r in records] == [1, 2, 3]
    assert len(fast) == len(slow) == 3
    for record, f, s in zip(records, fast, slow, strict=True):
        assert {k: record.get(k) for k in BALANCE} == {k: f.get(k) for k in BALANCE}  # the record is rank 0's log
        assert f["compute_max_ms"] == s["compute_max_ms"] and f["compute_min_ms"] == s["compute_min_ms"]
        assert f["imbalance"] > 1.5
        assert f["wait_for_slowest_ms"] == pytest.approx(delay_ms, rel=0.3)
        assert s["wait_for_slowest_ms"] == 0.0
