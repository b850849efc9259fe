"""Side services of a run, for both entry points (the plain loop and the Trainer recipe), in process: a wandb
failure never stops training, only rank 0 talks to wandb, and no secret reaches anything a run writes."""

import json
import logging
import os
import time
from pathlib import Path

import pytest
import wandb
from transformers import TrainerControl, TrainerState, TrainingArguments
from wandb.sdk.lib.noop_run import NoopRun

from ddp_ft.distributed import DistInfo
from ddp_ft.integrations.callbacks import GuardedWandbCallback, ThroughputCallback
from ddp_ft.integrations.recipe import build_trainer, predict_at_end, wandb_report_to
from ddp_ft.report.metrics import NullLogger, WandbLogger, WandbSwitch, open_metric_sink, read_jsonl
from ddp_ft.report.records import run_identity
from ddp_ft.training.checkpoint import FINAL_DIR
from ddp_ft.training.loop import train
from ddp_ft.training.setup import prepare_run

from ..helpers.runs import STEPS, short_run, short_settings

SECRETS = {  # fake values shaped like the real ones (a wandb key is 40 characters)
    "WANDB_API_KEY": "fa4eda7a0123456789abcdef0123456789abcdef",
    "HF_TOKEN": "hf_fakeFAKEfakeFAKEfakeFAKEfakeFAKE0123",
    "ACME_SERVICE_SECRET": "fake-service-secret-4f2a9c7e",
    "DB_PASSWORD_PROD": "fake-db-password-8e1d33b0",
}


def _disabled_wandb_runs(monkeypatch) -> None:
    """``wandb.init`` starts a real run in disabled mode (a NoopRun: no service, no files, quick)."""
    real_init = wandb.init
    monkeypatch.setattr(wandb, "init", lambda **kwargs: real_init(**{**kwargs, "mode": "disabled"}))


def _raise_when(monkeypatch, owner, name: str, when) -> list[bool]:
    """``owner.name`` raises wandb's CommError (the network or wandb's service gone) on the calls where
    ``when(call_number, *args, **kwargs)`` holds, and runs as usual on the others. Returns, per call, whether it
    raised.

    Patched on the class for run methods: wandb binds ``wandb.log`` and friends to the run at init.
    """
    real = getattr(owner, name)
    calls = []

    def call(*args, **kwargs):
        calls.append(when(len(calls) + 1, *args, **kwargs))
        if calls[-1]:
            raise wandb.errors.CommError(f"{name}: network is unreachable (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, call)
    return calls


def _wandb_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "wandb" in r.getMessage()]


def _train_steps(output_dir: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(output_dir / "metrics.jsonl") if r["type"] == "train"]


def _assert_one_warning_naming(caplog, failure: str) -> None:
    warnings = _wandb_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert failure in warnings[0] and "CommError" in warnings[0] and "network is unreachable" in warnings[0]
    assert "off for the rest of this run" in warnings[0] and "metrics.jsonl" in warnings[0], warnings[0]


@pytest.mark.parametrize(
    ("entry", "failure", "named"),
    [
        ("loop", "wandb.init", "wandb.init"),
        ("trainer", "wandb.init", "WandbCallback.on_train_begin"),
        ("trainer", "wandb.log", "WandbCallback.on_log"),
    ],
)
def test_wandb_failing_warns_once_and_training_goes_on(entry, failure, named, tmp_path, run_env, monkeypatch, caplog):
    """``wandb.init`` raising (bad key, no network, service down), or the Trainer's second ``wandb.log`` (the
    network gone mid-run); the loop's ``run.log`` failing is covered below, on its logger alone."""
    _disabled_wandb_runs(monkeypatch)
    if failure == "wandb.init":
        raised = _raise_when(monkeypatch, wandb, "init", lambda n, *a, **k: True)
    else:  # the Trainer's WandbCallback logs through wandb.log, bound to the run's log at init
        raised = _raise_when(monkeypatch, NoopRun, "log", lambda n, *a, **k: n >= 2)
    with caplog.at_level(logging.WARNING):
        steps = short_run(entry, tmp_path / "run")
    assert steps == STEPS
    assert _train_steps(tmp_path / "run") == list(range(1, STEPS + 1))
    _assert_one_warning_naming(caplog, named)
    assert raised.count(True) == 1 and raised[-1], raised  # once off, wandb is not called again


