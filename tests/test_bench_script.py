"""The benchmark script runs under the real launcher and reports what it claims (no speed asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


def test_bench_ddp_runs_under_torchrun_and_writes_its_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc_per_node=2", str(ROOT / "scripts" / "bench_ddp.py"),
               "--steps", "1", "--repeats", "1", "--seq-len", "32", "--grad-accum", "2", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
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
