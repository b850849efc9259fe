"""The recipe's TRL mode under the real launcher: ``accelerate launch recipes/qwen_ami.py --trainer trl`` on 1 and 2
CPU processes (tiny preset), then ``scripts/compare.py`` on the two, as for the Trainer recipe."""

import json
import sys

import pytest

from ddp_ft.report.metrics import read_jsonl

from .test_accelerate_launch import ROOT, _accelerate, _run, _train_records

pytest.importorskip("trl")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# 3 steps without warmup (the first at full learning rate), so the third step's loss follows two updates.
FLAGS = ["--trainer", "trl", "--max-steps", "3", "--warmup-ratio", "0", "--lora-dropout", "0", "--report-to", "none"]


def test_sft_recipe_trains_as_1_process_same_records(tmp_path):
    """``--trainer trl``: BucketedSFTTrainer wraps the model in BucketedDDP, trains on the recipe's rows (the balanced
    plan: the same rows per step on 1 and 2 processes), and writes the Trainer recipe's ``metrics.jsonl`` plus TRL's
    metrics. Against one process on the same global batches: the same tokens per step, the loss within 1e-5 (TRL
    keeps the adapters of the 4-bit model in bfloat16; measured 4.3e-6 at step 2, 2.8e-6 at step 3); compare.py reads
    both."""
    recipe = ROOT / "recipes" / "qwen_ami.py"
    ddp = _accelerate("2cpu_gloo.yaml", recipe, tmp_path, "--output-dir", str(tmp_path / "trl-ddp"), *FLAGS)
    assert "wrapped the model in BucketedDDP" in ddp.stderr and "DistributedDataParallel(" not in ddp.stderr
    # float32 on the CPU, the adapters in TRL's bfloat16: said in the log, and the fix in the command line's terms
    assert "compute dtype float32 (auto: float32 on the CPU); the LoRA adapters in bfloat16" in ddp.stderr
    assert "Pass --compute-dtype bfloat16" in ddp.stderr and "BitsAndBytesConfig" not in ddp.stderr
    _accelerate("single.yaml", recipe, tmp_path, "--output-dir", str(tmp_path / "trl-single"), *FLAGS)
    two, one = _train_records(tmp_path / "trl-ddp"), _train_records(tmp_path / "trl-single")
    assert len(two) == len(one) == 3
    for record in two:
        assert {"entropy", "mean_token_accuracy", "num_tokens", "comm/allreduce_calls", "imbalance"} <= record.keys()
        assert record["num_tokens"] == record["num_input_tokens_seen"], record
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5, abs=0)
    assert (tmp_path / "trl-ddp" / "final" / "adapter_model.safetensors").exists()
    config = [r for r in read_jsonl(tmp_path / "trl-ddp" / "metrics.jsonl") if r["type"] == "config"][0]
    assert config["world_size"] == 2

    out = tmp_path / "comparison"
    compare = [sys.executable, str(ROOT / "scripts" / "compare.py"), str(tmp_path / "trl-single")]
    _run([*compare, str(tmp_path / "trl-ddp"), "--out", str(out)], tmp_path)
    assert json.loads((out / "comparison.json").read_text())