@pytest.mark.parametrize("failure", ["log", "finish"])
def test_loop_wandb_logger_survives_failing_run(failure, tmp_path, run_env, monkeypatch, caplog):
    """The plain loop's wandb sink: ``run.log`` failing from its second call (the network gone), or ``run.finish``
    at the end. A failed run is not finished: its service may be what is gone."""
    _disabled_wandb_runs(monkeypatch)
    raised = _raise_when(monkeypatch, NoopRun, failure, lambda n, *a, **k: n == (2 if failure == "log" else 1))
    wandb_logger = WandbLogger("ddp_ft-test", "g", "single-1", "n", {}, tmp_path)
    with caplog.at_level(logging.WARNING):
        for step in (1, 2, 3):
            wandb_logger.log({"type": "train", "step": step, "samples_seen": step, "loss": 1.0})
        wandb_logger.close()
        wandb_logger.close()
    _assert_one_warning_naming(caplog, f"run.{failure}")
    assert raised == ([False, True] if failure == "log" else [True])  # nothing tried after the failure


def test_trainer_wandb_setup_failure_turns_wandb_off(tmp_path, run_env, monkeypatch, caplog):
    """ThroughputCallback's own wandb calls (define_metric, config.update at the first log) share the Trainer's
    WandbSwitch: their failure warns once, raises nothing, and the WandbCallback logs nothing after it."""
    _disabled_wandb_runs(monkeypatch)
    raised = _raise_when(monkeypatch, NoopRun, "define_metric", lambda n, run, name, **k: name.endswith("seen"))
    logged = _raise_when(monkeypatch, NoopRun, "log", lambda n, *a, **k: False)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True)
    state, control = TrainerState(max_steps=STEPS, is_world_process_zero=True), TrainerControl()
    switch = WandbSwitch(tmp_path / "run" / "metrics.jsonl")
    callbacks = [ThroughputCallback(wandb_switch=switch), GuardedWandbCallback(switch)]
    with caplog.at_level(logging.WARNING):
        for callback in callbacks:
            callback.on_train_begin(args, state, control)
        for callback in callbacks:
            callback.on_log(args, state, control, logs={"loss": 1.0})
    _assert_one_warning_naming(caplog, "define_metric")
    assert raised.count(True) == 1 and not switch.on and not logged


def test_wandb_failure_warning_never_quotes_a_secret(tmp_path, run_env, monkeypatch, caplog):
    """wandb errors may echo what they were given; the warning names the variable instead of its value."""
    monkeypatch.setenv("WANDB_API_KEY", SECRETS["WANDB_API_KEY"])

    def bad_key(**kwargs):
        raise wandb.errors.AuthenticationError(f"API key {SECRETS['WANDB_API_KEY']} was rejected")

    monkeypatch.setattr(wandb, "init", bad_key)
    with caplog.at_level(logging.WARNING):
        WandbLogger("ddp_ft-test", "g", "single-1", "n", {}, tmp_path).close()
    assert SECRETS["WANDB_API_KEY"] not in caplog.text
    assert "API key <WANDB_API_KEY> was rejected" in caplog.text


def test_only_rank_0_starts_wandb_in_both_entry_points(tmp_path, run_env, monkeypatch):
    """The loop's metric sink and the Trainer's ``report_to`` are decided per rank: rank 1 gets a NullLogger and
    ``[]`` (no WandbCallback, no WANDB_* variables set), rank 0 metrics.jsonl plus wandb."""
    inits = _raise_when(monkeypatch, wandb, "init", lambda n, *a, **k: True)
    settings = short_settings(tmp_path / "run")
    rank_1 = DistInfo(rank=1, local_rank=1, world_size=2)
    wandb_run = {"project": "p", "group": "g", "job_type": "ddp-2", "name": "n", "config": {}}
    assert isinstance(open_metric_sink(rank_1, tmp_path / "run", wandb_run), NullLogger)
    identity = run_identity(settings.train.wandb_project, "", "", settings.preset, world_size=2)
    assert wandb_report_to(settings, identity, rank_1) == []
    assert not inits and not (tmp_path / "run").exists() and "WANDB_PROJECT" not in os.environ
    rank_0 = DistInfo(rank=0, local_rank=0, world_size=2)
    open_metric_sink(rank_0, tmp_path / "run", wandb_run).close()  # its wandb.init fails: one warning, no raise
    assert len(inits) == 1 and (tmp_path / "run" / "metrics.jsonl").exists()
    assert wandb_report_to(settings, identity, rank_0) == ["wandb"] and os.environ["WANDB_PROJECT"] == "ddp_ft"
    assert os.environ["WANDB_JOB_TYPE"] == "ddp-2"


def _written_once_wandb_flushed(folder, timeout_s: float = 30.0) -> dict:
    """Every file's bytes under ``folder``, read once the offline run holds our metrics: wandb's service writes its
    file after ``finish()`` returns, later on a loaded host."""
    deadline = time.monotonic() + timeout_s
    while True:
        written = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        runs = [data for p, data in written.items() if p.suffix == ".wandb"]
        if any(b"samples_seen" in data for data in runs) or time.monotonic() > deadline:
            return written
        time.sleep(0.5)


