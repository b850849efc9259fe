"""scripts/random_model.py: a random-weight Qwen3 of a bench shape with a tokenizer, loadable by the entry points."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ddp_ft.training.data.tokenizer import build_tiny_tokenizer

from ..helpers.dist_harness import PYTHONPATH, ROOT


def _run(args: list[str], tmp_path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "DDP_FT_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.update(WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_folder_trains_and_mismatches_are_refused(tmp_path):
    tokenizer = build_tiny_tokenizer(tmp_path / "tok", vocab_size=600)
    out = tmp_path / "model"
    script = str(ROOT / "scripts" / "random_model.py")
    built = _run(
        [script, "--shape", "tiny", "--vocab-size", "1024", "--tokenizer", str(tokenizer), "--out", str(out)], tmp_path
    )
    assert built.returncode == 0, built.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["vocab_size"] == 1024 and (out / "tokenizer_config.json").exists()

    trained = _run(
        [
            str(ROOT / "scripts" / "train.py"),
            "--preset",
            "tiny",
            "--model-name-or-path",
            str(out),
            "--max-steps",
            "2",
            "--save-every",
            "0",
            "--report-to",
            "none",
            "--output-dir",
            str(tmp_path / "run"),
        ],
        tmp_path,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    losses = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in losses if "loss" in m] == [1, 2]

    too_big = build_tiny_tokenizer(tmp_path / "tok_big", vocab_size=1100)
    refused = _run(
        [script, "--shape", "tiny", "--vocab-size", "1024", "--tokenizer", str(too_big), "--out", str(tmp_path / "m2")],
        tmp_path,
    )
    assert refused.returncode != 0 and "--vocab-size" in refused.stderr and not (tmp_path / "m2").exists()

    other = _run(
        [script, "--shape", "tiny", "--vocab-size", "2048", "--tokenizer", str(tokenizer), "--out", str(out)], tmp_path
    )
    assert other.returncode != 0 and "already holds a model of another shape" in other.stderr
    assert json.loads((out / "config.json").read_text()) == config  # the existing model is untouched
