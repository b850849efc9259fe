"""One run identity and one record format for both entry points, read back by the report (``ddp_ft.report.records``)."""

import os
from dataclasses import fields

import pytest
import wandb

from ddp_ft.report.comparison import RunSummary, load_run
from ddp_ft.report.records import RunIdentity, of_type, run_identity

from ..helpers.runs import short_run


def test_run_identity_names_group_and_job_type():
    assert run_identity("p", "", "", "tiny", 2) == RunIdentity("p", "tiny", "ddp-2", "tiny-ddp-2")
    assert run_identity("p", "", "", None, 1) == RunIdentity("p", "custom", "single-1", "custom-single-1")
    assert run_identity("p", "exp", "mine", "tiny", 4) == RunIdentity("p", "exp", "ddp-4", "mine")


def _identity_seen_by_wandb(monkeypatch) -> list[tuple]:
    """Each ``wandb.init``'s (project, group, job type, name), from its arguments or, as the Trainer's
    WandbCallback passes group and job type, from the WANDB_* variables it reads; the run itself is disabled."""
    real_init, seen = wandb.init, []

    def init(**kwargs):
        seen.append(
            (
                kwargs.get("project"),
                kwargs.get("group") or os.environ.get("WANDB_RUN_GROUP"),
                kwargs.get("job_type") or os.environ.get("WANDB_JOB_TYPE"),
                kwargs.get("name"),
            )
        )
        return real_init(**{**kwargs, "mode": "disabled"})

    monkeypatch.setattr(wandb, "init", init)
    return seen


@pytest.mark.usefixtures("run_env")
def test_loop_and_trainer_write_alike_readable_records(tmp_path, monkeypatch):
    """The same single-process experiment through both entry points: wandb sees the same project, group, job type
    and run name, ``metrics.jsonl`` records that name, and the report summarises both runs with the same fields."""
    seen = _identity_seen_by_wandb(monkeypatch)
    summaries, trains = {}, {}
    for entry in ("loop", "trainer"):
        assert short_run(entry, tmp_path / entry, eval_every=1) == 2
        summaries[entry], records = load_run(tmp_path / entry, skip_first=0)
        # both say when each step's buckets were ready
        assert {r["type"] for r in records} == {"config", "train", "eval", "backward"}, entry
        trains[entry] = of_type(records, "train")
    expected = ("ddp_ft", "tiny", "single-1", "tiny-single-1")
    assert seen == [expected, expected]
    assert summaries["loop"].run_name == summaries["trainer"].run_name == "tiny-single-1"
    present = {e: {f.name for f in fields(RunSummary) if getattr(s, f.name) is not None} for e, s in summaries.items()}
    assert present["loop"] == present["trainer"], present
    assert {"tokens_per_s", "step_time_s", "peak_memory_gb", "final_eval_loss", "effective_batch"} <= present["loop"]
    assert {"imbalance", "wait_for_slowest_ms"} <= present["loop"]
    assert {"threads_per_process", "device_type", "local_world_size", "usable_cpus"} <= present["loop"]  # fairness
    for entry, records in trains.items():  # one process: its own compute is the slowest and the fastest, every step
        for record in records:
            assert record["compute_max_ms"] == record["compute_min_ms"] > 0, (entry, record)
            assert (record["imbalance"], record["wait_for_slowest_ms"]) == (1.0, 0.0), (entry, record)
        elapsed = [r["elapsed_s"] for r in records]  # the wall clock, for tokens/s with the gaps between steps
        assert 0 < elapsed[0] < elapsed[1], (entry, elapsed)
    assert summaries["loop"].effective_batch == summaries["trainer"].effective_batch == 1
