"""The recipe's stock peers (``--trainer stock-hf`` / ``stock-trl``): transformers' Trainer and TRL's SFTTrainer on
torch DDP with no ddp_ft class in the training path, timed and recorded as the ddp_ft trainers are, so the end-to-end
benchmark compares what a user would run instead. Settings they cannot honour are refused before anything loads."""

import pytest
from safetensors.torch import load_file

from ddp_ft.integrations.stock import check_stock_settings, stock_ddp_arguments
from ddp_ft.report.metrics import read_jsonl
from ddp_ft.training.config import settings_from_preset

from ..helpers.faults import injected
from .test_accelerate_launch import ROOT, _accelerate, _train_records

RECIPE = ROOT / "recipes" / "qwen_ami.py"
STRIDED = {"balance_ranks": False}


@pytest.mark.parametrize(
    ("overrides", "trainer", "find_unused", "named"),
    [
        ({}, "stock-hf", "trainer", "--no-balance-ranks"),
        ({**STRIDED, "bucket_cap_mb": "auto"}, "stock-hf", "trainer", "bucket_cap_mb='auto'"),
        ({**STRIDED, "comm_hook": "bf16"}, "stock-trl", "trainer", "comm_hook"),
        ({**STRIDED, "find_unused_parameters": True}, "stock-hf", "trainer", "--stock-find-unused"),
        ({**STRIDED, "first_bucket_cap_mb": 4.0}, "stock-hf", "false", "first_bucket_cap_mb"),
        ({}, "hf", "false", "--find-unused-parameters"),
        ({}, "trl", "true", "--stock-find-unused true"),
    ],
)
def test_unhonoured_setting_is_refused_naming_it(overrides, trainer, find_unused, named):
    settings = settings_from_preset("tiny", **overrides)
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        check_stock_settings(settings, trainer, find_unused)


def test_fault_injection_refused_on_every_rank():
    with injected("data@2,rank=1", rank=0):  # meant for rank 1: rank 0 refuses too
        with pytest.raises(ValueError, match="run hooks are installed"):
            check_stock_settings(settings_from_preset("tiny", **STRIDED), "stock-hf", "trainer")
        check_stock_settings(settings_from_preset("tiny"), "hf", "trainer")  # the ddp_ft trainers inject faults
    check_stock_settings(settings_from_preset("tiny", **STRIDED), "stock-hf", "trainer")  # none installed: no refusal


def test_ddp_settings_reach_torch_ddp_via_trainer_args():
    settings = settings_from_preset("tiny", bucket_cap_mb=50.0, broadcast_buffers=False, **STRIDED)
    check_stock_settings(settings, "stock-hf", "false")  # passed on, so not refused
    assert stock_ddp_arguments(settings, "false") == dict(
        ddp_find_unused_parameters=False, ddp_bucket_cap_mb=50.0, ddp_broadcast_buffers=False
    )
    assert stock_ddp_arguments(settings, "trainer")["ddp_find_unused_parameters"] is None  # the Trainer decides
    assert stock_ddp_arguments(settings, "true")["ddp_find_unused_parameters"] is True


def test_recipe_gives_trainers_the_group_s_backend():
    """The group init_distributed started is the Trainer's ddp_backend: gloo on a GPU too, never nccl for cuda."""
    import torch

    from ddp_ft.distributed import DistInfo
    from ddp_ft.integrations.recipe import training_arguments
    from ddp_ft.training.model.precision import choose_precision
    from ddp_ft.training.resolve import Resolved

    settings = settings_from_preset("tiny", backend="gloo", report_to="none", **STRIDED)
    check_stock_settings(settings, "stock-hf", "trainer")  # passed on, so not refused
    precision = choose_precision("float32", "cpu", None)
    resolved = Resolved(1, 4, False, precision, {"": 0}, "a test's", "off")
    shared = DistInfo(1, 1, 2, 2, torch.device("cuda", 0), "gloo")
    assert training_arguments(settings, shared, precision, resolved)["ddp_backend"] == "gloo"
    assert training_arguments(settings, DistInfo(), precision, resolved)["ddp_backend"] is None  # one process


