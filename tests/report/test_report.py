"""The single-vs-DDP comparison from known metrics.jsonl numbers: no training, no process group."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_ft.report.comparison import (
    Comparison,
    compare_runs,
    log_report_to_wandb,
    markdown_table,
    summarize_run,
    write_report,
)
from ddp_ft.report.metrics import resolve_wandb_mode

from ..helpers.dist_harness import PYTHONPATH

ROOT = Path(__file__).resolve().parents[2]


def config(run_name, world_size, effective_batch=8):
    return {
        "type": "config",
        "run_name": run_name,
        "world_size": world_size,
        "micro_batch": 2,
        "effective_batch": effective_batch,
        "total_steps": 4,
        "bucket_cap_mb": 25.0,
        "comm_hook": "allreduce",
        "tokens_counted": "non-padding input tokens (attention mask)",
        **{"threads_per_process": 1, "device_type": "cpu", "local_world_size": world_size, "usable_cpus": 2},
    }


def train(step, samples_seen, loss, tokens_per_s, step_time_s, memory, world_size=1, memory_key="peak_rss_gb", **comm):
    return {
        "type": "train",
        "step": step,
        "epoch": 0,
        "samples_seen": samples_seen,
        "loss": loss,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "step_time_s": step_time_s,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / world_size,
        "tokens": 2000,
        memory_key: memory,
        **{f"comm/{k}": v for k, v in comm.items()},
    }


def single_run():
    """Step 1 is the warm-up: slow, and it would move every median if it were counted."""
    return [
        config("single-1", 1),
        train(1, 8, 7.0, 100.0, 5.0, 0.50),
        train(2, 16, 6.5, 1000.0, 2.0, 0.60),
        train(3, 24, 6.0, 1100.0, 2.2, 0.70),
        train(4, 32, 5.5, 1200.0, 2.4, 0.65),
        {"type": "eval", "step": 4, "samples_seen": 32, "eval_loss": 5.75},
    ]


def ddp_run(losses=(7.0, 6.25, 6.5, 5.5), samples=(8, 16, 24, 32)):
    times = [(50.0, 9.0), (1800.0, 1.1), (1900.0, 1.2), (2000.0, 1.3)]
    comm = [(10.0, 0.1), (1.0, 0.9), (2.0, 0.8), (3.0, 0.7)]
    records = [config("ddp-2", 2, effective_batch=samples[0])]
    for i, (s, loss, (tok, t), (ms, ov)) in enumerate(zip(samples, losses, times, comm, strict=True)):
        records.append(train(i + 1, s, loss, tok, t, 0.8 + 0.1 * (i == 2), 2, exposed_comm_ms=ms, overlap=ov))
    records.append({"type": "eval", "step": 4, "samples_seen": samples[-1], "eval_loss": 5.5})
    return records


def write_run(path, records):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def compare(base_records, other_records):
    return compare_runs(summarize_run(base_records), base_records, summarize_run(other_records), other_records)


def test_summary_skips_warmup_peak_memory_all_steps():
    s = summarize_run(single_run())
    assert (s.run_name, s.world_size, s.effective_batch, s.steps) == ("single-1", 1, 8, 4)
    assert (s.timed_steps, s.warmup_steps_skipped) == (3, 1)
    assert s.tokens_per_s == 1100.0 and s.tokens_per_s_per_device == 1100.0  # 1050 with the warm-up
    assert s.step_time_s == 2.2
    assert (s.peak_memory_gb, s.peak_memory_metric) == (0.70, "peak_rss_gb")
    assert s.final_eval_loss == 5.75
    assert s.exposed_comm_ms is None and s.overlap is None and not s.is_ddp

    d = summarize_run(ddp_run())
    assert (d.tokens_per_s, d.tokens_per_s_per_device, d.step_time_s) == (1900.0, 950.0, 1.2)
    assert (d.exposed_comm_ms, d.overlap, d.peak_memory_gb) == (2.0, 0.8, 0.9) and d.is_ddp
    assert summarize_run(single_run(), skip_first=0).tokens_per_s == 1050.0


def test_summary_of_short_gpu_and_resumed_runs():
    one_step = [config("gpu", 1), train(1, 8, 7.0, 500.0, 1.0, 3.5, memory_key="peak_mem_gb")]
    s = summarize_run(one_step)  # a single step is kept rather than leaving nothing to time
    assert (s.tokens_per_s, s.timed_steps, s.warmup_steps_skipped, s.peak_memory_metric) == (500.0, 1, 0, "peak_mem_gb")
    assert s.final_eval_loss is None
    # resumed at step 2: a second config record (world size ignored), its first step is warm-up again
    resumed = [
        *single_run()[:3],
        config("single-1", 4),
        train(3, 24, 6.0, 10.0, 9.0, 0.4),
        train(4, 32, 5.5, 1200.0, 2.4, 0.4),
    ]
    r = summarize_run(resumed)
    assert (r.world_size, r.steps, r.timed_steps, r.tokens_per_s) == (1, 4, 2, 1100.0)
    with pytest.raises(ValueError, match="no config record"):
        summarize_run(single_run()[1:])
    with pytest.raises(ValueError, match="no train record"):
        summarize_run([config("x", 1)])
    with pytest.raises(ValueError, match="skip_first"):
        summarize_run(single_run(), skip_first=-1)


def test_speedup_efficiency_and_loss_gap_by_hand():
    c = compare(single_run(), ddp_run())
    assert c.speedup == 1900.0 / 1100.0
    assert c.scaling_efficiency == (1900.0 / 1100.0) / 2
    assert c.step_time_ratio == 1.2 / 2.2
    # |delta loss| at samples seen 8, 16, 24, 32: 0, 0.25, 0.5, 0
    assert (c.loss_gap_max, c.loss_gap_mean, c.matched_points) == (0.5, 0.1875, 4)
    assert c.eval_loss_delta == 5.5 - 5.75
    assert c.notes == []


def test_loss_gap_over_shared_points_when_runs_differ():
    longer = ddp_run(losses=(7.0, 6.25, 6.5, 5.5), samples=(8, 16, 24, 32))
    longer.insert(-1, train(5, 40, 5.0, 2000.0, 1.2, 0.8, 2, exposed_comm_ms=1.0, overlap=0.9))
    c = compare(single_run(), longer)
    assert (c.loss_gap_max, c.matched_points) == (0.5, 4)
    assert any("differ in length (4 vs 5" in n for n in c.notes)
    # effective batch 16 on the DDP run: only samples seen 16 and 32 are in both curves
    c = compare(single_run(), ddp_run(losses=(6.0, 5.0, 4.5, 4.0), samples=(16, 32, 48, 64)))
    assert (c.loss_gap_max, c.loss_gap_mean, c.matched_points) == (0.5, 0.5, 2)
    assert any("effective batch differs (8 vs 16)" in n for n in c.notes)


def test_disjoint_samples_reported_not_comparable():
    c = compare(single_run(), ddp_run(samples=(4, 12, 20, 28)))
    assert (c.loss_gap_max, c.loss_gap_mean, c.matched_points) == (None, None, 0)
    assert any("not comparable" in n for n in c.notes)
    table = markdown_table(c)
    assert "**Loss-curve gap** (|delta loss| at equal samples seen): not comparable" in table
    assert c.speedup == 1900.0 / 1100.0  # throughput is still compared


def test_markdown_table_has_one_column_per_run():
    table = markdown_table(compare(single_run(), ddp_run()))
    for row in [
        "| metric | single-1 | ddp-2 |",
        "| world size | 1 | 2 |",
        "| optimizer steps | 4 | 4 |",
        "| tokens/s (global) | 1,100.0 | 1,900.0 |",
        "| tokens/s per device | 1,100.0 | 950.0 |",
        "| step time (s) | 2.200 | 1.200 |",
        "| peak memory per device (GB) | 0.70 (RSS) | 0.90 (RSS) |",
        "| final eval loss | 5.7500 | 5.5000 |",
        "| exposed comm / overlap (DDP) | - | 2.00 ms / 80% |",
        "**Speedup** (global tokens/s, ddp-2 / single-1): 1.73x",
        "**Scaling efficiency** (speedup / 2x devices): 86.4%",
        "**Step time ratio** (ddp-2 / single-1): 0.545",
        "**Loss-curve gap** (|delta loss| at equal samples seen): max 0.5 / mean 0.1875 at 4 matched points",
        "**Eval loss delta** (ddp-2 - single-1): -0.2500",
        "non-padding tokens",
    ]:
        assert row in table, row
    gpu = [config("gpu-1", 1), train(1, 8, 7.0, 500.0, 1.0, 3.5, memory_key="peak_mem_gb")]
    gpu_table = markdown_table(compare(gpu, gpu))
    assert "| metric | gpu-1 (baseline) | gpu-1 (other) |" in gpu_table
    assert "| peak memory per device (GB) | 3.50 | 3.50 |" in gpu_table and "exposed comm" not in gpu_table


def test_write_report_md_png_json_round_trip(tmp_path):
    base = write_run(tmp_path / "single", single_run())
    other = write_run(tmp_path / "ddp", ddp_run())
    report = write_report(base, other, tmp_path / "out")
    out = tmp_path / "out"
    assert (out / "comparison.md").read_text() == report["markdown"] == markdown_table(compare(single_run(), ddp_run()))
    png = (out / "comparison.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    assert json.loads((out / "comparison.json").read_text()) == report
    assert Comparison.from_dict(report) == compare(single_run(), ddp_run())
    assert report["table"]["columns"] == ["metric", "single-1", "ddp-2"]
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        write_report(tmp_path / "missing", other, out)


def test_compare_script_prints_table_writes_files(tmp_path):
    base = write_run(tmp_path / "single", single_run())
    other = write_run(tmp_path / "ddp", ddp_run(samples=(4, 12, 20, 28)))
    command = [
        sys.executable,
        str(ROOT / "scripts" / "compare.py"),
        str(base),
        str(other),
        "--out",
        str(tmp_path / "o"),
    ]
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "| tokens/s (global) | 1,100.0 | 1,900.0 |" in run.stdout and "not comparable" in run.stdout
    assert {p.name for p in (tmp_path / "o").iterdir()} == {"comparison.md", "comparison.png", "comparison.json"}
    missing = subprocess.run(
        [*command[:2], str(tmp_path / "nope"), *command[3:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode != 0 and "metrics.jsonl not found" in missing.stderr


@pytest.mark.parametrize(
    ("env", "mode"),
    [
        ({}, "offline"),
        ({"WANDB_MODE": "online"}, "offline"),
        ({"WANDB_API_KEY": "k"}, "online"),
        ({"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}, "offline"),
        ({"WANDB_API_KEY": "k", "WANDB_MODE": "disabled"}, "disabled"),
        ({"WANDB_MODE": "dryrun"}, "offline"),
    ],
)
def test_wandb_offline_without_key_honours_wandb_mode(env, mode):
    assert resolve_wandb_mode(env) == mode


def test_wandb_log_is_offline_says_once_how_to_sync(tmp_path, monkeypatch, capfd, caplog):
    """wandb's own banner, run summary and sync hint are silenced; one log line names the run and the sync command."""
    report = write_report(write_run(tmp_path / "a", single_run()), write_run(tmp_path / "b", ddp_run()), tmp_path)
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="ddp_ft.report.comparison"):
        log_report_to_wandb(report, report["files"]["png"], project="ddp-ft-test", group="tiny")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    out = capfd.readouterr()
    assert "wandb" not in out.out + out.err, out
    hints = [r.getMessage() for r in caplog.records if "wandb sync" in r.getMessage()]
    assert hints == [
        f"to upload it and the training runs logged to the same WANDB_DIR: wandb sync {tmp_path}/wandb/offline-run-*"
    ]


