"""A rank that raises or hangs takes the whole job down within a bound, the launcher names the rank and the cause, and
no process is left behind; a stop signal to one rank alone stops every rank with a checkpoint and exit 0.

Faults come from ``DDP_FT_INJECT_FAULT``, installed at the library's hook point by ``tests/helpers/faults.py`` in each process the
real launchers start.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_ft.report.metrics import read_jsonl

from ..helpers.dist_harness import PYTHONPATH, processes_running_with

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.faults]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _launch(
    tmp_path: Path,
    faults: str,
    *flags: str,
    launcher: tuple[str, ...] = (),
    recipe: bool = False,
    env: dict | None = None,
) -> tuple[subprocess.CompletedProcess, float]:
    out = tmp_path / "run"
    if recipe:
        config = ROOT / "accelerate_configs" / "2cpu_gloo.yaml"
        command = [
            str(BIN / "accelerate"),
            "launch",
            "--config_file",
            str(config),
            *launcher,
            str(ROOT / "recipes" / "qwen_ami.py"),
        ]
    else:
        command = [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc_per_node=2",
            *launcher,
            str(ROOT / "scripts" / "train.py"),
            "--preset",
            "tiny",
        ]
    command += ["--output-dir", str(out), "--report-to", "none", "--save-every", "0", *flags]
    environ = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": PYTHONPATH,
        "TOKENIZERS_PARALLELISM": "false",
        "DDP_FT_INJECT_FAULT": faults,
        **(env or {}),
    }
    start = time.monotonic()
    run = subprocess.run(command, cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - start
    assert not processes_running_with(str(out)), "a rank outlived its launcher"
    return run, elapsed


def _root_cause(log: str) -> str:
    assert "Root Cause (first observed failure)" in log, log[-6000:]
    return log.split("Root Cause (first observed failure)")[1]


def test_forward_raise_fails_restarts_named_root_cause(tmp_path):
    run, _ = _launch(tmp_path, "forward@2,rank=1,attempt=*", "--max-steps", "3", launcher=("--max-restarts=1",))
    assert run.returncode != 0
    cause = _root_cause(run.stderr)
    assert (
        "rank      : 1 (local_rank: 1)" in cause
        and "InjectedFault: injected fault: forward failed at step 2 on rank 1" in cause
    )
    # the first attempt failed the same way before torchrun restarted it: restarts ran out on the original error
    assert run.stderr.count("[rank1]: tests.helpers.faults.InjectedFault: injected fault: forward failed") == 2, (
        run.stderr[-6000:]
    )


def test_backward_raise_stops_both_ranks_and_is_named(tmp_path):
    run, _ = _launch(tmp_path, "backward@2,rank=0", "--max-steps", "3")
    assert run.returncode != 0
    cause = _root_cause(run.stderr)
    assert "rank      : 0 (local_rank: 0)" in cause and "injected fault: backward failed at step 2 on rank 0" in cause


def test_data_load_failure_stops_recipe_and_is_named(tmp_path):
    run, _ = _launch(tmp_path, "data@2,rank=1", "--max-steps", "3", recipe=True)
    assert run.returncode != 0
    cause = _root_cause(run.stderr)
    assert (
        "rank      : 1 (local_rank: 1)" in cause and "injected fault: data loading failed at step 2 on rank 1" in cause
    )


def test_stuck_rank_ends_job_after_ddp_timeout_named(tmp_path):
    """Rank 1 stops making progress in step 2; rank 0 waits in the step's all-reduce until --ddp-timeout (3 s) and fails
    naming the bucket and the setting; torchrun then stops the stuck rank. (The injected hang dies of that SIGTERM; a
    rank stuck inside a collective or a kernel never runs its stop handler and is SIGKILLed 30 s later: torchrun's
    failure path waits its default 30 s whatever --shutdown-timeout says.)"""
    run, elapsed = _launch(tmp_path, "hang@2,rank=1", "--max-steps", "3", "--ddp-timeout", "3")
    assert run.returncode != 0
    cause = _root_cause(run.stderr)
    assert "rank      : 0 (local_rank: 0)" in cause and "the all-reduce of bucket" in cause, cause[-3000:]
    assert "--ddp-timeout" in cause and "Timed out waiting 3000ms" in cause, cause[-3000:]
    assert elapsed < 90, elapsed  # startup (15-30 s here) + 1 step + 3 s timeout, with margin for load


def test_sigusr1_to_one_rank_stops_both_at_one_step(tmp_path):
    """Rank 1 alone gets SIGUSR1 in step 2 (torchrun is not signalled). A rank that acted on its own flag would leave
    the other waiting in a collective: --ddp-timeout 10 makes that fail in seconds, not at the test's timeout."""
    run, _ = _launch(tmp_path, "sigusr1-self@2,rank=1", "--max-steps", "6", "--ddp-timeout", "10")
    assert run.returncode == 0, run.stderr[-6000:]
    (stop,) = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["type"] == "stop"]
    assert 2 <= stop["step"] < 6 and stop["signal"] == "a stop signal on another rank"  # rank 0 did not receive it
    assert "[rank1] " in run.stderr and "stopped by SIGUSR1 after step" in run.stderr
    assert (tmp_path / "run" / "latest").read_text() == f"ddp_ft-checkpoint-{stop['step']}"
    assert not [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["type"] == "eval"]


def test_sigusr1_to_one_rank_stops_recipe_at_one_step(
    tmp_path,
):
    """The Trainer's agreement: rank 1 alone gets SIGUSR1 in step 2 (the launcher is not signalled, so rank 0 learns
    it only from the step's all-gather). Both ranks stop after the same step, the Trainer saves one checkpoint there,
    the recipe skips its final eval and save, and accelerate launch exits 0. A rank acting on its own flag would
    leave the other in a collective: --ddp-timeout 10 fails that fast."""
    run, _ = _launch(tmp_path, "sigusr1-self@2,rank=1", "--max-steps", "6", "--ddp-timeout", "10", recipe=True)
    assert run.returncode == 0, run.stderr[-6000:]
    stopped = {
        rank: (signal, int(step))
        for rank, signal, step in re.findall(r"\[(rank\d)\] .*stopped by (.+) after step (\d+): ", run.stderr)
    }
    assert sorted(stopped) == ["rank0", "rank1"], run.stderr[-6000:]
    (signal0, step), (signal1, step1) = stopped["rank0"], stopped["rank1"]
    assert (signal0, signal1) == ("a stop signal on another rank", "SIGUSR1") and step == step1 and 2 <= step < 6
    out = tmp_path / "run"
    assert sorted(p.name for p in out.iterdir() if "checkpoint-" in p.name) == [f"checkpoint-{step}"]
    assert not (out / ".staging").exists() and not (out / "final").exists()
    assert not [r for r in read_jsonl(out / "metrics.jsonl") if r["type"] == "eval"]
