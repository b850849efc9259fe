"""BucketedTrainer's ``backward`` records, which ``ddp-ft forecast`` reads: one per optimizer step, from a recorder
on one process (training unchanged, its hooks gone after ``train()``) and from BucketedDDP itself on two."""

import tempfile
from pathlib import Path

import pytest
import torch

from ddp_ft.integrations import BucketedTrainer, ThroughputCallback
from ddp_ft.report.metrics import read_jsonl

from ..helpers.dist_harness import run_distributed
from ..helpers.trainers import Regressor, as_accelerate_rank, gloo_trainer_args, regression_rows

STEPS = 4


def _train(out: Path, recording: bool = True, **arguments):
    """``STEPS`` optimizer steps of 2 micro-steps, logged every 2 steps; the model, its logs and records."""
    torch.manual_seed(0)
    model = Regressor()
    args = gloo_trainer_args(
        str(out),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=0.1,
        **{"logging_steps": 2, **arguments},
    )
    trainer = BucketedTrainer(model=model, args=args, train_dataset=regression_rows())
    if not recording:  # the callback as a stock trainer gets it: no recorder
        trainer.pop_callback(ThroughputCallback)
        trainer.add_callback(ThroughputCallback())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    written = out / "metrics.jsonl"  # rank 0's
    return model, losses, read_jsonl(written) if written.exists() else []


def _of_type(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r["type"] == kind]


def test_one_process_records_each_step_alike(tmp_path):
    """Every step's buckets as the loop records them; the losses and weights equal a run without the recorder."""
    model, losses, records = _train(tmp_path / "recorded", ddp_backend=None)
    plain, plain_losses, plain_records = _train(tmp_path / "plain", recording=False, ddp_backend=None)
    assert losses == plain_losses and len(losses) == STEPS // 2
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))
    backward = _of_type(records, "backward")
    assert [r["step"] for r in backward] == [1, 2, 3, 4] and not _of_type(plain_records, "backward")
    trainable = sum(4 * p.numel() for p in model.parameters() if p.requires_grad)  # float32, one bucket
    for record in backward:
        assert record["bucket_bytes"] == [trainable]
        assert 0 < record["bucket_ready_ms"][0] <= record["backward_ms"] and record["forward_ms"] > 0
    trains = _of_type(records, "train")  # each averages 2 steps; its tokens sum them
    assert [(r["step"], r["logged_steps"]) for r in trains] == [(2, 2), (4, 2)]
    assert not model._forward_hooks and not model._forward_pre_hooks, "the recorder's hooks outlived train()"
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


def _two_process_records(rank, world_size):
    as_accelerate_rank(rank, world_size)
    with tempfile.TemporaryDirectory() as out:
        _, _, records = _train(Path(out))
    return [(r["step"], len(r["bucket_bytes"])) for r in _of_type(records, "backward")]


@pytest.mark.distributed
def test_two_processes_record_bucketed_ddp_s_buckets():
    """As the loop does, rank 0 writes BucketedDDP's own timeline of each step; the other rank writes nothing."""
    first, second = run_distributed(_two_process_records, timeout=180)
    assert first == [(step, 1) for step in range(1, STEPS + 1)] and second == []
