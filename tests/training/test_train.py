"""The training loop's guarantees, in process: effective batch across world sizes, errors before training."""

import json

import pytest
import torch
from torch.testing import assert_close

from ddp_ft.distributed import DistInfo
from ddp_ft.training.config import settings_from_preset
from ddp_ft.training.data import IGNORE_INDEX
from ddp_ft.training.loop import train

from ..helpers.dist_harness import run_distributed
from ..helpers.meetings import write_mixed_length_meetings
from ..helpers.trainers import record_collectives

MICRO = 2


def _setup(world_size, rank, cache, source):
    """Tiny model and tokenizer as the tiny preset builds them, on ``source``; LoRA dropout off for exact comparison."""
    import os

    from transformers import DataCollatorForSeq2Seq

    from ddp_ft.training.data import load_raw_splits, tokenize_dataset
    from ddp_ft.training.data.tokenizer import load_tokenizer
    from ddp_ft.training.model.qlora import ModelSettings, load_qlora_model
    from ddp_ft.training.setup import resolve_model_and_tokenizer

    os.environ["DDP_FT_CACHE"] = cache
    settings = settings_from_preset("tiny", lora_dropout=0.0, source=source)
    info = DistInfo(rank=rank, local_rank=rank, world_size=world_size)
    model_path, tokenizer_path = resolve_model_and_tokenizer(settings.model.model_name_or_path, info)
    tokenizer = load_tokenizer(tokenizer_path)
    data, _ = tokenize_dataset(load_raw_splits(settings.data)["train"], tokenizer, settings.data)
    collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    torch.manual_seed(0)
    model = load_qlora_model(ModelSettings(model_name_or_path=model_path), settings.lora, {"": "cpu"}, world_size)
    with torch.no_grad():  # LoRA B starts at zero; make every LoRA weight receive a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return model, data, collate, settings.train.seed


def _effective_batch(rank, world_size, cache, source, k):
    from itertools import islice

    from ddp_ft.ddp import BucketedDDP
    from ddp_ft.training.data import EpochLoader, strided_plan
    from ddp_ft.training.steps import forward_backward

    model, data, collate, seed = _setup(world_size, rank, cache, source)
    single, _, _, _ = _setup(world_size, rank, cache, source)
    # two processes, accumulation k each, balanced ranks (the default): the step's samples regrouped by length
    ddp = BucketedDDP(model)
    balanced = EpochLoader(data, collate, MICRO, rank, world_size, seed, effective_batch=world_size * k * MICRO)
    unbalanced = EpochLoader(data, collate, MICRO, 0, 1, seed, effective_batch=world_size * k * MICRO, balance=False)
    plan, strided = next(balanced.plans(0)), next(unbalanced.plans(0))
    step = [i for batch in strided[0] for i in batch]  # the step's samples in global order
    assert plan != strided_plan(step, world_size, MICRO, k), "the premise: balancing moved samples between ranks"
    group = list(islice(balanced.epoch(0), k))
    calls: list[str] = []  # every torch.distributed collective this rank calls, and each micro-step's forward
    record_collectives(calls)
    model.register_forward_pre_hook(lambda *_: calls.append("forward"))
    ddp_loss, ddp_counts = forward_backward(ddp, group, DistInfo(rank, rank, world_size))
    comm = ddp.pop_comm_stats()
    micro_steps = " ".join(calls).split("forward")  # [before the first forward, after each micro-step's forward]
    # one process, accumulation 2k, on the same global batch in its global order, unbalanced (on every rank, no
    # communication)
    loader = unbalanced
    group = list(islice(loader.epoch(0), world_size * k))
    single_loss, single_counts = forward_backward(single, group, DistInfo())

    # the step's samples, counted from the dataset itself: answer tokens carry loss, padding is no token
    step_samples = list(loader.sampler)[: world_size * k * MICRO]
    answer_tokens = sum(sum(label != IGNORE_INDEX for label in data[i]["labels"]) for i in step_samples)
    input_tokens = sum(len(data[i]["input_ids"]) for i in step_samples)
    padded = sum(b["input_ids"].numel() for b in group)
    assert padded > input_tokens, "the premise: these micro-batches carry padding"
    assert ddp_counts.tolist() == single_counts.tolist() == [answer_tokens, input_tokens]

    # measured: loss within 2e-8 relative, gradients within 7e-7 of the largest (summation order only)
    assert ddp_loss.item() == pytest.approx(single_loss.item(), rel=1e-7)
    for (name, p), q in zip(model.named_parameters(), single.parameters(), strict=True):
        if p.requires_grad:
            assert_close(p.grad, q.grad, rtol=0, atol=5e-6 * q.grad.abs().max().item(), msg=name)
    # no_sync on every micro-step but the last: one all-reduce per bucket for the whole step
    assert len(ddp.bucket_sizes) > 1
    assert (comm.backwards, comm.synced_backwards, comm.allreduce_calls) == (k, 1, len(ddp.bucket_sizes))
    # and no other collective either, counted at torch.distributed: the token counts before the step, nothing at all
    # in the no_sync micro-steps, then the buckets' all-reduces and the gather of losses and stop flags
    assert len(micro_steps) == k + 1 and micro_steps[0].split() == ["all_reduce"], calls
    assert all(not m.strip() for m in micro_steps[1:-1]), calls
    assert micro_steps[-1].split() == ["all_reduce"] * len(ddp.bucket_sizes) + ["all_gather"], calls
    return ddp_loss