def test_recipe_refuses_balanced_plan_before_launch(tmp_path):
    import subprocess
    import sys

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddp_ft.commands.cli",
            "recipe",
            "--nproc",
            "2",
            "--preset",
            "tiny",
            "--trainer",
            "stock-hf",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "--no-balance-ranks" in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "runs").exists()  # nothing written, nothing launched


@pytest.mark.distributed
@pytest.mark.slow
def test_stock_and_bucketed_in_stock_order_train_same(tmp_path):
    """2 CPU processes, the recipe on mixed lengths: ``--trainer stock-hf`` (torch DDP, find_unused_parameters as
    the Trainer chooses it: True for a PeftModel) and ``--trainer hf --no-balance-ranks`` (BucketedDDP, the stock
    sampling). Same rows in the same order, BucketedDDP equal to torch DDP: the same losses and the same adapters to
    float32 rounding, and the same records (the stock run's without BucketedDDP's communication stats)."""
    from ddp_ft.training.data.synthetic import write_mixed_length_meetings

    flags = ["--max-steps", "4", "--no-balance-ranks", "--report-to", "none", "--save-every", "0"]
    flags += ["--source", write_mixed_length_meetings(tmp_path / "mixed.jsonl", n=64)]
    stock = _accelerate(
        "2cpu_gloo.yaml", RECIPE, tmp_path, "--output-dir", str(tmp_path / "stock"), "--trainer", "stock-hf", *flags
    )
    assert "wrapped the model in BucketedDDP" not in stock.stderr
    assert "stock-hf: torch DDP through the stock Trainer (find_unused_parameters=True" in stock.stderr
    ours = _accelerate("2cpu_gloo.yaml", RECIPE, tmp_path, "--output-dir", str(tmp_path / "ours"), *flags)
    assert "wrapped the model in BucketedDDP" in ours.stderr

    theirs, mine = _train_records(tmp_path / "stock"), _train_records(tmp_path / "ours")
    assert [r["step"] for r in theirs] == [r["step"] for r in mine] == [1, 2, 3, 4]
    assert [r["tokens"] for r in theirs] == [r["tokens"] for r in mine]
    assert [r["loss"] for r in theirs] == pytest.approx([r["loss"] for r in mine], rel=1e-6, abs=0)
    for record in theirs:
        assert record["tokens_per_s"] > 0 and record["elapsed_s"] > 0 and "comm/allreduce_calls" not in record
    assert all("comm/allreduce_calls" in r for r in mine)
    config = next(r for r in read_jsonl(tmp_path / "stock" / "metrics.jsonl") if r["type"] == "config")
    assert config["trainer"] == "stock-hf" and config["find_unused_parameters"] is True and config["world_size"] == 2

    a = load_file(tmp_path / "stock" / "final" / "adapter_model.safetensors")
    b = load_file(tmp_path / "ours" / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].float().sub(b[name].float()).abs().max().item() <= 1e-6, name


@pytest.mark.distributed
@pytest.mark.slow
def test_stock_sft_runs_recipe_with_the_same_records(tmp_path):
    pytest.importorskip("trl")
    flags = ["--trainer", "stock-trl", "--no-balance-ranks", "--stock-find-unused", "false", "--max-steps", "2"]
    run = _accelerate(
        "2cpu_gloo.yaml", RECIPE, tmp_path, "--output-dir", str(tmp_path / "stock-trl"), *flags, "--report-to", "none"
    )
    assert "wrapped the model in BucketedDDP" not in run.stderr
    records = _train_records(tmp_path / "stock-trl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["tokens_per_s"] > 0 and "mean_token_accuracy" in r for r in records)
    config = next(r for r in read_jsonl(tmp_path / "stock-trl" / "metrics.jsonl") if r["type"] == "config")
    assert config["trainer"] == "stock-trl" and config["find_unused_parameters"] is False
