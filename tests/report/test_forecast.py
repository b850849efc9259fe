"""``ddp-ft forecast``: the simulated schedule against hand-computed ones, the ring's cost, the link fitted from the
doctor's probe, the table from known records, and the command end to end on a tiny one-process run of the plain loop
and of the Trainer recipe, beside a DDP run in ``ddp-ft compare``."""

import json
import math

import pytest

from ddp_ft.commands import cli, doctor
from ddp_ft.distributed import DistInfo
from ddp_ft.integrations.recipe import build_trainer
from ddp_ft.report.comparison import write_report
from ddp_ft.report.forecast import (
    PRESETS,
    PROBE_FILE,
    Forecast,
    Link,
    MeasuredStep,
    expected_max_of_normals,
    fit_link,
    forecast_run,
    load_forecast,
    load_probe,
    predict_step,
    rank_wait_ms,
    ring_allreduce_ms,
    schedule_buckets,
    split_batch,
)
from ddp_ft.report.metrics import read_jsonl
from ddp_ft.tools.ladder.bench_comm import CommRow
from ddp_ft.training.config import settings_from_preset
from ddp_ft.training.loop import train

from .test_report import config, ddp_run, write_run

ONE_GBPS_10US = Link("test", "1 GB/s, 10 us", 1.0, 10.0, "by hand")


def per_byte(ms_per_byte: float):
    """An all-reduce costing ``ms_per_byte`` ms per byte, for schedules computed by hand."""
    return lambda nbytes: nbytes * ms_per_byte


def test_ring_costs_2_n_minus_1_bytes_and_latencies():
    # 2 ranks: 1 x 1e6 B / 1e9 B/s = 1 ms, plus 2 x 10 us; 4 ranks: 1.5 ms plus 6 x 10 us
    assert ring_allreduce_ms(1_000_000, 2, [ONE_GBPS_10US]) == pytest.approx(1.02)
    assert ring_allreduce_ms(1_000_000, 4, [ONE_GBPS_10US]) == pytest.approx(1.56)
    assert ring_allreduce_ms(1_000_000, 1, [ONE_GBPS_10US]) == 0.0
    slow_hop = Link("slow", "slow", 0.5, 10.0, "by hand")  # the slowest hop paces every step: 2 x (0.5 ms + 10 us)
    assert ring_allreduce_ms(1_000_000, 2, [ONE_GBPS_10US, slow_hop]) == pytest.approx(2.02)


def test_a_bucket_hides_until_it_runs_past_backward():
    hidden = schedule_buckets([30], [40.0], 100.0, per_byte(1.0))  # 40 -> 70, backward ends at 100
    assert (hidden.launch_ms, hidden.done_ms, hidden.exposed_ms) == ((40.0,), (70.0,), 0.0)
    at_the_end = schedule_buckets([30], [100.0], 100.0, per_byte(1.0))  # 100 -> 130: all of it waited for
    assert (at_the_end.done_ms, at_the_end.exposed_ms, at_the_end.comm_ms) == ((130.0,), 30.0, 30.0)


def test_buckets_launch_in_index_order_on_a_free_link():
    # bucket 1 is ready (5) before bucket 0 (10): it waits for bucket 0's launch, then for the link (free at 30)
    schedule = schedule_buckets([20, 10, 5], [10.0, 5.0, 30.0], 40.0, per_byte(1.0))
    assert schedule.launch_ms == (10.0, 30.0, 40.0)
    assert schedule.done_ms == (30.0, 40.0, 45.0)
    assert schedule.exposed_ms == 5.0  # 45 - 40


def test_link_slower_than_backward_exposes_backlog():
    # 100 ms of communication from 10 ms on; backward ends at 20: 10 ms of it overlapped, 90 exposed
    schedule = schedule_buckets([50, 50], [10.0, 20.0], 20.0, per_byte(1.0))
    assert schedule.done_ms == (60.0, 110.0) and schedule.exposed_ms == 90.0


def _measured(step_ms=1000.0, micro_ms=200.0, accumulation=4):
    return MeasuredStep(step_ms, micro_ms, accumulation, 4000.0, (30,), (100.0,), 100.0)


def test_only_the_synced_micro_step_communicates():
    """200 ms outside compute, 200 ms per micro-step, 30 ms exposed once per step whatever the accumulation."""
    cost = per_byte(1.0)
    two = predict_step(_measured(), ranks=2, accumulation=2, cost_ms=cost)
    assert (two.step_ms, two.exposed_ms, two.tokens) == (200.0 + 2 * 200.0 + 30.0, 30.0, 4000.0)
    four = predict_step(_measured(), ranks=2, accumulation=4, cost_ms=cost)
    assert four.step_ms - two.step_ms == 2 * 200.0, "no_sync micro-steps add compute only"
    alone = predict_step(_measured(), ranks=1, accumulation=4, cost_ms=cost)
    assert (alone.step_ms, alone.exposed_ms) == (1000.0, 0.0)