@pytest.mark.distributed
@pytest.mark.slow
def test_2_ranks_x_k_steps_equal_1_rank_x_2k(tmp_path):
    """The effective-batch guarantee on micro-batches with padding and uneven answer lengths: same token counts
    (non-padding, from the dataset), same loss and gradients as one process on the global batch, and only the last
    micro-step communicates. The two ranks split the step by ``balanced_plan``, the one process reads it unbalanced
    in global order: the step's samples, not their split, fix the gradient."""
    source = write_mixed_length_meetings(tmp_path / "mixed.jsonl")
    losses = run_distributed(_effective_batch, str(tmp_path), source, 2, timeout=300)
    assert losses[0] == losses[1]


def _predict_as_peers_leave(rank, world_size, out, cache):
    """Train 2 ranks with ``--predict``; rank 0 generates only once rank 1 has finished ``train``."""
    import os
    import time
    from pathlib import Path

    from ddp_ft.training import loop

    os.environ["DDP_FT_CACHE"] = cache
    left = Path(out) / "rank-1-left"
    if rank == 0:
        generate = loop.predict_rows

        def after_rank_1(*args, **kwargs):
            deadline = time.monotonic() + 60
            while not left.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("rank 1 still waits in a collective while rank 0 predicts")
                time.sleep(0.1)
            return generate(*args, **kwargs)

        loop.predict_rows = after_rank_1
    values = {"max_steps": 2, "effective_batch": 2, "micro_batch": 1, "num_synthetic": 16, "max_seq_len": 128}
    values |= {"save_every": 0, "report_to": "none", "eval_fraction": 0.125, "predict": 1, "max_new_tokens": 2}
    settings = settings_from_preset("tiny", output_dir=str(Path(out) / "run"), **values)
    steps = train(settings, DistInfo(rank=rank, local_rank=rank, world_size=world_size, backend="gloo")).steps
    if rank == 1:
        left.touch()
    return steps


@pytest.mark.distributed
def test_rank_0_predicts_after_the_others_are_done(tmp_path, tiny_cache):
    """``--predict`` runs on rank 0 after the last collective: the other ranks never wait for generation, which
    would outlast the process group's timeout on a long ``--predict``."""
    steps = run_distributed(_predict_as_peers_leave, str(tmp_path), tiny_cache, timeout=240)
    assert steps == [2, 2] and (tmp_path / "run" / "predictions.jsonl").exists()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _train_tiny(tmp_path, monkeypatch, **overrides):
    monkeypatch.setenv("DDP_FT_CACHE", str(tmp_path / "cache"))
    settings = settings_from_preset("tiny", output_dir=str(tmp_path / "run"), **overrides)
    return train(settings, DistInfo())


def _assert_nothing_trained(tmp_path):
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not list((tmp_path / "run").glob("*checkpoint-*"))


def test_missing_column_fails_before_training(tmp_path, monkeypatch):
    source = _write_jsonl(tmp_path / "meetings.jsonl", [{"transcript": "a b c", "summary": "d"}] * 20)
    with pytest.raises(ValueError) as error:
        _train_tiny(tmp_path, monkeypatch, source=source)
    assert "dialogue" in str(error.value) and "dialogue-column" in str(error.value).replace("_", "-")
    _assert_nothing_trained(tmp_path)


def test_empty_dataset_fails_before_training(tmp_path, monkeypatch):
    source = tmp_path / "empty.jsonl"
    source.write_text("")
    with pytest.raises(ValueError, match="empty|no samples|0 samples"):
        _train_tiny(tmp_path, monkeypatch, source=str(source))
    _assert_nothing_trained(tmp_path)


