"""The Trainer path's step boundary on a balanced run: the bucket all-reduces and one all-gather per optimizer step,
also when it logs every step. The loss is still divided by the step's answer tokens over all ranks (counted from the
plan, checked against the batches), the log shows the ranks' mean loss, and a collator that rewrites the labels
stops the run before its first optimizer step. 2 real gloo processes, the HF Trainer in-process."""

import tempfile

import pytest
import torch

from ..helpers.dist_harness import run_distributed
from ..helpers.trainers import (
    CausalTokens,
    as_accelerate_rank,
    gloo_trainer_args,
    labelled_rows,
    record_collectives,
)

pytestmark = pytest.mark.distributed

STEPS, ACCUMULATION = 3, 2


def _train(rank, world_size, rewrite_labels):
    as_accelerate_rank(rank, world_size)
    from transformers import TrainerCallback, default_data_collator

    from ddp_ft.integrations import BucketedTrainer

    log: list[str] = []
    record_collectives(log)

    class Marker(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            log.append("step_end")

    def collate(rows):
        batch = default_data_collator(rows)
        if rewrite_labels:
            batch["labels"][:, 2] = -100  # the first answer token of every row that has one
        return batch

    torch.manual_seed(0)
    model = CausalTokens()
    before = [p.detach().clone() for p in model.parameters()]
    with tempfile.TemporaryDirectory() as out:
        args = gloo_trainer_args(
            out,
            max_steps=STEPS,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=ACCUMULATION,
            learning_rate=0.1,
            average_tokens_across_devices=True,
        )
        trainer = BucketedTrainer(
            model=model,
            args=args,
            train_dataset=labelled_rows(),
            data_collator=collate,
            balance_ranks=True,
            callbacks=[Marker()],
        )
        if rewrite_labels:
            with pytest.raises(RuntimeError) as refused:
                trainer.train()
            unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            return str(refused.value), unchanged
        trainer.train()
        buckets = len(trainer.model_wrapped.bucket_sizes)
        logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return log, buckets, model.seen, logged


def test_balanced_step_one_collective_beside_buckets():
    """Between two step ends, with a log at every step: the buckets' all-reduces, then the step's one all-gather.
    The Trainer's own gathers are gone: the answer-token count before the step's compute (with
    ``average_tokens_across_devices``), the loss and the flos at every log."""
    for log, buckets, _, _ in run_distributed(_train, False, timeout=180):
        steps = " ".join(log).split("step_end")
        assert len(steps) == STEPS + 1
        for calls in steps[1:STEPS]:  # (before the first step: the setup's collectives)
            assert calls.split() == ["all_reduce"] * buckets + ["all_gather"], log


def test_divides_by_global_answer_tokens_logs_mean():
    """``num_items_in_batch`` on every micro-step of both ranks is the sum, over both ranks' micro-batches of that
    step, of their answer tokens (labels other than -100 after the shift): what the Trainer's all-gather gave. The
    logged loss of each step is the Trainer's: the mean over ranks of their summed micro-step losses, each scaled by
    the world size (``average_tokens_across_devices``), so the sum of every returned loss of the step."""
    results = run_distributed(_train, False, timeout=180)
    ranks = [seen for _, _, seen, _ in results]
    assert all(len(seen) == STEPS * ACCUMULATION for seen in ranks)
    for step in range(STEPS):
        micro = [entry for seen in ranks for entry in seen[step * ACCUMULATION : (step + 1) * ACCUMULATION]]
        total = sum(answers for answers, _, _ in micro)
        assert total > 0
        assert all(given == total for _, given, _ in micro), (step, micro)
        for _, _, _, logged in results:
            assert logged[step] == pytest.approx(sum(loss for _, _, loss in micro), rel=1e-6), (step, logged)


def test_label_rewriting_collator_stops_first_step():
    """The planned count comes from the rows' labels; a collator that changes them makes the batches disagree, which
    the step's all-gather finds: every rank raises, naming the fix, and no parameter has moved."""
    for message, unchanged in run_distributed(_train, True, timeout=180):
        assert "answer tokens" in message and "balance_ranks=False" in message, message
        assert unchanged


def test_flops_count_parameters_once_per_model(tmp_path, monkeypatch):
    """The Trainer counts every parameter on each micro-step for its flops, on the host between backward and optimizer
    step; the count is fixed, so it is read once. The estimate is the stock Trainer's."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer

    from ddp_ft.integrations import BucketedTrainer

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=8))
    counted = []
    count = model.num_parameters
    monkeypatch.setattr(model, "num_parameters", lambda **kw: counted.append(kw) or count(**kw))
    trainer = BucketedTrainer(model=model, args=gloo_trainer_args(str(tmp_path), ddp_backend=None))
    inputs = {"input_ids": torch.ones(2, 5, dtype=torch.long)}
    stock = Trainer.floating_point_ops(trainer, inputs)
    assert stock > 0 and len(counted) == 1
    assert [trainer.floating_point_ops(inputs) for _ in range(3)] == [stock] * 3
    assert len(counted) == 2
    assert trainer.floating_point_ops({"input_ids": torch.ones(4, 5, dtype=torch.long)}) == 2 * stock
    assert trainer.floating_point_ops({"inputs_embeds": torch.ones(2, 5, 16)}) == 0  # no main input: the stock rule