def test_step_waits_for_slowest_rank_as_draws_predict():
    """E[max of N standard normals]: 0 for 1, 1/sqrt(pi) for 2, 1.0294 for 4; a rank's step sums its micro-steps,
    so 2 ranks of 2 micro-steps of spread s wait s x sqrt(2) / sqrt(pi), once per step, on the synced backward;
    the spread is robust, so one step that stalled the host adds none."""
    assert expected_max_of_normals(1) == 0.0
    assert expected_max_of_normals(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_of_normals(4) == pytest.approx(1.0293754, rel=1e-6)
    micro = [196.0, 198.0, 200.0, 202.0, 204.0] * 2  # median 200, median absolute deviation 2: spread 2 x 1.4826
    wait = rank_wait_ms(micro, ranks=2, accumulation=2)
    assert wait == pytest.approx(2 * 1.4826 * math.sqrt(2) / math.sqrt(math.pi))
    assert rank_wait_ms([*micro, 400.0], ranks=2, accumulation=2) == pytest.approx(wait), "one stall is no spread"
    assert rank_wait_ms([200.0] * 4, ranks=8, accumulation=4) == 0.0 and rank_wait_ms(micro, 1, 4) == 0.0
    cost = per_byte(1.0)
    waited = predict_step(_measured(), ranks=2, accumulation=2, cost_ms=cost, wait_ms=wait)
    alone = predict_step(_measured(), ranks=2, accumulation=2, cost_ms=cost)
    assert (waited.step_ms - alone.step_ms, waited.exposed_ms - alone.exposed_ms) == pytest.approx((wait, wait))


def test_split_keeps_effective_batch_or_says_why_not():
    assert split_batch(8, 2, 2) == (2, None)
    accumulation, note = split_batch(8, 2, 8)
    assert accumulation == 1 and "effective batch 8 does not split into micro-batch 2 x 8" in note
    assert "(effective batch 16)" in note and note.endswith("--micro-batch 1")
    _, note = split_batch(16, 16, 2)  # --micro-batch auto took the whole batch on one GPU
    assert note.endswith("To keep 16, each rank runs micro-batch 8: forecast a one-process run with --micro-batch 8")
    assert "To keep" not in split_batch(6, 2, 4)[1]  # 6 samples do not split over 4 ranks at all


def _ring_rows(bandwidth_gbps, latency_us, world=2, sizes=(64 * 2**10, 2**20, 16 * 2**20)):
    link = Link("x", "x", bandwidth_gbps, latency_us, "")
    return [
        {"method": "backend", "nbytes": n, "world_size": world, "median_s": ring_allreduce_ms(n, world, [link]) / 1e3}
        for n in sizes
    ]


def test_measured_link_is_fitted_from_ring_times():
    link = fit_link(_ring_rows(1.6, 60.0))
    assert link.bandwidth_gbps == pytest.approx(1.6) and link.latency_us == pytest.approx(60.0)
    four = fit_link(_ring_rows(1.6, 60.0, world=4))
    assert four.bandwidth_gbps == pytest.approx(1.6) and four.latency_us == pytest.approx(60.0)
    with pytest.raises(ValueError, match="ddp-ft doctor --nproc 2 --sizes 64K 1M 16M --out DIR"):
        fit_link(_ring_rows(1.6, 60.0, sizes=(2**20,)))


def test_doctor_writes_the_probe_that_measured_reads(tmp_path):
    link = Link("x", "x", 1.6, 60.0, "")
    rows = [CommRow("backend", n, 2, [ring_allreduce_ms(n, 2, [link]) / 1e3] * 3) for n in (2**16, 2**20, 2**24)]
    rows += [CommRow("ring", n, 2, [1.0] * 3) for n in (2**16, 2**20, 2**24)]  # the hand-written ring: not the link
    doctor.write_probe(tmp_path, DistInfo(), [doctor.Check("all-reduce", True, "sums right")], rows)
    measured = load_probe(tmp_path)
    assert measured.label == "measured: None on cpu, 2 ranks" and measured.source == str(tmp_path / PROBE_FILE)
    assert measured.bandwidth_gbps == pytest.approx(1.6) and measured.latency_us == pytest.approx(60.0)
    with pytest.raises(FileNotFoundError, match="ddp-ft doctor --nproc 2 --out DIR"):
        load_probe(tmp_path / "elsewhere")


def _one_process_run(steps=4, ready=(90.0, 100.0), bucket_bytes=(2**20, 2**18)):
    records = [{**config("tiny-single-1", 1), "accumulation": 4}]
    for step in range(1, steps + 1):
        records.append({"type": "train", "step": step, "step_time_s": 1.0, "compute_max_ms": 800.0, "tokens": 4000})
        records.append(
            {"type": "backward", "step": step, "bucket_bytes": list(bucket_bytes), "bucket_ready_ms": list(ready)}
            | {"backward_ms": 100.0, "forward_ms": 100.0}  # 200 ms per micro-step: the 800 ms of compute over 4
        )
    return records


def test_table_rows_2_4_8_nproc_then_2_nodes_slow_link():
    forecast = forecast_run(_one_process_run(), nproc=3, link=PRESETS["nvlink"], node_link=PRESETS["infiniband"])
    setups = [(r.setup, r.ranks, r.accumulation) for r in forecast.rows]
    assert setups == [
        ("measured: 1 process", 1, 4),
        ("2 processes", 2, 2),
        ("3 processes", 3, 1),
        ("4 processes", 4, 1),
        ("8 processes", 8, 1),
        ("2 nodes x 3", 6, 1),
    ]
    measured, two = forecast.rows[0], forecast.rows[1]
    assert (measured.step_time_s, measured.tokens_per_s, measured.scaling_efficiency) == (1.0, 4000.0, None)
    nvlink = lambda n: ring_allreduce_ms(n, 2, [PRESETS["nvlink"]])  # noqa: E731
    exposed = max(90.0 + nvlink(2**20), 100.0) + nvlink(2**18) - 100.0
    assert two.exposed_comm_ms == pytest.approx(exposed)
    assert two.step_time_s == pytest.approx((200.0 + 400.0 + exposed) / 1e3)
    assert two.scaling_efficiency == pytest.approx(two.tokens_per_s / (2 * 4000.0))
    nodes, three = forecast.rows[-1], forecast.rows[2]
    assert nodes.link == "NVLink 4 (H100 SXM) + InfiniBand NDR 400G" and nodes.exposed_comm_ms > three.exposed_comm_ms
    assert any("3 ranks: effective batch 8 does not split" in n for n in forecast.notes)
    assert Forecast.from_dict(json.loads(json.dumps(forecast.to_dict()))) == forecast


def test_micro_step_cost_timed_else_step_over_micros():
    links = (PRESETS["pcie4"], PRESETS["infiniband"])
    timed = forecast_run(_one_process_run(), 2, *links)
    untimed = [{k: v for k, v in r.items() if k != "forward_ms"} for r in _one_process_run()]  # an older record
    assert forecast_run(untimed, 2, *links).rows == timed.rows  # 800 ms / 4 = 100 + 100
    fast = [r | {"forward_ms": 50.0} if r["type"] == "backward" else r for r in _one_process_run()]
    two = forecast_run(fast, 2, *links).row(2)  # 150 ms a micro-step: 400 ms of the step do not scale
    assert two.step_time_s == pytest.approx((400.0 + 2 * 150.0 + timed.row(2).exposed_comm_ms) / 1e3)


def test_unreadable_run_refused_saying_what_to_run():
    ddp = _one_process_run()
    ddp[0] = {**ddp[0], "world_size": 2}
    with pytest.raises(ValueError, match="ran on 2 processes: ddp-ft forecast reads a one-process run"):
        forecast_run(ddp, 2, PRESETS["pcie4"], PRESETS["infiniband"])
    older = [r for r in _one_process_run() if r["type"] != "backward"]
    with pytest.raises(ValueError, match=r"no backward records: a Trainer without BucketedTrainer, or an older ddp_ft"):
        forecast_run(older, 2, PRESETS["pcie4"], PRESETS["infiniband"])


def test_record_of_2_logged_steps_counts_per_step():
    """A Trainer logging every 2 steps: its record's tokens sum both, its step time is their mean."""
    links = (PRESETS["pcie4"], PRESETS["infiniband"])
    every_step = [r for r in _one_process_run(steps=6) if r["type"] != "train" or r["step"] % 2 == 0]
    every_2 = [r | {"tokens": 8000, "logged_steps": 2} if r["type"] == "train" else r for r in every_step]
    assert forecast_run(every_2, 2, *links).rows == forecast_run(every_step, 2, *links).rows


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished one-process run of the plain loop on the tiny preset (4 steps)."""
    root = tmp_path_factory.mktemp("forecast")
    settings = settings_from_preset(
        "tiny", output_dir=str(root / "single"), max_steps=4, save_every=0, report_to="none", eval_every=0
    )
    train(settings, DistInfo())
    return root / "single"


@pytest.fixture(scope="module")
def tiny_recipe_run(tmp_path_factory):
    """The same run through the Trainer recipe (BucketedTrainer, one process)."""
    root = tmp_path_factory.mktemp("forecast-recipe")
    settings = settings_from_preset(
        "tiny", output_dir=str(root / "recipe"), max_steps=4, save_every=0, report_to="none", eval_every=0
    )
    build_trainer(settings, DistInfo()).train()
    return root / "recipe"


def test_one_process_run_records_buckets_per_step(tiny_run):
    records = read_jsonl(tiny_run / "metrics.jsonl")
    trains = [r for r in records if r["type"] == "train"]
    backward = [r for r in records if r["type"] == "backward"]
    assert [r["step"] for r in backward] == [r["step"] for r in trains] == [1, 2, 3, 4]
    for record in backward:  # the tiny preset's LoRA gradients: a 1 MiB first bucket, then the rest
        assert record["bucket_bytes"] == [1_048_576, 196_608]
        assert 0 < record["bucket_ready_ms"][0] <= record["bucket_ready_ms"][1] <= record["backward_ms"]
        assert record["forward_ms"] > 0
    assert not any("bucket" in key or key.startswith("comm/") for r in trains for key in r)
    assert next(r for r in records if r["type"] == "config")["buckets"] == 0


def test_recipe_records_the_loop_s_buckets(tiny_run, tiny_recipe_run):
    loop, recipe = (read_jsonl(run / "metrics.jsonl") for run in (tiny_run, tiny_recipe_run))
    backward = [r for r in recipe if r["type"] == "backward"]
    assert [r["step"] for r in backward] == [r["step"] for r in recipe if r["type"] == "train"] == [1, 2, 3, 4]
    assert [r["bucket_bytes"] for r in backward] == [r["bucket_bytes"] for r in loop if r["type"] == "backward"]
    for record in backward:
        assert 0 < record["bucket_ready_ms"][0] <= record["bucket_ready_ms"][1] <= record["backward_ms"]
        assert record["forward_ms"] > 0


def test_command_forecasts_a_recipe_run(tiny_recipe_run, tmp_path, capsys):
    assert cli.main(["forecast", str(tiny_recipe_run), "--nproc", "2", "--link", "nvlink", "--out", str(tmp_path)]) == 0
    assert "| **2 processes** | 2 | NVLink 4 (H100 SXM) | 2 |" in capsys.readouterr().out
    forecast = load_forecast(tmp_path)
    assert forecast.run_name == "tiny-single-1" and forecast.bucket_bytes == [1_048_576, 196_608]
    assert forecast.timed_steps == 3 and forecast.row(2).scaling_efficiency > 0


def test_command_prints_table_sources_writes_json(tiny_run, tmp_path, capsys):
    assert cli.main(["forecast", str(tiny_run), "--nproc", "2", "--link", "nvlink", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| **2 processes** | 2 | NVLink 4 (H100 SXM) | 2 |" in printed and "| 2 nodes x 2 | 4 |" in printed
    assert "https://www.nvidia.com/en-us/data-center/h100/" in printed and "Assumptions:" in printed
    assert (tmp_path / "forecast.md").read_text() in printed
    forecast = load_forecast(tmp_path)
    assert forecast.run_name == "tiny-single-1" and forecast.bucket_bytes == [1_048_576, 196_608]
    assert [r.setup for r in forecast.rows][1:] == ["2 processes", "4 processes", "8 processes", "2 nodes x 2"]
    with pytest.raises(SystemExit, match=r"--link measured reads ddp-ft doctor's probe"):
        cli.main(["forecast", str(tiny_run), "--nproc", "2", "--link", "measured"])


def test_compare_shows_forecast_beside_measured_ddp(tiny_run, tmp_path):
    assert cli.main(["forecast", str(tiny_run), "--nproc", "2", "--link", "nvlink", "--out", str(tiny_run)]) == 0
    two = load_forecast(tiny_run).row(2)
    ddp = write_run(tmp_path / "ddp", ddp_run())  # step time 1.200 s, exposed 2.00 ms (medians after warm-up)
    report = write_report(tiny_run, ddp, tmp_path / "compare")  # the baseline's forecast.json, found beside it
    assert report["forecast"]["step_time_s"] == two.step_time_s and report["forecast"]["from_run"] == "tiny-single-1"
    shown = report["markdown"]
    assert "Forecast beside the measured run (ddp-ft forecast of tiny-single-1: 2 processes over NVLink" in shown
    assert f"| step time (s) | {two.step_time_s:.3f} | 1.200 |" in shown
    assert f"| exposed comm (ms) | {two.exposed_comm_ms:.2f} | 2.00 |" in shown
    elsewhere = write_report(ddp, ddp, tmp_path / "none", forecast=tiny_run)  # another baseline: said so
    assert any("the forecast was made from tiny-single-1, not from the baseline ddp-2" in n for n in elsewhere["notes"])