def test_indivisible_effective_batch_fails_before_load(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="effective_batch=7"):
        _train_tiny(tmp_path, monkeypatch, effective_batch=7, micro_batch=2)
    assert not (tmp_path / "cache").exists()


def test_seq_len_too_small_for_any_answer_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="max_seq_len"):
        _train_tiny(tmp_path, monkeypatch, max_seq_len=8)
    _assert_nothing_trained(tmp_path)


def test_fewer_samples_than_one_batch_is_refused(tmp_path, monkeypatch):
    rows = [{"dialogue": f"meeting {i} talk", "summary": f"summary {i}"} for i in range(6)]
    source = _write_jsonl(tmp_path / "few.jsonl", rows)
    with pytest.raises(ValueError, match="effective batch"):
        _train_tiny(tmp_path, monkeypatch, source=source, eval_fraction=0.2)
    _assert_nothing_trained(tmp_path)


def test_device_map_auto_under_ddp_fails_before_load(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_FT_CACHE", str(tmp_path / "cache"))
    settings = settings_from_preset("tiny", output_dir=str(tmp_path / "run"), device_map="auto")
    with pytest.raises(ValueError, match=r"device_map='auto'.*device_map=\{'': local_rank\}"):
        train(settings, DistInfo(rank=0, local_rank=0, world_size=2))
    assert not (tmp_path / "cache").exists()


def test_resume_with_another_batch_fails_early(tmp_path, monkeypatch):
    """The data position is a place in the epoch's global order counted in steps of the effective batch: another
    effective batch cannot continue it exactly, so the run stops before step 1 and says which layouts differ."""
    first = _train_tiny(tmp_path, monkeypatch, effective_batch=4, max_steps=1, save_every=0, report_to="none")
    again = tmp_path / "again"
    settings = settings_from_preset("tiny", output_dir=str(again), resume=first.checkpoint, report_to="none")
    with pytest.raises(ValueError) as error:
        train(settings, DistInfo())
    message = str(error.value)
    assert first.checkpoint in message, message
    assert "effective batch 4 = 1 rank x micro-batch 2 x accumulation 2" in message
    assert "effective batch 8 = 1 rank x micro-batch 2 x accumulation 4" in message
    assert "--effective-batch 4" in message
    assert not (again / "metrics.jsonl").exists()


def test_evaluation_leaves_4bit_training_unchanged(tmp_path, monkeypatch):
    """4-bit training with an evaluation after every step: each step's loss and gradient norm equal those of the
    run that never evaluates. On CPUs with AVX-512 bf16 bitsandbytes repacks 4-bit weights for inference at the
    first evaluation, and training on the repacked weights computed wrong gradients."""
    runs = {}
    for every in (0, 1):
        runs[every] = _train_tiny(tmp_path / str(every), monkeypatch, eval_every=every, max_steps=3, report_to="none")
    rows = {
        every: [json.loads(line) for line in (tmp_path / str(every) / "run" / "metrics.jsonl").open()] for every in runs
    }
    steps = {every: [(r["loss"], r["grad_norm"]) for r in rows[every] if r["type"] == "train"] for every in rows}
    assert len([r for r in rows[1] if r["type"] == "eval"]) >= 2  # between steps, before steps 2 and 3
    assert_close(torch.tensor(steps[1]), torch.tensor(steps[0]), rtol=1e-6, atol=0.0)


def test_eval_without_autograd_restores_train_mode():
    """The loop's evaluate records no graph (no activations kept for a backward that never comes: on a GPU that is
    the eval's memory several times over); c7075c5 dropped its ``torch.no_grad()`` and eval losses moved by 6e-5."""
    from ddp_ft.training.steps import evaluate

    seen = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(()))

        def forward(self, input_ids, labels, num_items_in_batch):
            seen.append((torch.is_grad_enabled(), self.training))
            return type("Out", (), {"loss": self.weight * (labels != IGNORE_INDEX).sum()})()

    model = Probe().train()
    rows = [{"input_ids": [1, 2, 3], "labels": [IGNORE_INDEX, 2, 3]}] * 3

    def collate(batch):
        return {k: torch.tensor([r[k] for r in batch]) for k in ("input_ids", "labels")}

    assert evaluate(model, rows, collate, micro_batch=2, info=DistInfo()) == 1.0  # summed token loss / tokens
    assert seen == [(False, False), (False, False)] and model.training
