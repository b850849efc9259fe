"""scripts/gpu_check.py: its logic on 2 CPU processes (gloo), a broken comparison failing its exit
status, the pure parts on their own, and the real thing on CUDA when there is a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_ft.tools.gpu_check import (
    INJECT_ENV,
    GpuCheckSettings,
    check_dtype,
    format_report,
    merge_ranks,
    plan_world_sizes,
)
from ddp_ft.training.model.precision import Precision, choose_precision

from ..helpers.dist_harness import PYTHONPATH

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
SMALLEST = ["--seq-len", "16", "--micro-batch", "1", "--grad-accum", "2", "--warmup-steps", "0", "--steps", "1"]
CHECKS = ["dtype", "grads_equal_torch_ddp", "no_sync", "qlora_run"]


def _run(args: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, **(env or {})}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.distributed
def test_passes_on_two_cpu_processes_reporting_all(tmp_path):
    out = tmp_path / "gpu_check.json"
    run = _run(["--device", "cpu", "--world-sizes", "2", *SMALLEST, "--out", str(out)])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] and (report["device"], report["backend"]) == ("cpu", "gloo")
    (phase,) = report["phases"]
    assert phase["world_size"] == 2 and phase["compute_dtype"] == "float32"
    checks = {c["name"]: c for c in phase["checks"]}
    assert list(checks) == CHECKS and all(c["passed"] for c in checks.values())
    grads = checks["grads_equal_torch_ddp"]["values"]
    assert grads["bitwise_equal"] and grads["same_on_all_ranks"] and grads["buckets"] > 1  # on CPU: bitwise
    quiet = checks["no_sync"]["values"]
    assert quiet["no_sync_allreduce_calls"] == 0 and quiet["grads_differ_across_ranks"]
    assert quiet["step_allreduce_calls"] == quiet["buckets"]
    run_values = report["runs"]["2"]
    assert (
        run_values["tokens_per_s"] > 0 and run_values["peak_rss_gb"] > 0 and run_values["exposed_comm_ms_per_step"] >= 0
    )
    assert run_values["allreduce_calls_per_step"] == run_values["buckets"]
    assert "| 2 | grads_equal_torch_ddp | PASS |" in run.stdout and run.stdout.count("PASS") >= 5


@pytest.mark.distributed
def test_gradient_unlike_torch_ddp_fails_check_exit(tmp_path):
    """The comparison bites: a BucketedDDP gradient off by its largest value (injected after the reduction, test-only
    variable) is a FAIL row and exit status 1, on the one-process path (its own group of one)."""
    out = tmp_path / "gpu_check.json"
    run = _run(["--device", "cpu", "--world-sizes", "1", *SMALLEST, "--out", str(out)], env={INJECT_ENV: "grad"})
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    checks = {c["name"]: c for c in report["phases"][0]["checks"]}
    assert not report["passed"] and not checks["grads_equal_torch_ddp"]["passed"]
    assert "differs from torch DDP" in checks["grads_equal_torch_ddp"]["detail"]
    assert all(checks[name]["passed"] for name in ("dtype", "no_sync", "qlora_run"))
    assert "| 1 | grads_equal_torch_ddp | FAIL |" in run.stdout and "FAIL (1 failed)" in run.stdout


def test_one_process_then_two_where_two_devices_exist():
    assert plan_world_sizes("cuda", 1, []) == [1]
    assert plan_world_sizes("cuda", 8, []) == [1, 2]
    assert plan_world_sizes("cpu", 0, []) == [1, 2]
    assert plan_world_sizes("cpu", 0, [2]) == [2]
    with pytest.raises(ValueError, match="2 processes but 1 GPU"):
        plan_world_sizes("cuda", 1, [2])


def test_one_visible_gpu_is_shared_only_over_gloo():
    assert plan_world_sizes("cuda", 1, [2], backend="gloo") == [2]  # both ranks on cuda:0
    with pytest.raises(ValueError, match="--backend gloo with one GPU visible"):
        plan_world_sizes("cuda", 1, [2], backend="auto")  # NCCL refuses two ranks on one GPU
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=0"):
        plan_world_sizes("cuda", 2, [3], backend="gloo")  # cuda_device_index has no rule for 3 ranks on 2 GPUs
    assert plan_world_sizes("cuda", 2, [2], backend="gloo") == [2]  # one GPU each, over gloo
    with pytest.raises(ValueError, match="backend='nccl'"):
        GpuCheckSettings(backend="nccl")


@pytest.mark.parametrize(("capability", "reported", "name"), [((7, 5), True, "float16"), ((8, 0), True, "bfloat16")])
def test_dtype_check_passes_the_cards_supported_choice(capability, reported, name):
    check = check_dtype(choose_precision("auto", "cuda", capability), "auto", capability, reported)
    assert check.passed and check.values["dtype"] == name
    assert ("emulated: not used" in check.detail) == (capability < (8, 0))


def test_dtype_check_fails_bfloat16_below_sm80():
    forged = Precision(torch.bfloat16, "cuda", "forged")
    assert not check_dtype(forged, "auto", (7, 0), True).passed
    assert not check_dtype(forged, "bfloat16", (7, 5), True).passed


def test_rank_failure_fails_row_crash_fails_verdict():
    row = {"name": "no_sync", "passed": True, "detail": "fine", "values": {}}
    merged = merge_ranks([[row], [{**row, "passed": False, "detail": "2 all-reduces"}]])
    assert merged == [{**row, "passed": False, "detail": "rank 1: 2 all-reduces"}]
    report = {
        "passed": False,
        "gpus": [],
        "torch": "t",
        "cuda": None,
        "runs": {},
        "seconds": 1.0,
        "phases": [{"world_size": 2, "error": "rank1: RuntimeError: boom"}],
    }
    text = format_report(report)
    assert "| 2 | (phase) | FAIL | rank1: RuntimeError: boom |" in text and "FAIL (1 failed)" in text


# ---------------------------------------------------------------------------------------------- on a real GPU


@pytest.mark.cuda
def test_gpu_check_passes_on_this_host_s_gpus(tmp_path, gpu_environment):
    """On a GPU host (skipped elsewhere by conftest): the script's own run, with the GPUs the suite hid given back."""
    out = tmp_path / "gpu_check.json"
    run = _run(["--out", str(out)], env=gpu_environment, timeout=600)
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["device"] == "cuda" and report["backend"] == "nccl"
    assert [p["world_size"] for p in report["phases"]] == ([1, 2] if len(report["gpus"]) >= 2 else [1])
    for phase in report["phases"]:
        assert [c["name"] for c in phase["checks"]] == CHECKS
        run_values = next(c["values"] for c in phase["checks"] if c["name"] == "qlora_run")
        assert run_values["peak_allocated_gb"] > 0 and run_values["peak_reserved_gb"] >= run_values["peak_allocated_gb"]
    assert report["seconds"] < 300
