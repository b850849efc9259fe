"""BucketedSFTTrainer's logs against stock SFTTrainer with torch DDP on an epoch whose last step is uneven: 13 rows
over 2 ranks (2 rows per micro-batch, accumulation 2), ``dataloader_drop_last=False``, 2 epochs of 2 steps each.

Accelerate pads the epoch's last micro-batch with a duplicate row on rank 1. Once the loader reached its end (for
both micro-batches of the last step, which the Trainer draws up front), stock ``gather_for_metrics`` keeps the first
``GradientState.remainder`` ranks' values: TRL's metrics of that step count rank 0's batches only.
"""

import pytest

from ..helpers.dist_harness import run_distributed
from ..helpers.trl_runs import CASES, train

pytest.importorskip("trl")
pytestmark = pytest.mark.distributed

CASE = CASES[2]  # conversational rows, padded, a ready PeftModel, float32
UNEVEN = {"max_steps": -1, "num_train_epochs": 2, "dataloader_drop_last": False, "gradient_accumulation_steps": 2}
N_ROWS = 13  # 3 full micro-batches over the ranks, then 1 row: a remainder on each epoch's last step
STEPS = 4


def _train_uneven(rank: int, world_size: int, paths: tuple[str, str]) -> dict:
    from ..helpers.trainers import as_accelerate_rank

    as_accelerate_rank(rank, world_size)
    from trl import SFTTrainer

    from ddp_ft.integrations import BucketedSFTTrainer

    runs = {}
    for logging_steps in (1, 100):
        config = {**UNEVEN, "logging_steps": logging_steps}
        for name, cls, kw in (("ours", BucketedSFTTrainer, {"balance_ranks": False}), ("stock", SFTTrainer, {})):
            runs[name, logging_steps] = train(cls, paths, CASE, world_size, n_rows=N_ROWS, config=config, **kw)
    config = {**UNEVEN, "logging_steps": 1}
    runs["balanced", 1] = train(BucketedSFTTrainer, paths, CASE, world_size, n_rows=N_ROWS, config=config)
    return runs


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    from ddp_ft.training.data.tokenizer import build_tiny_tokenizer, load_tokenizer
    from ddp_ft.training.model.qlora import build_tiny_qwen3

    root = tmp_path_factory.mktemp("trl_uneven")
    tokenizer = build_tiny_tokenizer(root / "tokenizer")
    model = build_tiny_qwen3(root / "qwen3", vocab_size=len(load_tokenizer(str(tokenizer))), seed=0)
    return run_distributed(_train_uneven, (str(tokenizer), str(model)), timeout=300)


def test_uneven_last_step_logs_stock_trl_metrics(uneven):
    """At every step, the last of each epoch included, the logged entropy, mean_token_accuracy and num_tokens are
    stock SFTTrainer's: the duplicate row Accelerate adds to the last micro-batch is not counted."""
    for rank_runs in uneven:
        ours, stock = rank_runs["ours", 1].logs, rank_runs["stock", 1].logs
        assert len(ours) == len(stock) == STEPS
        for mine, theirs in zip(ours, stock, strict=True):
            for key in ("entropy", "mean_token_accuracy", "num_tokens", "grad_norm"):
                assert mine[key] == theirs[key], (key, mine, theirs)
            assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6)


def test_uneven_train_loss_is_the_ranks_mean(uneven):
    """With no log before the end (``logging_steps`` past the run's steps), stock adds each rank's own running loss
    to ``train_loss``: the ranks report different values. Ours adds the ranks' mean, as a log would: the same value
    on every rank, their stock values' mean, and the ``train_loss`` of a run that logs every step (stock's too)."""
    stock_losses = [rank_runs["stock", 100].summary["train_loss"] for rank_runs in uneven]
    assert stock_losses[0] != pytest.approx(stock_losses[1], rel=1e-3)  # rank-local: the case tested here
    for rank_runs in uneven:
        summary = rank_runs["ours", 100].summary
        assert summary["train_loss"] == pytest.approx(sum(stock_losses) / len(stock_losses), rel=1e-6)
        assert summary["train_loss"] == pytest.approx(rank_runs["ours", 1].summary["train_loss"], rel=1e-6)
        assert rank_runs["ours", 1].summary["train_loss"] == pytest.approx(
            rank_runs["stock", 1].summary["train_loss"], rel=1e-6
        )
        for key in ("entropy", "mean_token_accuracy", "num_tokens"):  # TRL's metrics averaged since the last log
            assert summary[key] == rank_runs["stock", 100].summary[key], (key, summary, rank_runs["stock", 100])


def test_uneven_balanced_plan_counts_every_rank(uneven):
    """The balanced plan spreads the samples it repeats over its own split, not on the last ranks: TRL's token
    count keeps every rank's rows at the epoch's end, and equals the Trainer's count of input tokens at every step."""
    for rank_runs in uneven:
        logs = rank_runs["balanced", 1].logs
        assert len(logs) == STEPS
        for entry in logs:
            assert entry["num_tokens"] == entry["num_input_tokens_seen"], entry
