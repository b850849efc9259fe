"""The collective benchmark: its pure parts, and the script under the real launcher (no speed asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_ft.tools.ladder.bench_comm import CommRow, default_sizes, favoured_size, format_size, parse_size, repeats_at

from ..helpers.dist_harness import PYTHONPATH

ROOT = Path(__file__).resolve().parents[2]


def test_sizes_parse_step_and_print_in_binary_units():
    assert [parse_size(t) for t in ("4096", "4K", "4KB", "4KiB", "256M", "1g")] == [
        4096,
        4096,
        4096,
        4096,
        2**28,
        2**30,
    ]
    for bad in ("", "K", "-4K", "4T", "1.5M"):
        with pytest.raises(ValueError, match="positive number of bytes"):
            parse_size(bad)
    assert default_sizes() == [4 * 2**10 * 4**i for i in range(9)]  # 4 KiB .. 256 MiB
    assert [format_size(n) for n in (100, 4096, 2**28, 3 * 2**30)] == ["100 B", "4 KiB", "256 MiB", "3 GiB"]
    assert repeats_at(2**28, 20, 2**30) == 4 and repeats_at(4096, 20, 2**30) == 20 and repeats_at(2**30, 20, 2**20) == 3


def test_busbw_formula_and_favoured_size_near_peak():
    row = CommRow("ring", 4 * 10**9, 4, [2.0, 1.0, 3.0])
    assert row.algbw_gbps == 2.0 and row.busbw_gbps == 3.0  # median 2 s; 2 GB/s x 2(4-1)/4
    rows = [CommRow("ring", n, 2, [n / 1e9 / bw]) for n, bw in ((1, 0.1), (4, 0.85), (16, 1.0), (64, 0.9))]
    assert favoured_size(rows, "ring") == 4 and favoured_size(rows, "ring", fraction=0.95) == 16
    assert favoured_size(rows, "backend") is None


@pytest.mark.distributed
def test_runs_under_torchrun_writes_table_json_png(tmp_path):
    out = tmp_path / "bench_comm.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc_per_node=2", str(ROOT / "scripts" / "bench_comm.py")]
    command += ["--sizes", "4K", "64K", "1000", "--repeats", "2", "--warmup", "1", "--device", "cpu", "--out", str(out)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": PYTHONPATH}
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-2000:]}\nstderr:\n{run.stderr[-4000:]}"
    assert "| 64 KiB |" in run.stdout and "ring: peak busbw" in run.stdout
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["method"], r["nbytes"]) for r in rows] == [
        (m, n) for n in (4096, 65536, 1000) for m in ("backend", "ring")
    ]
    for r in rows:
        assert r["world_size"] == result["world_size"] == 2 and r["repeats"] == len(r["seconds"]) == 2
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["algbw_gbps"] == pytest.approx(r["nbytes"] / r["median_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (2 - 1) / 2)
    assert set(result["favoured_bytes"]) == {"backend", "ring"}
    assert all(v in (4096, 65536, 1000) for v in result["favoured_bytes"].values())
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
