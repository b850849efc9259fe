"""The DDP ladder's rungs against one process on the global batch, with 2 real processes (gloo).

Every rung averages gradients correctly when backward produces them in the same order on every rank; when the order
differs across ranks (a data-dependent route, as in a mixture of experts), the rungs that pair gradients by the order
their hooks fire (per-parameter hooks and buckets filled in hook-firing order) average the wrong parameters together,
silently, and BucketedDDP (and torch DDP) still give the reference.
"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ddp_ft.tools.ladder.rungs import RUNGS, accumulate, build_rung
from ddp_ft.tools.ladder.timeline import Timeline
from tests.helpers.dist_harness import PYTHONPATH, run_distributed

ROOT = Path(__file__).resolve().parents[2]

HOOK_ORDER_RUNGS = {"hooks_blocking", "hooks_async", "hook_order_buckets"}
CAPS = {"bucket_cap_mb": 1100 / 2**20, "first_bucket_cap_mb": 1100 / 2**20}  # about one 16x16 weight per bucket


class Routed(nn.Module):
    """Two same-shaped layers applied in an order the batch decides: backward produces ``a``'s and ``b``'s gradients
    in that order's reverse, so two ranks with different routes produce them in different orders."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, a_first: bool) -> torch.Tensor:
        first, second = (self.a, self.b) if a_first else (self.b, self.a)
        return self.head(torch.tanh(second(torch.tanh(first(x)))))


def _loss(model, batch) -> torch.Tensor:
    x, a_first = batch
    return model(x, a_first).pow(2).mean()


def _batches(rank: int, routed_by_rank: bool, steps: int = 2, accumulation: int = 2) -> list[list[tuple]]:
    g = torch.Generator().manual_seed(100 + rank)
    a_first = rank == 0 if routed_by_rank else True
    return [[(torch.randn(4, 16, generator=g), a_first) for _ in range(accumulation)] for _ in range(steps)]


