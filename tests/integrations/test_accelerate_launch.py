"""The plugin under the real launcher: Accelerate and the HF Trainer train with BucketedDDP on 2 CPU processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_ft.report.comparison import load_run
from ddp_ft.report.metrics import read_jsonl, timeline

from ..helpers.dist_harness import PYTHONPATH
from ..helpers.meetings import write_mixed_length_meetings

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CONFIGS = ROOT / "accelerate_configs"


def _env(tmp_path: Path) -> dict:
    return {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": PYTHONPATH,
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "TOKENIZERS_PARALLELISM": "false",
    }


def _run(command: list[str], tmp_path: Path, timeout: int = 400) -> subprocess.CompletedProcess:
    run = subprocess.run(command, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-6000:])
    return run


def _accelerate(config: str, script: Path, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    return _run(
        [str(BIN / "accelerate"), "launch", "--config_file", str(CONFIGS / config), str(script), *flags], tmp_path
    )


def test_accelerator_wraps_syncs_last_micro_unwraps(tmp_path):
    run = _accelerate("2cpu_gloo.yaml", ROOT / "tests" / "helpers" / "accelerate_script.py", tmp_path)
    assert "BUCKETED_ACCELERATOR_OK" in run.stdout


def _train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["type"] == "train"]


def test_recipe_matches_torchrun_loop_and_compares(tmp_path):
    recipe = ROOT / "recipes" / "qwen_ami.py"
    # padded micro-batches with uneven answers; LoRA dropout off, since the two paths draw their masks differently
    data = [
        "--source",
        write_mixed_length_meetings(tmp_path / "mixed.jsonl", n=160),
        "--lora-dropout",
        "0",
        "--max-steps",
        "8",
    ]
    ddp = _accelerate("2cpu_gloo.yaml", recipe, tmp_path, "--output-dir", str(tmp_path / "recipe-ddp"), *data)
    assert "preset tiny (no model named and no CUDA" in ddp.stderr
    assert "wrapped the model in BucketedDDP" in ddp.stderr and "DistributedDataParallel(" not in ddp.stderr
    # one progress bar with the loss on it, not every log dict printed under it
    assert "{'loss'" not in ddp.stdout + ddp.stderr and "loss=" in ddp.stderr
    assert "new PAD/BOS/EOS tokens" not in ddp.stderr  # the embedded model has its tokenizer's special tokens

    from safetensors import safe_open

    with safe_open(str(tmp_path / "recipe-ddp" / "final" / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and not any("module." in k for k in keys)

    # the same experiment through the plain loop: the Trainer + plugin reproduces its loss curve
    loop = [
        str(BIN / "torchrun"),
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "scripts" / "train.py"),
        "--preset",
        "tiny",
        "--output-dir",
        str(tmp_path / "loop-ddp"),
        *data,
    ]
    _run(loop, tmp_path)
    recipe_steps, loop_steps = _train_records(tmp_path / "recipe-ddp"), _train_records(tmp_path / "loop-ddp")
    assert len(recipe_steps) == len(loop_steps) == 8
    # one run identity for both entry points (ddp_ft.report.records), and records the report reads alike
    summaries = [load_run(tmp_path / run)[0] for run in ("recipe-ddp", "loop-ddp")]
    assert [s.run_name for s in summaries] == ["tiny-ddp-2", "tiny-ddp-2"]
    assert all(s.exposed_comm_ms is not None and s.tokens_per_s and s.peak_memory_gb for s in summaries), summaries
    assert all(s.imbalance is not None and s.wait_for_slowest_ms is not None for s in summaries), summaries
    # measured: within 7e-8 relative (with dropout on, 2e-4: the masks differ)
    assert [r["loss"] for r in recipe_steps] == pytest.approx([r["loss"] for r in loop_steps], rel=1e-6, abs=0)
    # the same non-padding tokens each step (the data has padding: counting it would differ between the paths)
    assert [r["tokens"] for r in recipe_steps] == [r["tokens"] for r in loop_steps]
    # no_sync in the Trainer path too: per optimizer step 2 backwards, 1 synced, 1 all-reduce per bucket
    buckets = [r for r in read_jsonl(tmp_path / "loop-ddp" / "metrics.jsonl") if r["type"] == "config"][0]["buckets"]
    for r in recipe_steps:
        assert (r["comm/backwards"], r["comm/synced_backwards"], r["comm/allreduce_calls"]) == (2, 1, buckets), r

    # the single-process run of the same experiment, then the comparison
    _accelerate("single.yaml", recipe, tmp_path, "--output-dir", str(tmp_path / "recipe-single"), *data)
    single_steps = _train_records(tmp_path / "recipe-single")
    assert [r["tokens"] for r in single_steps] == [r["tokens"] for r in recipe_steps]
    # one offline wandb run per launch (rank 0 only): recipe 2-process, plain loop 2-process, recipe 1-process
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 3, [r.name for r in runs]
    for run_dir in runs:
        data = next(run_dir.glob("run-*.wandb")).read_bytes()
        for key in (
            b"train/loss",
            b"train/tokens_per_s",
            b"train/step_time_s",
            b"train/samples_seen",
            b"tiny",
            b"train/imbalance",
            b"train/wait_for_slowest_ms",
        ):
            assert key in data, (run_dir.name, key)
    ddp_runs = [r for r in runs if b"ddp-2" in next(r.glob("run-*.wandb")).read_bytes()]
    assert len(ddp_runs) == 2 and all(
        b"train/comm/exposed_comm_ms" in next(r.glob("run-*.wandb")).read_bytes() for r in ddp_runs
    )

    out = tmp_path / "comparison"
    compare = _run(
        [
            sys.executable,
            str(ROOT / "scripts" / "compare.py"),
            str(tmp_path / "recipe-single"),
            str(tmp_path / "recipe-ddp"),
            "--out",
            str(out),
        ],
        tmp_path,
    )
    assert "speedup" in compare.stdout.lower()
    assert (out / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    report = json.loads((out / "comparison.json").read_text())
    assert report


def test_progress_bar_shows_loss_tokens_no_log_dicts():
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import ProgressCallback

    from ddp_ft.integrations.callbacks import StepProgressCallback, with_step_progress

    class Bar:
        postfix, written = None, []

        def set_postfix(self, postfix, refresh=True):
            self.postfix = postfix

        def write(self, text):
            self.written.append(text)

    callback, state = StepProgressCallback(), TrainerState(is_world_process_zero=True)
    callback.training_bar = bar = Bar()
    args, control = TrainingArguments(output_dir="unused", use_cpu=True), TrainerControl()
    callback.on_log(args, state, control, logs={"loss": 6.54321, "tokens_per_s": 4293.5, "grad_norm": 0.5})
    assert bar.postfix == {"loss": "6.5432", "tok_s": "4294"} and bar.written == []
    callback.on_log(args, state, control, logs={"train_runtime": 8.7})  # the end-of-training summary: no line either
    assert bar.written == []
    callback.on_prediction_step(args, state, control, eval_dataloader=[1, 2])  # evaluation: no second bar
    assert callback.prediction_bar is None

    class Trainer:  # pop_callback / add_callback as transformers' Trainer has them
        def __init__(self, callbacks):
            self.callbacks = callbacks

        def pop_callback(self, kind):
            found = next((c for c in self.callbacks if isinstance(c, kind)), None)
            self.callbacks = [c for c in self.callbacks if c is not found]
            return found

        def add_callback(self, callback):
            self.callbacks.append(callback)

    rank0 = with_step_progress(Trainer([ProgressCallback()]))
    assert [type(c) for c in rank0.callbacks] == [StepProgressCallback]
    assert with_step_progress(Trainer([])).callbacks == []  # disable_tqdm off rank 0: no bar to replace


@pytest.mark.faults
def test_recipe_survives_kill_mid_save_and_sigterm(tmp_path):
    """The recipe under ``accelerate launch --max_restarts 1``, 8 steps, a checkpoint every 2. Attempt 0: rank 0 is
    SIGKILLed after writing checkpoint 4 into the staging folder, before it is renamed into place; torchelastic
    restarts both ranks. Attempt 1 removes the staging leftover, resumes from checkpoint-2 with no flag (the newest
    whole one), and at step 5 rank 0 sends SIGTERM to the launcher, which forwards it: the ranks agree at the next step,
    the Trainer saves its checkpoint and the recipe returns without the final eval (the launcher, signalled, exits 1).
    ``--resume latest`` finishes: every step's loss bit for bit as the uninterrupted run's. It saves every 4 steps
    now, which transformers warns of (its ``trainer_state.json`` says 2) on rank 0 only."""
    recipe = ROOT / "recipes" / "qwen_ami.py"
    full, interrupted = tmp_path / "full", tmp_path / "interrupted"
    flags = ["--max-steps", "8", "--save-every", "2", "--save-total-limit", "0", "--report-to", "none"]
    _accelerate("2cpu_gloo.yaml", recipe, tmp_path, "--output-dir", str(full), *flags)

    faults = "kill-in-save@4,rank=0,attempt=0; sigterm-launcher@5,rank=0,attempt=1"
    command = [
        str(BIN / "accelerate"),
        "launch",
        "--config_file",
        str(CONFIGS / "2cpu_gloo.yaml"),
        "--max_restarts",
        "1",
        str(recipe),
        "--output-dir",
        str(interrupted),
        *flags,
    ]
    run = subprocess.run(
        command,
        cwd=tmp_path,
        env={**_env(tmp_path), "DDP_FT_INJECT_FAULT": faults},
        capture_output=True,
        text=True,
        timeout=400,
    )
    log = run.stderr
    assert run.returncode == 1 and "death signal, shutting down workers" in log, log[-6000:]
    assert "/.staging/checkpoint-4: a checkpoint whose save did not finish" in log, log[-6000:]
    assert "elastic restart 1: resuming from" in log and "checkpoint-2 at step 2" in log
    stopped = [
        int(line.split("after step ")[1].split(":")[0]) for line in log.splitlines() if "stopped by SIGTERM" in line
    ]
    assert len(stopped) == 2 and stopped[0] == stopped[1] and 5 <= stopped[0] < 8, log[-6000:]  # both ranks, one step
    assert sorted(p.name for p in interrupted.glob("*checkpoint-*")) == sorted(
        {"checkpoint-2", "checkpoint-4", f"checkpoint-{stopped[0]}"}
    )
    assert not (interrupted / ".staging").exists() and not (interrupted / "final").exists()

    flags[flags.index("--save-every") + 1] = "4"
    resumed = _accelerate(
        "2cpu_gloo.yaml", recipe, tmp_path, "--output-dir", str(interrupted), *flags, "--resume", "latest"
    )
    assert resumed.stderr.count("resuming from") == 1, resumed.stderr[-4000:]  # rank 0's line
    assert resumed.stderr.count("save_steps: 4 (from args) != 2 (from trainer_state.json)") == 1, resumed.stderr[-4000:]
    assert f"resuming from {interrupted / f'checkpoint-{stopped[0]}'} at step {stopped[0]}" in resumed.stderr
    expected = [(r["step"], r["loss"]) for r in read_jsonl(full / "metrics.jsonl") if r["type"] == "train"]
    records = read_jsonl(interrupted / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in timeline(records) if r["type"] == "train"] == expected
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3, 4, *range(3, 9)]
