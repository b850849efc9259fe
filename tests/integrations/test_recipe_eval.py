"""The recipe's evaluation takes every held-out row, on each ``--trainer``: its ``dataloader_drop_last=True`` keeps
whole training steps, and the Trainer applies it to the eval loader too, which would drop the short last batch (3
rows at micro-batch 2 on 2 ranks: no batch at all, and no ``eval_loss``)."""

import pytest
import torch

from ddp_ft.distributed import DistInfo
from ddp_ft.integrations.recipe import build_trainer
from ddp_ft.training.config import settings_from_preset

TRAINERS = ["hf", "trl", "stock-hf", "stock-trl"]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_recipe_evaluates_every_held_out_row(tmp_path, monkeypatch, tiny_cache, trainer):
    """3 held-out rows at micro-batch 2 on one process: the batches of 2 and 1 rows, and the Trainer's eval loss
    over both (each batch's token mean, weighed by its rows), where drop_last left the first batch alone."""
    if trainer.endswith("trl"):
        pytest.importorskip("trl")
    monkeypatch.setenv("DDP_FT_CACHE", tiny_cache)
    settings = settings_from_preset(
        "tiny",
        output_dir=str(tmp_path),
        num_synthetic=60,  # 3 rows held out (eval_fraction 0.05)
        micro_batch=2,
        max_steps=1,
        report_to="none",
        balance_ranks=not trainer.startswith("stock"),
    )
    built = build_trainer(settings, DistInfo(), trainer)
    rows = built.eval_dataset
    assert len(rows) == 3 and built.args.dataloader_drop_last  # training still drops a short last round
    assert [len(batch["labels"]) for batch in built.get_eval_dataloader()] == [2, 1]
    model = built.model.eval()
    with torch.no_grad():
        means = [model(**built.data_collator([rows[i] for i in batch])).loss for batch in ([0, 1], [2])]
    expected = (2 * means[0] + means[1]).item() / 3
    assert built.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-6, abs=0), means