@pytest.mark.parametrize("entry", ["loop", "trainer"])
def test_no_secret_reaches_logs_metrics_or_checkpoints(entry, tmp_path, run_env, monkeypatch, caplog, capfd):
    """Secret-named variables set (fake values), wandb offline: two steps with a checkpoint each, then every byte
    written under ``tmp_path`` (output dir, WANDB_DIR, wandb's config/cache/data dirs) and every captured log and
    console line is searched for the values."""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    caplog.set_level(logging.DEBUG)
    assert short_run(entry, tmp_path / "run", save_every=1) == STEPS
    wandb.finish()  # the Trainer leaves its run open; finishing writes everything the run has
    written = _written_once_wandb_flushed(tmp_path)
    leaks = [(str(p), n) for p, data in written.items() for n, v in SECRETS.items() if v.encode() in data]
    out, err = capfd.readouterr()
    leaks += [
        (where, n)
        for where, text in (("log", caplog.text), ("stdout", out), ("stderr", err))
        for n, v in SECRETS.items()
        if v in text
    ]
    assert not leaks, leaks
    # The search sees inside what it searched: the offline run holds our metrics in the clear, the Trainer's pickled
    # arguments their field names.
    runs = [data for p, data in written.items() if p.suffix == ".wandb"]
    assert len(runs) == 1 and b"samples_seen" in runs[0]
    if entry == "trainer":
        args_files = [data for p, data in written.items() if p.name == "training_args.bin"]
        assert args_files and all(b"hub_token" in data for data in args_files)


def test_hub_token_stays_out_of_pickled_training_args(tmp_path, run_env):
    token = "hf_" + "fakehubtoken" * 3
    trainer = build_trainer(short_settings(tmp_path / "run", save_every=1, report_to="none"), DistInfo())
    trainer.args.hub_token = token
    trainer.train()
    trainer.save_model(str(tmp_path / "run" / "final"))
    pickled = [p.read_bytes() for p in (tmp_path / "run").rglob("training_args.bin")]
    assert len(pickled) == STEPS + 1 and all(b"hub_token" in data for data in pickled)
    assert not any(token.encode() in data for data in pickled)
    assert trainer.args.hub_token == token  # still there for pushing to the hub


@pytest.mark.parametrize("entry", ["loop", "trainer"])
def test_predict_writes_and_logs_predictions_to_wandb(entry, tmp_path, run_env, monkeypatch):
    """``--predict 2`` on both entry points: predictions.jsonl, a predict record, and in wandb the rows as a table
    and their ROUGE-L."""
    _disabled_wandb_runs(monkeypatch)
    logged = []
    monkeypatch.setattr(NoopRun, "log", lambda self, data, *args, **kwargs: logged.append(data))
    settings = short_settings(tmp_path / "run", predict=2, max_new_tokens=4, eval_fraction=0.125)
    if entry == "loop":
        train(settings, DistInfo())
    else:
        parts = prepare_run(settings, DistInfo())
        trainer = build_trainer(settings, DistInfo(), parts=parts)
        trainer.train()
        predict_at_end(trainer, parts, settings, DistInfo())
    rows = [json.loads(line) for line in (tmp_path / "run" / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["reference"] and row["prompt"].endswith("assistant\n") for row in rows)
    (record,) = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["type"] == "predict"]
    assert record["samples"] == 2 and 0 <= record["rouge_l"] <= 1
    (table,) = [payload["eval/predictions"] for payload in logged if "eval/predictions" in payload]
    assert table.columns == ["prompt", "prediction", "reference"] and len(table.data) == 2
    assert [p["eval/rouge_l"] for p in logged if "eval/rouge_l" in p] == [record["rouge_l"]]


@pytest.mark.parametrize("entry", ["train", "recipe"])
def test_failed_predict_keeps_the_final_adapter(entry, tmp_path, run_env, monkeypatch):
    """``--predict`` generates after ``final/`` is saved: a generation that fails (out of memory, say) costs the
    predictions, never the trained adapter."""
    from ddp_ft.commands import recipe as recipe_command
    from ddp_ft.commands import train as train_command
    from ddp_ft.integrations import recipe
    from ddp_ft.training import loop

    final = tmp_path / "run" / FINAL_DIR
    seen = []

    def failing(*args, **kwargs):
        seen.append((final / "adapter_config.json").exists())
        raise RuntimeError("generation failed (test)")

    monkeypatch.setattr(loop if entry == "train" else recipe, "predict_rows", failing)
    command = train_command if entry == "train" else recipe_command
    flags = ["--preset", "tiny", "--max-steps", "2", "--effective-batch", "1", "--micro-batch", "1"]
    flags += ["--num-synthetic", "16", "--max-seq-len", "128", "--report-to", "none", "--eval-fraction", "0.125"]
    with pytest.raises(RuntimeError, match="generation failed"):
        command.main([*flags, "--predict", "1", "--output-dir", str(tmp_path / "run")])
    assert seen == [True] and (final / "adapter_config.json").exists()
