"""The GPU benchmark: its FLOPs formula against a hand computation, its peak table, its random-weight
model, and the script itself on the CPU with a tiny shape (one process, seconds; no speed asserted)."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_ft.tools.bench import BENCH_SHAPES, build_random_qwen3, peak_tflops, qlora_training_flops, random_qwen3_name
from ddp_ft.tools.bench_gpu.cli import parse_args
from ddp_ft.tools.bench_gpu.models import choose_micro_batch
from ddp_ft.tools.bench_gpu.result import micro_batch_auto
from ddp_ft.training.model.memory import QWEN3_4B, Qwen3Shape

from ..helpers.dist_harness import PYTHONPATH

ROOT = Path(__file__).resolve().parents[2]
TINY = BENCH_SHAPES["tiny"]


def test_qwen3_4b_model_flops_per_token_by_hand():
    # One decoder layer's linear weights (out x in): q 4096x2560, k and v 1024x2560, o 2560x4096, gate and up
    # 9728x2560, down 2560x9728.
    layer = 2 * 4096 * 2560 + 2 * 1024 * 2560 + 3 * 9728 * 2560
    assert layer == 100_925_440
    n_base = 36 * layer + 151_936 * 2560  # + the (tied) lm_head's matmul
    n_lora = 36 * 16 * (2 * (4096 + 2560) + 2 * (1024 + 2560) + 3 * (9728 + 2560))  # r x (out + in) per linear
    attention = 4 * 36 * 512 * (32 * 128)  # QK^T and AV, 2 FLOPs per multiply-add each, per token at T = 512
    flops = qlora_training_flops(QWEN3_4B, seq_len=512, lora_r=16)
    assert (flops.base_matmul_params, flops.lora_params, flops.attention_forward) == (n_base, n_lora, attention)
    assert n_lora == 33_030_144  # the reference's ~33M trainable parameters
    assert flops.forward == 2 * n_base + 2 * n_lora + attention
    assert flops.backward == 2 * n_base + 4 * n_lora + 2 * attention
    assert flops.per_token == 4 * n_base + 6 * n_lora + 3 * attention == 17_193_238_528
    # The reference, 1,650 tokens/s on one RTX 4090 (165 TFLOP/s), is then about 17% MFU.
    assert 1650 * flops.per_token / 165e12 == pytest.approx(0.172, abs=0.001)


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
        ("NVIDIA H200", torch.float16, 989.0),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, 165.0),
        ("Tesla T4", torch.float16, None),  # not in the table: MFU unknown unless --peak-tflops
        ("NVIDIA H100 80GB HBM3", torch.float32, None),  # the table holds tensor-core bf16/fp16 peaks only
    ],
)
def test_peak_tflops_by_device_name(name, dtype, peak):
    assert peak_tflops(name, dtype) == peak


def test_random_qwen3_has_the_shape_and_is_built_once(tmp_path):
    from transformers import AutoConfig

    path = tmp_path / random_qwen3_name(TINY, torch.bfloat16)
    build_random_qwen3(path, TINY, torch.bfloat16)
    assert Qwen3Shape.from_config(AutoConfig.from_pretrained(path)) == TINY
    stamp = (path / "config.json").stat().st_mtime_ns
    build_random_qwen3(path, TINY, torch.bfloat16)
    assert (path / "config.json").stat().st_mtime_ns == stamp
    assert random_qwen3_name(TINY, torch.bfloat16) != random_qwen3_name(QWEN3_4B, torch.bfloat16)


def test_random_weights_auto_drawn_on_cpu_without_gpu(tmp_path):
    """``device="auto"`` draws on a GPU with room for the weights twice; without one, on the CPU, as the default."""
    from safetensors.torch import load_file

    auto = build_random_qwen3(tmp_path / "auto", TINY, torch.bfloat16, device="auto")
    cpu = build_random_qwen3(tmp_path / "cpu", TINY, torch.bfloat16)
    drawn = [load_file(folder / "model.safetensors") for folder in (auto, cpu)]
    assert drawn[0].keys() == drawn[1].keys()
    assert all(torch.equal(drawn[0][name], drawn[1][name]) for name in drawn[0])


def test_runs_on_cpu_tiny_shape_writes_table_and_json(tmp_path):
    out = tmp_path / "bench_gpu.json"
    command = [
        sys.executable,
        str(ROOT / "scripts" / "bench_gpu.py"),
        "--shape",
        "tiny",
        "--device",
        "cpu",
        "--seq-len",
        "32",
        "--accumulation",
        "2",
        "--micro-batch",
        "3",
        "--profile-steps",
        "1",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--repeats",
        "2",
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "DDP_FT_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "micro-batch 3, accumulation 2" in run.stdout and "profile bucketed_ddp:" in run.stdout
    assert "| bucketed_ddp" in run.stdout and "BucketedDDP overhead at world size 1" in run.stdout
    assert "4*N_base + 6*N_lora + 12*L*T*d_attn" in run.stdout and "1650 tokens/s" in run.stdout
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"single", "bucketed_ddp"} and result["world_size"] == 1
    for mode in result["modes"].values():
        assert mode["tokens_per_s"] > 0 and len(mode["tokens_per_s_all_repeats"]) == 2
        assert len(mode["step_s_all"]) == 2 and mode["step_s_range"][0] <= mode["step_s"] <= mode["step_s_range"][1]
        assert mode["mfu"] is None  # float32 on a CPU: no known peak
        for tokens_per_s, seconds in zip(mode["tokens_per_s_all_repeats"], mode["step_s_all"], strict=True):
            assert tokens_per_s == pytest.approx(2 * 3 * 32 / seconds)  # accumulation x micro-batch x seq per step
        profile = mode["profile"]
        assert profile["steps"] == 1 and profile["wall_ms_per_step"] > 0
        assert profile["device_busy_fraction"] is None and profile["device_kernel_ms_per_step"] is None  # no GPU
    flops = qlora_training_flops(TINY, seq_len=32)
    assert result["flops_per_token"]["total"] == flops.per_token and result["shape"]["hidden_size"] == 64
    assert result["versions"]["bitsandbytes"] and result["command"].startswith("python ")
    assert len(result["bucketed_ddp_overhead_per_repeat"]) == 2
    assert any((tmp_path / "cache").glob("random-qwen3-h64-*"))  # built into DDP_FT_CACHE


def test_refuses_sizes_below_one_naming_the_flag(monkeypatch, capsys):
    for flag, value in [("--micro-batch", "0"), ("--seq-len", "0"), ("--profile-steps", "-1"), ("--repeats", "0")]:
        monkeypatch.setattr(sys, "argv", ["bench_gpu.py", flag, value])
        with pytest.raises(SystemExit):
            parse_args()
        assert f"argument {flag}: must be >=" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--micro-batch", "4", "--profile-steps", "0"])
    args = parse_args()
    assert args.micro_batch == 4 and args.profile_steps == 0 and args.warmup == 3
    for argv, error in [
        (["--micro-batch", "2", "--effective-batch", "8"], "--effective-batch and --device-memory-gb go with"),
        (["--micro-batch", "auto", "--accumulation", "2"], "derives the accumulation from --effective-batch"),
        (["--micro-batch", "big"], "argument --micro-batch: invalid"),
    ]:
        monkeypatch.setattr(sys, "argv", ["bench_gpu.py", *argv])
        with pytest.raises(SystemExit):
            parse_args()
        assert error in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--micro-batch", "auto", "--effective-batch", "8"])
    assert parse_args().micro_batch == "auto"


def test_micro_batch_auto_is_the_run_settings_choice(tmp_path):
    """``--micro-batch auto`` goes through ``ddp_ft.training.resolve.resolve_micro_batch``: the choice and expected peak
    of ``ddp_ft.training.model.memory.auto_micro_batch`` for the benchmark's shape, sequence length and dtype; refused
    on the CPU without ``--device-memory-gb``, as the run settings refuse it."""
    from ddp_ft.distributed import DistInfo
    from ddp_ft.training.model.memory import auto_micro_batch

    args = argparse.Namespace(
        compute_dtype="bfloat16", lora_dropout=0.05, seq_len=512, effective_batch=16, device_memory_gb=16.0
    )
    choice = choose_micro_batch(args, DistInfo(), QWEN3_4B, tmp_path)
    assert choice == auto_micro_batch(QWEN3_4B, 512, 16, 1, 16_000_000_000, compute_dtype="bfloat16")
    assert 1 < choice.micro_batch < 16 and choice.micro_batch * choice.accumulation == 16
    summary = micro_batch_auto(choice, {"bucketed_ddp": {"peak_allocated_gb": choice.expected_peak / 1e9}})
    assert summary["measured_over_expected"] == pytest.approx(1.0) and summary["budget_gb"] < 16
    assert micro_batch_auto(choice, {"a": {}, "b": {}})["measured_peak_allocated_gb"] is None
    args.device_memory_gb = None
    with pytest.raises(ValueError, match="--micro-batch auto fills a GPU's memory"):
        choose_micro_batch(args, DistInfo(), QWEN3_4B, tmp_path)
