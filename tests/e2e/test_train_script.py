"""scripts/train.py under the real launcher: trains, saves, reloads, resumes, and spans two 'nodes'."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_ft.report.metrics import read_jsonl, timeline

from ..helpers.dist_harness import PYTHONPATH
from ..helpers.meetings import write_chat_meetings, write_mixed_length_meetings

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _env() -> dict:
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": PYTHONPATH, "TOKENIZERS_PARALLELISM": "false"}


def _train(tmp_path: Path, *flags: str, nproc: int = 2, timeout: int = 400) -> subprocess.CompletedProcess:
    launcher = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else [sys.executable]
    command = [*launcher, str(ROOT / "scripts" / "train.py"), "--preset", "tiny", *flags]
    run = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-6000:]
    return run


def _records(output_dir: Path, kind: str) -> list[dict]:
    return [r for r in read_jsonl(output_dir / "metrics.jsonl") if r["type"] == kind]


# The uninterrupted 2-process run the tests below check: 8 steps, a checkpoint every 2 (the 2 newest kept), dropout on.
_REFERENCE = ["--max-steps", "8", "--save-every", "2", "--save-total-limit", "2", "--report-to", "none"]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("reference")
    _train(tmp_path, "--output-dir", str(tmp_path / "run"), *_REFERENCE)
    return tmp_path / "run"


def test_two_ranks_learn_and_saved_adapter_reproduces(reference_run, tmp_path):
    out = reference_run
    config = _records(out, "config")
    assert len(config) == 1 and config[0]["world_size"] == 2 and config[0]["accumulation"] == 2
    train = _records(out, "train")
    assert [r["step"] for r in train] == list(range(1, 9))
    losses = [r["loss"] for r in train]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    for key in ("lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_rss_gb", "comm/allreduce_calls"):
        assert key in train[-1], key
    # accumulation 2 under no_sync: every step is 2 backwards, 1 of them synced, 1 all-reduce per bucket
    assert config[0]["buckets"] > 1
    assert all(
        (r["comm/backwards"], r["comm/synced_backwards"], r["comm/allreduce_calls"]) == (2, 1, config[0]["buckets"])
        for r in train
    ), [(r["comm/backwards"], r["comm/allreduce_calls"]) for r in train]

    checkpoint = out / (out / "latest").read_text().strip()
    assert checkpoint.name == "ddp_ft-checkpoint-8"
    from safetensors import safe_open

    with safe_open(str(checkpoint / "adapter" / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and not any("module." in k for k in keys)

    logged_eval = _records(out, "eval")[-1]["eval_loss"]
    reloaded = subprocess.run(
        [sys.executable, "-c", _EVAL_SNIPPET, str(checkpoint / "adapter")],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reloaded.returncode == 0, reloaded.stderr[-4000:]
    # measured: 2.5e-8 apart (one process with 2 threads vs two ranks' sums)
    assert float(reloaded.stdout.strip().splitlines()[-1]) == pytest.approx(logged_eval, rel=1e-6, abs=0)


# One fresh process: base model + saved adapter, the tiny preset's eval split, the library's evaluate.
_EVAL_SNIPPET = """
import sys
from transformers import DataCollatorForSeq2Seq
from ddp_ft.training.config import settings_from_preset
from ddp_ft.training.data import load_raw_splits, tokenize_dataset
from ddp_ft.distributed import DistInfo
from ddp_ft.training.steps import evaluate
from ddp_ft.training.setup import resolve_model_and_tokenizer
from ddp_ft.training.model.qlora import ModelSettings, load_trained_adapter
from ddp_ft.training.data.tokenizer import load_tokenizer
s = settings_from_preset("tiny")
model_path, tokenizer_path = resolve_model_and_tokenizer(s.model.model_name_or_path, DistInfo())
tok = load_tokenizer(tokenizer_path)
eval_set, _ = tokenize_dataset(load_raw_splits(s.data)["eval"], tok, s.data)
model = load_trained_adapter(ModelSettings(model_name_or_path=model_path), sys.argv[1], {"": "cpu"})
collate = DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100)
print(evaluate(model, eval_set, collate, s.train.micro_batch, DistInfo()))
"""


def _adapter(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))


@pytest.mark.faults
def test_kill_restart_sigterm_lose_and_repeat_no_step(reference_run, tmp_path):
    """torchrun --max-restarts=1, 8 steps, a checkpoint every 2, LoRA dropout on. Attempt 0: rank 0 is SIGKILLed
    half-way through writing checkpoint 4; rank 1 fails in the save's barrier; torchrun restarts both. Attempt 1
    removes the partial folder, resumes from checkpoint 2 with no flag, and at step 5 rank 0 sends SIGTERM to torchrun,
    which forwards it to both ranks: they agree at the next step boundary, save one checkpoint and exit 0 (torchrun
    itself exits 1: it was signalled). ``--resume latest`` finishes. Against the uninterrupted run: every step's loss
    bit for bit (adapter, optimizer, schedule, data position and each rank's RNG restored), the same samples, the same
    final adapter."""
    full, interrupted, flags = reference_run, tmp_path / "interrupted", _REFERENCE

    faults = "kill-in-save@4,rank=0,attempt=0; sigterm-launcher@5,rank=0,attempt=1"
    command = [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=1",
        str(ROOT / "scripts" / "train.py"),
        "--preset",
        "tiny",
        "--output-dir",
        str(interrupted),
        *flags,
    ]
    run = subprocess.run(
        command,
        cwd=tmp_path,
        env={**_env(), "DDP_FT_INJECT_FAULT": faults},
        capture_output=True,
        text=True,
        timeout=400,
    )
    log = run.stderr
    assert run.returncode == 1 and "death signal, shutting down workers" in log, log[-6000:]
    assert "removed" in log and ".tmp-ddp_ft-checkpoint-4: a checkpoint whose save did not finish" in log, log[-6000:]
    assert "elastic restart 1: resuming from" in log and "ddp_ft-checkpoint-2" in log
    (stop,) = _records(interrupted, "stop")
    assert stop["signal"] == "SIGTERM" and 5 <= stop["step"] < 8, stop  # the signal is sent during step 5
    assert log.count(f"stopped by SIGTERM after step {stop['step']} of 8") == 2, log[-6000:]  # both ranks
    assert (interrupted / "latest").read_text() == f"ddp_ft-checkpoint-{stop['step']}"
    assert not list(interrupted.glob(".*checkpoint*"))

    _train(tmp_path, "--output-dir", str(interrupted), *flags, "--resume", "latest")
    expected = [(r["step"], r["samples_seen"], r["loss"]) for r in _records(full, "train")]
    records = read_jsonl(interrupted / "metrics.jsonl")
    final = [(r["step"], r["samples_seen"], r["loss"]) for r in timeline(records) if r["type"] == "train"]
    assert final == expected  # each step once, from the attempt the run continued from, equal to the uninterrupted run
    steps_logged = [r["step"] for r in records if r["type"] == "train"]
    assert steps_logged == [1, 2, 3, 4, *range(3, 9)], steps_logged  # attempt 0 got to 4; the restart redid 3 and 4
    assert _records(interrupted, "eval")[-1]["eval_loss"] == _records(full, "eval")[-1]["eval_loss"]
    got, want = _adapter(interrupted / "ddp_ft-checkpoint-8"), _adapter(full / "ddp_ft-checkpoint-8")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _checkpoint(output_dir: Path, step: int) -> Path:
    (path,) = output_dir.glob(f"*checkpoint-{step}")
    return path


def test_one_and_two_ranks_share_curve_and_checkpoints(tmp_path):
    """The effective-batch guarantee end to end, on variable-length data (61 training samples, 7 steps of 8 per
    epoch, 9 steps: the run crosses into epoch 1). 1 process (accumulation 4) and 2 processes (accumulation 2) see
    the same non-padding tokens each step and follow the same loss curve to summation-order rounding (measured:
    under 1e-6 relative per step). A checkpoint stores its place in the epoch's global order (samples consumed),
    so 2 ranks -> 1 and 1 -> 2 continue with exactly the samples the uninterrupted runs train, with the same
    losses. LoRA dropout is off: each rank draws its own masks (with dropout the curves differ by up to 9e-4)."""
    source = write_mixed_length_meetings(tmp_path / "mixed.jsonl")
    flags = ["--source", source, "--lora-dropout", "0", "--report-to", "none", "--max-steps", "9"]
    saving = [*flags, "--save-every", "3", "--save-total-limit", "0"]
    _train(tmp_path, "--output-dir", str(tmp_path / "full2"), *saving)
    _train(tmp_path, "--output-dir", str(tmp_path / "full1"), *saving, nproc=1)
    resumed = {"resumed1": ("full2", 1), "resumed2": ("full1", 2)}
    for run, (origin, nproc) in resumed.items():
        _train(
            tmp_path,
            "--output-dir",
            str(tmp_path / run),
            *flags,
            "--resume",
            str(_checkpoint(tmp_path / origin, 6)),
            nproc=nproc,
        )
    records = {run: _records(tmp_path / run, "train") for run in ("full2", "full1", *resumed)}
    assert [r["epoch"] for r in records["full2"]] == [0] * 7 + [1] * 2
    single, ddp = records["full1"], records["full2"]
    assert [r["tokens"] for r in single] == [r["tokens"] for r in ddp]
    assert len({r["tokens"] for r in ddp}) > 1 and max(r["tokens"] for r in ddp) < 8 * 256, "premise: padding"
    for a, b in zip(single, ddp, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=0), (a["step"], a["loss"], b["loss"])
    eval_single, eval_ddp = (_records(tmp_path / run, "eval")[-1]["eval_loss"] for run in ("full1", "full2"))
    assert eval_ddp == pytest.approx(eval_single, rel=1e-5, abs=0)  # measured 2.2e-6 after 9 steps
    for run in resumed:
        assert [r["step"] for r in records[run]] == [7, 8, 9]
        for full in ("full2", "full1"):
            expected = records[full][6:]
            assert [r["tokens"] for r in records[run]] == [r["tokens"] for r in expected], (run, full)
            for a, b in zip(expected, records[run], strict=True):
                assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=0), (run, full, a["step"])


def test_uneven_epoch_same_steps_on_one_and_two_ranks(
    tmp_path,
):
    """7 training samples, effective batch 2: floor(7 / 2) = 3 steps per epoch on 1 and on 2 processes, the trailing
    sample dropped (a padding DistributedSampler gave 2 ranks 8 samples: a 4th step, one sample trained twice), and
    the log says so once. Epochs-based: total_steps = 2 epochs x 3 on both. With --eval-fraction 0 there is no eval loss to log."""
    source = write_mixed_length_meetings(tmp_path / "seven.jsonl", n=7)
    flags = [
        "--source",
        source,
        "--eval-fraction",
        "0",
        "--effective-batch",
        "2",
        "--micro-batch",
        "1",
        "--max-steps=-1",
        "--epochs",
        "2",
        "--lora-dropout",
        "0",
        "--report-to",
        "none",
        "--save-every",
        "0",
    ]
    single_run = _train(tmp_path, "--output-dir", str(tmp_path / "single"), *flags, nproc=1)
    ddp_run = _train(tmp_path, "--output-dir", str(tmp_path / "ddp"), *flags)
    for run in (single_run, ddp_run):  # said once, by rank 0: how many samples an epoch leaves out, and why
        said = "an epoch is 3 optimizer steps of 2 samples: the last 1 of the 7 training samples"
        assert run.stderr.count(said) == 1, run.stderr[-3000:]
    for run in ("single", "ddp"):
        assert _records(tmp_path / run, "config")[0]["total_steps"] == 6, run
        assert not _records(tmp_path / run, "eval"), run  # no eval split: no eval loss (it was logged as 0.0)
    single, ddp = _records(tmp_path / "single", "train"), _records(tmp_path / "ddp", "train")
    assert (
        [(r["step"], r["epoch"]) for r in ddp]
        == [(r["step"], r["epoch"]) for r in single]
        == [(1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 1)]
    )
    assert [r["tokens"] for r in single] == [r["tokens"] for r in ddp]
    for a, b in zip(single, ddp, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=0), a["step"]


def test_two_rank_runs_keep_the_newest_checkpoints(reference_run):
    """Under torchrun --save-total-limit 2 kept 6 and 8 of 2, 4, 6, 8. The loop prunes only its own checkpoints
    (``test_checkpoint``), and a new run never starts in a folder an earlier run filled (``test_bad_input``)."""
    assert sorted(p.name for p in reference_run.glob("*checkpoint-*")) == ["ddp_ft-checkpoint-6", "ddp_ft-checkpoint-8"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_keep_global_and_local_rank_apart(tmp_path):
    out = tmp_path / "run"
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        subprocess.Popen(
            [
                TORCHRUN,
                "--nnodes=2",
                "--nproc_per_node=1",
                f"--node_rank={node}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint={endpoint}",
                "--rdzv_id=ddp_ft_test",
                str(ROOT / "scripts" / "train.py"),
                "--preset",
                "tiny",
                "--max-steps",
                "2",
                "--output-dir",
                str(out),
            ],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=400) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-6000:]
    config = _records(out, "config")
    assert len(config) == 1, "rank-0 duties ran on more than one process"
    assert config[0]["world_size"] == 2
    first = config[0]["first_batch_indices"]
    assert len(first) == 2 and not set(first[0]) & set(first[1]), "both ranks read the same shard"
    assert [r["step"] for r in _records(out, "train")] == [1, 2]
    assert len(list(out.glob("ddp_ft-checkpoint-*"))) == 1


def test_packed_chat_trains_alike_on_one_and_two_ranks(tmp_path):
    """Multi-turn chats (``messages``), packed and balanced: 2 processes and 1 see the same tokens each step and
    follow the same loss curve, and 1 process resumes on the 2-process checkpoint with the uninterrupted run's
    losses. The data path after formatting is the pair format's, so every guarantee it has holds for chats."""
    source = write_chat_meetings(tmp_path / "chat.jsonl", n=40)
    flags = ["--source", source, "--packing", "true", "--lora-dropout", "0", "--report-to", "none"]
    flags += ["--max-steps", "4", "--save-every", "2", "--save-total-limit", "0"]
    two = _train(tmp_path, "--output-dir", str(tmp_path / "two"), *flags)
    assert "data format messages (messages): from its columns" in two.stderr
    _train(tmp_path, "--output-dir", str(tmp_path / "one"), *flags, nproc=1)
    resume = ["--resume", str(_checkpoint(tmp_path / "two", 2))]
    _train(tmp_path, "--output-dir", str(tmp_path / "resumed"), *flags, *resume, nproc=1)
    one, two_records, resumed = (_records(tmp_path / run, "train") for run in ("one", "two", "resumed"))
    assert [r["tokens"] for r in one] == [r["tokens"] for r in two_records]
    for a, b in zip(one, two_records, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=0), (a["step"], a["loss"], b["loss"])
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(one[2:], resumed, strict=True):
        assert (b["tokens"], b["loss"]) == (a["tokens"], pytest.approx(a["loss"], rel=1e-6, abs=0))
