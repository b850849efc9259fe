"""The ladder's time split as pure arithmetic on intervals: what compute, non-compute, idle and overlap mean."""

from types import SimpleNamespace

import pytest

from ddp_ft.tools.ladder.timeline import (
    StepBreakdown,
    intersect,
    length,
    profiled_intervals,
    subtract,
    summarize,
    union,
)


def test_interval_arithmetic():
    assert union([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert length([(0, 1), (0.5, 2)]) == 2
    assert intersect([(0, 2), (3, 6)], [(1, 4)]) == [(1, 2), (3, 4)]
    assert subtract([(0, 10)], [(2, 3), (5, 7)]) == [(0, 2), (3, 5), (7, 10)]
    assert subtract([(0, 1)], [(0, 1)]) == []


def test_host_split_of_step_hiding_part_of_its_comm():
    # a 10 s step; communication from 4 to 9; the training thread blocks from 8 to 9.5 (0.5 s after the last
    # completion before it notices): 1 s exposed, 0.5 s idle, 4 s of the 5 s communication hidden
    step = StepBreakdown.from_host((0, 10), comm=[(4, 9)], blocked=[(8, 9.5)], calls=3, nbytes=12)
    assert step.step_ms == 10_000 and step.compute_ms == 8_500
    assert step.exposed_ms == pytest.approx(1_000) and step.idle_ms == pytest.approx(500)
    assert step.comm_ms == 5_000 and step.overlap == pytest.approx(0.8)
    assert step.percent("compute") + step.percent("non_compute") + step.percent("idle") == pytest.approx(100)


def test_a_blocking_all_reduce_overlaps_nothing():
    step = StepBreakdown.from_host((0, 4), comm=[(1, 2), (2, 3)], blocked=[(1, 2), (2, 3)], calls=2, nbytes=8)
    assert step.overlap == 0 and step.exposed_ms == pytest.approx(2_000) and step.idle_ms == 0


def test_device_split_follows_hta():
    # compute kernels 0-6, NCCL 4-8, nothing 8-10: 60% compute, 20% exposed communication, 20% idle, half hidden
    step = StepBreakdown.from_device((0, 10), compute=[(0, 6)], comm=[(4, 8)], calls=1, nbytes=4)
    assert (step.percent("compute"), step.percent("non_compute"), step.percent("idle")) == pytest.approx((60, 20, 20))
    assert step.overlap == pytest.approx(0.5)


def test_summary_shares_from_totals_add_up_to_100():
    steps = [
        StepBreakdown.from_host((0, 10), comm=[(4, 9)], blocked=[(8, 9.5)], calls=3, nbytes=12),
        StepBreakdown.from_host((0, 2), comm=[(0, 1)], blocked=[(0, 1)], calls=1, nbytes=4),
    ]
    row = summarize(steps)
    assert row["compute_pct"] + row["non_compute_pct"] + row["idle_pct"] == pytest.approx(100)
    assert row["overlap_pct"] == pytest.approx(100 * 4 / 6)  # 4 s of 6 s of communication hidden
    assert row["allreduce_calls"] == 2 and row["step_ms"] == 6_000


def _event(name, start_us, end_us, device="CUDA"):
    span = SimpleNamespace(start=start_us, end=end_us, elapsed_us=lambda: end_us - start_us)
    return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device), time_range=span)


def test_profile_splits_nccl_from_compute_drops_copies():
    events = [
        _event("ampere_sgemm_128x64", 0, 5),
        _event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 3, 9),
        _event("Memcpy DtoD", 1, 2),
        _event("aten::mm", 0, 10, device="CPU"),
    ]
    compute, comm = profiled_intervals(events)
    assert compute == [(0, 5e-6)] and comm == [(3e-6, 9e-6)]
