"""bucket_cap_mb="auto": candidates, the decision, and training through the trial bitwise as torch DDP (2 gloo ranks)."""

import copy
import functools
import logging
import time
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp_ft.ddp import BucketedDDP, ParamSpec, allreduce_hook, compute_bucket_assignment
from ddp_ft.ddp.autotune import TRIAL_ROUNDS, bucket_candidates, choose

from ..helpers.dist_harness import gather_tensors, run_distributed
from ..helpers.models import Net, local_slice, make_batch

MB = 1024 * 1024


def _specs(module):
    return [ParamSpec.of(name, p) for name, p in module.named_parameters() if p.requires_grad]


def test_candidates_distinct_with_torch_default_first():
    specs = _specs(Net())
    found = bucket_candidates(specs)
    layouts = [tuple(b.param_indices for b in layout) for _, layout in found]
    assert len(set(layouts)) == len(layouts) >= 3, "Net must give several distinct layouts for the trial tests"
    first, _ = found[0]
    assert (first.bucket_cap_mb, first.first_bucket_cap_mb) == (25.0, 1.0)
    for candidate, layout in found:
        assert candidate.buckets == len(layout)
        assert layout == compute_bucket_assignment(specs, candidate.bucket_cap_mb, candidate.first_bucket_cap_mb)
    # torch's default puts Net's 19 KB in one bucket, so total/1 (also one bucket) is dropped as a duplicate.
    assert sum(c.buckets == 1 for c, _ in found) == 1
    assert len(bucket_candidates(_specs(torch.nn.Linear(4, 1, bias=False)))) == 1