def test_wandb_log_warns_and_returns_without_wandb(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with caplog.at_level(logging.WARNING, logger="ddp_ft.report.comparison"):
        log_report_to_wandb({}, tmp_path / "x.png", project="p", group="g")
    assert "wandb is not installed" in caplog.text


def test_rank_imbalance_and_wait_rows_when_logged():
    records = ddp_run()
    for record, (imbalance, wait) in zip(
        records[1:5], [(3.0, 90.0), (1.2, 10.0), (1.5, 30.0), (1.1, 5.0)], strict=True
    ):
        record.update(imbalance=imbalance, wait_for_slowest_ms=wait)
    d = summarize_run(records)
    assert (d.imbalance, d.wait_for_slowest_ms) == (1.2, 10.0)  # medians, the warm-up step left out
    table = markdown_table(compare(single_run(), records))
    assert "| rank imbalance (max/min compute) / wait for slowest | - | 1.20x / 10.0 ms |" in table
    assert "rank imbalance" not in markdown_table(compare(single_run(), ddp_run()))  # older runs: no row


def test_ddp_measured_against_side_by_side_singles(tmp_path):
    """The limit is the summed median tokens/s of one single-device run per DDP device, run at the same time; the
    DDP run's share of it appears in the summary, the JSON, the plot and through compare.py --independent."""
    base = write_run(tmp_path / "single", single_run())
    other = write_run(tmp_path / "ddp", ddp_run())
    alone = [write_run(tmp_path / f"alone{i}", single_run()) for i in range(2)]
    report = write_report(base, other, tmp_path / "out", independent_dirs=alone)
    assert report["limit_tokens_per_s"] == 2 * 1100.0  # each alone run's median after the warm-up step
    assert report["of_limit"] == 1900.0 / 2200.0
    assert (
        "**Against the limit** (2 independent single-device runs side by side, no communication: 2,200.0 "
        in (report["markdown"])
    )
    assert "reaches 86.4% of it" in report["markdown"]
    assert Comparison.from_dict(report).of_limit == report["of_limit"]
    assert "Against the limit" not in markdown_table(compare(single_run(), ddp_run()))  # none given: no line
    assert report["notes"] == []  # same effective batch: nothing to warn about
    other_batch = write_run(tmp_path / "ddp4", ddp_run(samples=(4, 12, 20, 28)))
    assert "the limit is another experiment" in " ".join(
        write_report(base, other_batch, tmp_path / "out4", independent_dirs=alone)["notes"]
    )
    with pytest.raises(ValueError, match="must be 2 single-device runs"):
        write_report(base, other, tmp_path / "bad", independent_dirs=alone[:1])
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    script = [sys.executable, str(ROOT / "scripts" / "compare.py"), str(base), str(other)]
    run = subprocess.run(
        [*script, "--out", str(tmp_path / "o"), "--independent", *map(str, alone)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "reaches 86.4% of it" in run.stdout
    assert json.loads((tmp_path / "o" / "comparison.json").read_text())["limit_tokens_per_s"] == 2200.0


def test_ddp_over_limit_reported_with_busy_caveat(tmp_path):
    """Two-rank DDP does the independent runs' work plus communication: above 100% of their summed tokens/s, they
    were slowed by something else on the host (the demo on a busy machine), and the report says so next to the ratio
    and in a note, instead of printing the ratio as a result."""
    base = write_run(tmp_path / "single", single_run())
    other = write_run(tmp_path / "ddp", ddp_run())
    busy = [{**r, "tokens_per_s": r["tokens_per_s"] / 2} if r["type"] == "train" else r for r in single_run()]
    alone = [write_run(tmp_path / f"alone{i}", busy) for i in range(2)]
    report = write_report(base, other, tmp_path / "out", independent_dirs=alone)
    assert report["of_limit"] == 1900.0 / 1100.0
    assert "reaches 172.7% of it (over 100%: the host was busy, see the note below)" in report["markdown"]
    (note,) = report["notes"]
    assert note.startswith("ddp-2 at 172.7% of the limit is not a result: over 100% means the independent runs")
    assert "(tokens/s 550 and 550; single-1 alone: 1,100)" in note
    assert "the host was busy" in note and f"Note: {note}." in report["markdown"]
    quiet = write_report(base, other, tmp_path / "quiet", independent_dirs=[base, base])  # 86.4%: no caveat
    assert quiet["notes"] == [] and "over 100%" not in quiet["markdown"]


def _texts(figure) -> str:
    from matplotlib.text import Text

    return "\n".join(t.get_text() for t in figure.findobj(Text))


def _limit_bars(figure):
    container = next(c for c in figure.axes[1].containers if c.get_label().startswith("limit"))
    return container.get_label(), list(container)


def test_ddp_over_limit_marked_on_figure_not_result(tmp_path):
    """The figure goes to wandb and into slides without the text: over 100% of the limit, the limit's bars are grey
    and hatched, their legend says they are not a result, and a line under the figure says why; at 86% nothing
    of it appears and the limit's bars are plain."""
    from matplotlib.colors import to_rgba

    from ddp_ft.report.comparison import comparison_figure, load_run

    base, base_records = load_run(write_run(tmp_path / "single", single_run()))
    other, other_records = load_run(write_run(tmp_path / "ddp", ddp_run()))
    busy = [{**r, "tokens_per_s": r["tokens_per_s"] / 2} if r["type"] == "train" else r for r in single_run()]
    slowed = [load_run(write_run(tmp_path / f"alone{i}", busy))[0] for i in range(2)]
    figure = comparison_figure(compare_runs(base, base_records, other, other_records, slowed))
    label, bars = _limit_bars(figure)
    assert label == "limit: 2 independent runs (not a result)"
    assert all(b.get_hatch() == "//" and b.get_facecolor() == to_rgba("lightgray") for b in bars)
    text = _texts(figure)
    assert "ddp-2 at 172.7% of the limit is not a result" in text and "the host was busy" in text.replace("\n", " ")
    assert "Throughput (speedup 1.73x; the limit is not a result)" in text

    quiet = comparison_figure(compare_runs(base, base_records, other, other_records, [base, base]))
    label, bars = _limit_bars(quiet)
    assert label == "limit: 2 independent runs" and all(b.get_hatch() is None for b in bars)
    assert "not a result" not in _texts(quiet) and "Throughput (speedup 1.73x, 86.4% of the limit)" in _texts(quiet)


def test_unnamed_run_labelled_by_its_folder_everywhere(tmp_path):
    """A user's BucketedTrainer run writes run_name None (TrainingArguments.run_name unset): the comparison used to
    label both runs "None"; an empty name or none at all takes the folder's too."""
    from ddp_ft.report.comparison import load_run

    def unnamed(records, name=None):
        config = {k: v for k, v in records[0].items() if k != "run_name"}
        return [config if name == "missing" else {**config, "run_name": name}, *records[1:]]

    base = write_run(tmp_path / "trainer-1gpu", unnamed(single_run()))
    other = write_run(tmp_path / "trainer-ddp", unnamed(ddp_run()))
    report = write_report(base, other, tmp_path / "out")
    assert report["table"]["columns"] == ["metric", "trainer-1gpu", "trainer-ddp"]
    assert "None" not in report["markdown"] and "(global tokens/s, trainer-ddp / trainer-1gpu)" in report["markdown"]
    from ddp_ft.report.comparison import (
        comparison_figure,  # the figure's title: after the text, which old code got wrong too
    )

    (b, b_records), (o, o_records) = load_run(base), load_run(other)
    title = comparison_figure(compare_runs(b, b_records, o, o_records)).get_suptitle()
    assert title == "trainer-1gpu (1 device(s)) vs trainer-ddp (2 device(s))"
    for name in ("", "missing"):
        assert load_run(write_run(tmp_path / f"run-{name}", unnamed(single_run(), name)))[0].run_name == f"run-{name}"
