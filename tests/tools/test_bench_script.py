"""The benchmark script runs under the real launcher and reports what it claims (no speed asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers.dist_harness import PYTHONPATH

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_bench_ddp_under_torchrun_writes_table_json(tmp_path):
    out = tmp_path / "bench.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        str(torchrun),
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "scripts" / "bench_ddp.py"),
        "--steps",
        "1",
        "--repeats",
        "1",
        "--seq-len",
        "32",
        "--grad-accum",
        "2",
        "--out",
        str(out),
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": PYTHONPATH}
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-2000:]}\nstderr:\n{run.stderr[-4000:]}"
    assert "BucketedDDP / torch DDP" in run.stdout and "| bucketed_ddp" in run.stdout
    result = json.loads(out.read_text())
    assert set(result["tokens_per_s"]) == {"single", "torch_ddp", "bucketed_ddp"}
    assert all(v > 0 for v in result["tokens_per_s"].values())
    per_step = result["bucketed_ddp_per_optimizer_step"]
    # accumulation 2 under no_sync: exactly one all-reduce per bucket per optimizer step
    assert per_step["allreduce_calls"] == per_step["buckets"]
    assert per_step["allreduce_bytes"] > 0 and per_step["exposed_comm_ms"] >= 0
    expected_ratio = result["tokens_per_s"]["bucketed_ddp"] / result["tokens_per_s"]["torch_ddp"]
    assert result["bucketed_over_torch_ddp"] == pytest.approx(expected_ratio)
    # like for like: both DDPs reduce the same buckets, and the probe measured both
    assert result["bucket_bytes"]["torch_ddp"] == result["bucket_bytes"]["bucketed_ddp"]
    assert sum(result["bucket_bytes"]["bucketed_ddp"]) == per_step["allreduce_bytes"]
    assert set(result["wait_after_last_grad_ms_per_optimizer_step"]) == {"torch_ddp", "bucketed_ddp"}
    assert all(v >= 0 for v in result["wait_after_last_grad_ms_per_optimizer_step"].values())

    # --pool reads result files back; a file whose layouts were not checked is refused
    bench = [sys.executable, str(ROOT / "scripts" / "bench_ddp.py"), "--pool"]
    pooled = subprocess.run([*bench, str(out), str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert pooled.returncode == 0, pooled.stderr[-4000:]
    assert "pooled over 2 repeats" in pooled.stdout
    unchecked = tmp_path / "unchecked.json"
    unchecked.write_text(json.dumps({k: v for k, v in result.items() if k != "bucket_bytes"}))
    refused = subprocess.run([*bench, str(unchecked)], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "not a like-for-like run" in refused.stderr