def _reference_grads(model: nn.Module, world_size: int, routed_by_rank: bool) -> list[list[torch.Tensor]]:
    """One process on the global batch: every rank's micro-batches, each loss divided by their total count."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    per_rank = [_batches(r, routed_by_rank) for r in range(world_size)]
    grads = []
    for step in range(len(per_rank[0])):
        micro = [batch for rank in per_rank for batch in rank[step]]
        for batch in micro:
            (_loss(model, batch) / len(micro)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return grads


def _max_error_per_rung(rank: int, world_size: int, routed_by_rank: bool) -> dict[str, float]:
    torch.manual_seed(0)
    base = Routed()
    expected = _reference_grads(copy.deepcopy(base), world_size, routed_by_rank)
    errors = {}
    for name in RUNGS:
        model = build_rung(name, copy.deepcopy(base), Timeline(), **CAPS)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        error = 0.0
        for step, micro in enumerate(_batches(rank, routed_by_rank)):
            accumulate(model, micro, _loss)
            got = [p.grad for p in model.module.parameters()]
            error = max(error, *((g - e).abs().max().item() for g, e in zip(got, expected[step], strict=True)))
            optimizer.step()
            optimizer.zero_grad()
        errors[name] = error
    return errors


def _both_cases(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    return {
        "same_order": _max_error_per_rung(rank, world_size, routed_by_rank=False),
        "rank_dependent_order": _max_error_per_rung(rank, world_size, routed_by_rank=True),
    }


def test_rungs_match_global_batch_unless_hook_paired():
    results = run_distributed(_both_cases, world_size=2)
    for rank, result in enumerate(results):
        same, routed = result["same_order"], result["rank_dependent_order"]
        for name in RUNGS:
            assert same[name] < 1e-6, f"rank {rank}: {name} differs from the global batch by {same[name]}"
        for name in RUNGS:
            if name in HOOK_ORDER_RUNGS:
                assert routed[name] > 1e-3, f"rank {rank}: {name} matched although the hook order differs"
            else:
                assert routed[name] < 1e-6, f"rank {rank}: {name} differs from the global batch by {routed[name]}"


def _run_script(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    """``script`` under torchrun, 2 ranks, on a tiny shape (sequence 16, vocabulary 512); fails on a non-zero exit."""
    command = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "scripts" / script),
        *("--seq-len", "16", "--micro-batch", "1", "--vocab-size", "512", *args),
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-2000:]}\nstderr:\n{run.stderr[-4000:]}"
    return run


@pytest.mark.distributed
@pytest.mark.slow
def test_script_measures_every_rung_and_bytes_sent(tmp_path):
    out = tmp_path / "ladder.json"
    run = _run_script(tmp_path, "ladder.py", "--repeats", "2", "--steps", "1", "--out", str(out))
    assert "| BucketedDDP (ddp_ft) |" in run.stdout and "| torch DDP |" in run.stdout
    result = json.loads(out.read_text())
    assert set(result["workloads"]) == {"qlora", "full"}
    for workload, found in result["workloads"].items():
        rows, gradient_bytes = found["rungs"], found["trainable_mib"] * 2**20
        assert list(rows) == list(RUNGS), workload
        assert max(found["max_parameter_difference_after_warmup"].values()) < 1e-5, workload
        # per optimizer step of 2 micro-steps: the first rung reduces every gradient twice, the others once
        assert rows["after_backward"]["allreduce_bytes"] == pytest.approx(2 * gradient_bytes)
        assert rows["after_backward"]["allreduce_calls"] == 2 * rows["accumulate"]["allreduce_calls"]
        for name in RUNGS:
            if name != "after_backward":
                assert rows[name]["allreduce_bytes"] == pytest.approx(gradient_bytes), (workload, name)
        # one all-reduce per tensor without buckets, one per bucket with them
        tensors = rows["accumulate"]["allreduce_calls"]
        assert rows["hooks_blocking"]["allreduce_calls"] == rows["hooks_async"]["allreduce_calls"] == tensors
        assert rows["bucketed_ddp"]["allreduce_calls"] < tensors
        for name, row in rows.items():
            split = row["compute_pct"] + row["non_compute_pct"] + row["idle_pct"]
            assert split == pytest.approx(100.0, abs=1.0), (workload, name, split)
            assert row["tokens_per_s"] > 0 and len(row["tokens_per_s_all_repeats"]) == 2
        # the blocking rungs cannot compute while they communicate; async hooks can
        assert rows["accumulate"]["overlap_pct"] < 5.0
    assert out.with_suffix(".md").read_text().count("| rung |") == 2
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.distributed
@pytest.mark.slow
def test_bucket_sweep_one_per_layout_then_auto(tmp_path):
    out = tmp_path / "sweep.json"
    args = ("--workloads", "full", "--repeats", "1", "--steps", "1", "--warmup", "1", "--out", str(out))
    _run_script(tmp_path, "bucket_sweep.py", *args, "--caps", "0.01", "1", "1000", "--firsts", "1000")
    rows = json.loads(out.read_text())["workloads"]["full"]["settings"]
    # first 1000 with cap 25 makes the same single bucket as cap 1000: measured once
    auto = [r for r in rows.values() if r["series"] == "auto"]
    assert len(auto) == 1 and len(auto[0]["auto_trial"]["candidates"]) > 1, auto
    kept = {(c["bucket_cap_mb"], c["first_bucket_cap_mb"]) for c in auto[0]["auto_trial"]["candidates"]}
    assert (auto[0]["bucket_cap_mb"], auto[0]["first_bucket_cap_mb"]) in kept  # measured after choosing
    caps = sorted((r["bucket_cap_mb"], r["first_bucket_cap_mb"]) for r in rows.values() if r["series"] != "auto")
    assert caps == [(0.01, 0.01), (1.0, 1.0), (25.0, 1.0), (1000.0, 1000.0)], caps
    buckets = {(r["bucket_cap_mb"], r["first_bucket_cap_mb"]): r["buckets"] for r in rows.values()}
    assert buckets[(1000.0, 1000.0)] == 1 and buckets[(0.01, 0.01)] > buckets[(1.0, 1.0)] > 1
    for row in rows.values():
        assert row["allreduce_calls"] == row["buckets"] and row["tokens_per_s"] > 0
        assert sum(row["bucket_mib"]) == pytest.approx(
            json.loads(out.read_text())["workloads"]["full"]["trainable_mib"], rel=1e-3
        )
    assert "| cap | 0.01 | 0.01 |" in out.with_suffix(".md").read_text()