def test_lowest_median_wins_default_kept_within_noise():
    assert choose([[5.0, 1.0, 9.0], [4.0, 4.0, 4.0], [3.0, 100.0, 3.5]]) == 2  # a single outlier does not count
    assert choose([[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]) == 0
    assert choose([[3.0, 3.0, 3.0], [2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]) == 1
    assert choose([[100.0] * 3, [98.0] * 3]) == 0  # within MIN_GAIN of torch's default: the default stays


def _log_records(name):
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return records


def _grads(model):
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def _train_through_trial(rank, world_size, grad_view):
    """Ours ('auto') and torch DDP side by side; returns what each step saw. Asserts bitwise equality every step."""
    torch.manual_seed(0)
    reference = Net()
    ours = BucketedDDP(copy.deepcopy(reference), bucket_cap_mb="auto", gradient_as_bucket_view=grad_view)
    theirs = TorchDDP(copy.deepcopy(reference), gradient_as_bucket_view=grad_view)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    local = local_slice(rank, world_size)
    n_candidates = len(bucket_candidates(_specs(reference)))
    decided_at = None
    layouts = []
    for step in range(1 + TRIAL_ROUNDS * n_candidates + 2):
        for micro in range(2):  # one no_sync micro-step, then the synced one
            x, y = make_batch(10 * step + micro)
            for model in (ours, theirs):
                with model.no_sync() if micro == 0 else nullcontext():
                    torch.nn.functional.mse_loss(model(x[local]), y[local]).backward()
        g_ours, g_theirs = _grads(ours.module), _grads(theirs.module)
        for a, b in zip(g_ours, g_theirs, strict=True):
            assert torch.equal(a, b), f"step {step}: gradient differs from torch DDP's (layout {ours.bucket_sizes})"
        copies = gather_tensors(g_ours)
        assert all(torch.equal(a, b) for a, b in zip(copies[0], copies[1], strict=True)), f"step {step}: ranks differ"
        if grad_view:
            buffers = ours.bucket_buffers
            assert all(
                any(buf.data_ptr() <= p.grad.data_ptr() < buf.data_ptr() + buf.nbytes for buf in buffers)
                for p in ours.module.parameters()
                if p.requires_grad
            ), f"step {step}: a grad is not a view into the layout in use"
        layouts.append(tuple(ours.bucket_sizes))
        if decided_at is None and ours.bucket_choice is not None:
            decided_at = step
        for opt in optimizers:
            opt.step()
        # Three ways out of a step, in turn: keep the gradients (the next step accumulates onto them, across the
        # relayout that just happened), zero them in place, drop them.
        for opt in optimizers:
            if step % 3 == 1:
                opt.zero_grad(set_to_none=False)
            elif step % 3 == 2:
                opt.zero_grad(set_to_none=True)
        for a, b in zip(ours.module.parameters(), theirs.module.parameters(), strict=True):
            assert torch.equal(a, b), f"step {step}: parameters differ from torch DDP's"
    choice = ours.bucket_choice
    expected = compute_bucket_assignment(_specs(reference), choice.bucket_cap_mb, choice.first_bucket_cap_mb)
    assert ours.bucket_sizes == [b.numel for b in expected]
    return {"layouts": layouts, "decided_at": decided_at, "choice": choice, "candidates": n_candidates}


def _trial_matches_torch_ddp(rank, world_size):
    records = _log_records("ddp_ft.ddp.autotune")
    results = {view: _train_through_trial(rank, world_size, view) for view in (True, False)}
    return results, records


@pytest.mark.distributed
def test_trial_trains_bitwise_as_torch_one_choice():
    ranks = run_distributed(_trial_matches_torch_ddp)
    (results0, log0), (results1, log1) = ranks
    for view, result in results0.items():
        other = results1[view]
        n = result["candidates"]
        assert result["layouts"] == other["layouts"], "ranks switched layouts at different steps"
        assert len(set(result["layouts"])) == n, f"the trial did not try every layout (view={view})"
        assert result["decided_at"] == other["decided_at"] == TRIAL_ROUNDS * n  # warm-up + rounds, then decided
        choice = result["choice"]
        assert choice == other["choice"], "ranks kept different layouts"
        assert 0 <= choice.chosen < n and len(choice.candidates) == n
        assert all(len(t) == TRIAL_ROUNDS for t in choice.timings_ms)
        assert result["layouts"][-1] == result["layouts"][result["decided_at"]]  # fixed after the decision
    assert log1 == []
    assert "<- chosen" not in log0[0] and "timing 3 layouts" in log0[0]
    decisions = [m for m in log0 if "kept bucket_cap_mb=" in m]
    assert len(decisions) == 2 and all("<- chosen" in m and "median" in m and " ms [" in m for m in decisions)
    choice = results0[True]["choice"]
    assert f"kept bucket_cap_mb={choice.bucket_cap_mb:.4g}" in decisions[0]


def _slow_unless(target_buckets, wrapper_box, state, bucket):
    """A comm hook that costs 30 ms per bucket on rank 1 unless the layout in use has ``target_buckets`` buckets."""
    if dist.get_rank() == 1 and len(wrapper_box[0].bucket_sizes) != target_buckets:
        time.sleep(0.03)
    return allreduce_hook(state, bucket)


def _auto_edge_cases(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    local = local_slice(rank, world_size)
    out = {}
    # The decision follows the timings: every layout but one is slowed down on one rank.
    torch.manual_seed(0)
    model = BucketedDDP(Net(), bucket_cap_mb="auto")
    candidates = bucket_candidates(_specs(model.module))
    target = candidates[1][0].buckets  # not the first (the default), not the last
    box = [model]
    model.register_comm_hook(None, functools.partial(_slow_unless, target, box))
    for step in range(1 + TRIAL_ROUNDS * len(candidates)):
        x, y = make_batch(step)
        torch.nn.functional.mse_loss(model(x[local]), y[local]).backward()
    out["biased"] = model.bucket_choice
    box.clear()
    # One distinct layout: decided at construction, no trial (no relayout, no decision collective).
    single = BucketedDDP(torch.nn.Linear(16, 1, bias=False), bucket_cap_mb="auto")
    out["single_before"] = single.bucket_choice
    for step in range(3):
        x, _ = make_batch(step)
        single(x[local]).sum().backward()
    out["single_after"] = single.bucket_choice
    # Refusals that name the setting.
    with pytest.raises(ValueError, match=r"bucket_cap_mb='auto' cannot be combined with PowerSGD"):
        BucketedDDP(Net(), bucket_cap_mb="auto").register_comm_hook(
            powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2),
            powersgd.powerSGD_hook,
        )
    with pytest.raises(ValueError, match=r"bucket_cap_mb='fast'"):
        BucketedDDP(Net(), bucket_cap_mb="fast")
    return out


@pytest.mark.distributed
def test_follows_timings_skips_one_layout_no_powersgd():
    out0, out1 = run_distributed(_auto_edge_cases)
    biased = out0["biased"]
    assert biased == out1["biased"]
    assert biased.chosen == 1, f"auto kept {biased.chosen} though every other layout was slowed: {biased.medians_ms}"
    assert out0["single_before"] is not None and out0["single_before"] == out0["single_after"]
    assert len(out0["single_before"].candidates) == 1 and out0["single_before"].timings_ms == ((),)


def test_record_names_kept_caps_and_every_median():
    from ddp_ft.ddp import BucketCandidate, BucketChoice
    from ddp_ft.report.records import BUCKET_CHOICE, bucket_choice_record

    candidates = (BucketCandidate(25.0, 1.0, 1), BucketCandidate(0.5, 0.5, 3))
    record = bucket_choice_record(step=10, choice=BucketChoice(candidates, ((4.0, 2.0, 3.0), (1.0, 9.0, 2.0)), 1))
    assert record == {
        "type": BUCKET_CHOICE,
        "step": 10,
        "bucket_cap_mb": 0.5,
        "first_bucket_cap_mb": 0.5,
        "buckets": 3,
        "candidates": [[25.0, 1.0, 1], [0.5, 0.5, 3]],
        "median_ms": [3.0, 2.0],
    }
