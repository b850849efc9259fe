"""Every refused setting and input, one row each (docs/failures.md).

Each row goes through the real entry in process: the command line (``parse_settings``) and then the plain loop
(``ddp_ft.training.loop.train``), the Trainer recipe's ``build_trainer``, or Accelerate's config checks. Each asserts
the error type and a fragment naming the setting, that the model never loaded, and that the checkpoint already in
--output-dir is byte for byte what it was. The one 2-rank row (world size larger than the dataset) runs under torchrun,
which also shows the exit code and the message on stderr.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_ft.distributed import DistInfo
from ddp_ft.distributed.launch import check_accelerate_config, check_accelerate_launch
from ddp_ft.integrations import recipe
from ddp_ft.training import loop, setup
from ddp_ft.training.checkpoint import FORMAT_VERSION, TrainState, save_checkpoint
from ddp_ft.training.config import parse_settings
from ddp_ft.training.data import DataLayout, load_raw_splits

from ..helpers.checkpoints import trainer_checkpoint, training_parts
from ..helpers.dist_harness import PYTHONPATH

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--preset", "tiny", "--num-synthetic", "24", "--report-to", "none"]  # 23 training samples, 1 eval
SAVED = {"effective_batch": 4, "seed": 42, "micro_batch": 2}  # the layout of the checkpoint in --output-dir


def _jsonl(rows):
    return lambda d: d.write("data.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def _checkpoint_copy(damage):
    """A copy of the saved checkpoint outside --output-dir, damaged by ``damage(folder)``; the rows resume it at
    its own effective batch, so the damage is the only thing wrong."""

    def make(d):
        copy = d.tmp / "copy" / "ddp_ft-checkpoint-2"
        shutil.copytree(d.checkpoint, copy)
        damage(copy)
        return str(copy)

    return make


def _cut(name):
    """``name`` cut to half its bytes, as a copy or transfer that stopped early leaves it."""
    return lambda folder: (folder / name).write_bytes(
        (folder / name).read_bytes()[: (folder / name).stat().st_size // 2]
    )


def _other_format(folder):
    state = json.loads((folder / "ddp_ft_state.json").read_text())
    (folder / "ddp_ft_state.json").write_text(json.dumps({**state, "format_version": FORMAT_VERSION + 1}))


def _trainer_folder(d):
    trainer_checkpoint(d.tmp / "trainer" / "checkpoint-3")
    return str(d.tmp / "trainer" / "checkpoint-3")


def _plain_folder(d):
    (d.tmp / "notes").mkdir()
    (d.tmp / "notes" / "readme.txt").write_text("not a checkpoint")
    return str(d.tmp / "notes")


def _config(text):
    head = "compute_environment: LOCAL_MACHINE\nmachine_rank: 0\nmain_process_ip: 127.0.0.1\nmain_process_port: 0\n"
    return lambda d: d.write("config.yaml", head + text)


_MEETING = {"dialogue": "A: we pick the red case. B: agreed, red it is.", "summary": "They chose the red case."}
_LONG_INSTRUCTION = "Summarize the meeting below in one short paragraph. " * 6

# id -> (entry, flags (str, or a function of the test's Inputs returning a str), error type, message fragment)
#   parse: the command line only; train: command line + ddp_ft.training.loop.train; recipe: command line + build_trainer
# with   the environment `accelerate launch` exports; config: an accelerate config file; cuda-launch: the exported
#   environment checked as on a CUDA machine (none here).
ROWS = {
    "bucket_cap_mb<=0": (
        "parse",
        ["--bucket-cap-mb", "0"],
        ValueError,
        "bucket_cap_mb=0.0: must be a positive number of MiB",
    ),
    "first_bucket_cap_mb=nan": (
        "parse",
        ["--first-bucket-cap-mb", "nan"],
        ValueError,
        "first_bucket_cap_mb=nan: must be a positive number of MiB",
    ),
    "unknown comm_hook": (
        "parse",
        ["--comm-hook", "int8"],
        ValueError,
        "comm_hook='int8': choose one of allreduce, bf16, fp16, powersgd",
    ),
    "powersgd_start_iter<2": (
        "parse",
        ["--comm-hook", "powersgd", "--powersgd-start-iter", "1"],
        ValueError,
        "powersgd_start_iter=1",
    ),
    "unknown preset": ("parse", ["--preset", "qwen-huge"], SystemExit, "unknown --preset 'qwen-huge'; choose one of"),
    "effective_batch<1": ("parse", ["--effective-batch", "0"], ValueError, "effective_batch=0: must be >= 1"),
    "max_seq_len below the floor": (
        "parse",
        ["--max-seq-len", "32"],
        ValueError,
        "DataSettings.max_seq_len=32: must be >= 64",
    ),
    "effective batch not micro x world": (
        "train",
        ["--effective-batch", "7"],
        ValueError,
        "effective_batch=7 is not divisible by micro_batch=2 x world_size=1",
    ),
    "max_seq_len below the template": (
        "train",
        ["--max-seq-len", "64", "--instruction", _LONG_INSTRUCTION],
        ValueError,
        "DataSettings.max_seq_len=64 is too small for this tokenizer",
    ),
    "missing column": (
        "train",
        ["--source", _jsonl([{"transcript": "a b", "summary": "c"}] * 12)],
        ValueError,
        "missing column(s) 'dialogue' (--dialogue-column, DataSettings.dialogue_column)",
    ),
    "empty file": ("train", ["--source", lambda d: d.write("empty.jsonl", "")], ValueError, "the file is empty"),
    "only empty rows": (
        "train",
        ["--source", _jsonl([{"dialogue": " ", "summary": "x"}] * 12)],
        ValueError,
        "all 12 rows of split 'train' have an empty dialogue or summary",
    ),
    "fewer samples than one effective batch": (
        "train",
        ["--source", _jsonl([_MEETING] * 7), "--eval-fraction", "0"],
        ValueError,
        "has 7 samples, fewer than one effective batch (effective_batch=8): lower --effective-batch",
    ),
    "resume: a Trainer checkpoint": (
        "train",
        ["--resume", _trainer_folder],
        ValueError,
        "is a Hugging Face Trainer checkpoint",
    ),
    "resume: not a checkpoint": (
        "train",
        ["--resume", _plain_folder],
        FileNotFoundError,
        "is not a ddp_ft checkpoint (no ddp_ft_state.json)",
    ),
    "resume: another format_version": (
        "train",
        ["--resume", _checkpoint_copy(_other_format), "--effective-batch", "4"],
        ValueError,
        f"checkpoint format_version {FORMAT_VERSION + 1}, but this ddp_ft reads format_version {FORMAT_VERSION}",
    ),
    "resume: state file cut short": (
        "train",
        ["--resume", _checkpoint_copy(_cut("ddp_ft_state.json")), "--effective-batch", "4"],
        ValueError,
        "is damaged: ddp_ft_state.json is not a JSON object",
    ),
    "resume: optimizer.pt cut short": (
        "train",
        ["--resume", _checkpoint_copy(_cut("optimizer.pt")), "--effective-batch", "4"],
        ValueError,
        "is damaged: optimizer.pt is cut short",
    ),
    "resume: another effective batch": (
        "train",
        ["--resume", "latest", "--effective-batch", "8"],
        ValueError,
        "Resume with --effective-batch 4",
    ),
    "resume: other data": (
        "train",
        ["--resume", "latest", "--effective-batch", "4", "--num-synthetic", "40"],
        ValueError,
        "the training set changed (23 -> 38 samples)",
    ),
    "resume: another seed": (
        "train",
        ["--resume", "latest", "--effective-batch", "4", "--seed", "7"],
        ValueError,
        "Resume with --seed 42",
    ),
    "accelerate distributed_type FSDP": (
        "recipe",
        {"ACCELERATE_USE_FSDP": "true"},
        ValueError,
        "accelerate config distributed_type=FSDP",
    ),
    "accelerate distributed_type DEEPSPEED": (
        "recipe",
        {"ACCELERATE_USE_DEEPSPEED": "true"},
        ValueError,
        "accelerate config distributed_type=DEEPSPEED",
    ),
    "accelerate distributed_type FSDP, the loop": (
        "train-launch",
        {"ACCELERATE_USE_FSDP": "true"},
        ValueError,
        "accelerate config distributed_type=FSDP (ACCELERATE_USE_FSDP",
    ),
    "accelerate mixed_precision fp16": (
        "recipe",
        {"ACCELERATE_MIXED_PRECISION": "fp16"},
        ValueError,
        "accelerate config mixed_precision='fp16'",
    ),
    "accelerate mixed_precision bf16 on CPU": (
        "recipe",
        {"ACCELERATE_MIXED_PRECISION": "bf16"},
        ValueError,
        "mixed_precision='bf16' (ACCELERATE_MIXED_PRECISION): the recipe sets",
    ),
    "recipe: float16 on the CPU": (
        "recipe",
        ["--compute-dtype", "float16"],
        ValueError,
        "--compute-dtype float16 on the CPU with the Trainer recipe: Accelerate has no "
        "float16 autocast or loss scaler on the CPU",
    ),
    "accelerate use_cpu with CUDA": (
        "cuda-launch",
        {"ACCELERATE_USE_CPU": "True"},
        ValueError,
        "accelerate config use_cpu=true (ACCELERATE_USE_CPU) while CUDA is available",
    ),
    "config: 'NO' with num_processes 2": (
        "config",
        _config("distributed_type: 'NO'\nnum_machines: 1\nnum_processes: 2\nmixed_precision: 'no'\nuse_cpu: false\n"),
        ValueError,
        "num_processes=2 in",
    ),
    "config: use_cpu with num_processes 2": (
        "config",
        _config(
            "distributed_type: MULTI_CPU\nnum_machines: 1\nnum_processes: 2\nmixed_precision: 'no'\nuse_cpu: true\n"
        ),
        ValueError,
        "with use_cpu: true accelerate launch starts one process",
    ),
    "config: MULTI_GPU with num_processes 1": (
        "config",
        _config(
            "distributed_type: MULTI_GPU\nnum_machines: 1\nnum_processes: 1\nmixed_precision: 'no'\nuse_cpu: false\n"
        ),
        ValueError,
        "distributed_type MULTI_GPU needs at least 2",
    ),
    "config: num_processes not per machine": (
        "config",
        _config(
            "distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 3\nmixed_precision: 'no'\nuse_cpu: false\n"
        ),
        ValueError,
        "is not divisible by num_machines=2",
    ),
    "config: distributed_type FSDP": (
        "config",
        _config("distributed_type: FSDP\nnum_machines: 1\nnum_processes: 2\nmixed_precision: 'no'\nuse_cpu: false\n"),
        ValueError,
        "accelerate config distributed_type=FSDP in",
    ),
    "config: mixed_precision fp16": (
        "config",
        _config(
            "distributed_type: MULTI_GPU\nnum_machines: 1\nnum_processes: 2\nmixed_precision: fp16\nuse_cpu: false\n"
        ),
        ValueError,
        "accelerate config mixed_precision='fp16' (in",
    ),
}


class Inputs:
    """What a row's flags point at, written under the test's tmp_path on demand."""

    def __init__(self, tmp: Path, checkpoint: Path) -> None:
        self.tmp, self.checkpoint = tmp, checkpoint

    def write(self, name: str, text: str) -> str:
        (self.tmp / name).write_text(text)
        return str(self.tmp / name)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class ModelLoaded(AssertionError):
    """A row that should fail before the model loads reached the loader."""


@pytest.fixture
def run_dir(tmp_path, tiny_cache, monkeypatch):
    """--output-dir holding a saved checkpoint of this data (23 samples) at effective batch 4, step 2; the model
    loaders armed to fail the test."""
    monkeypatch.setenv("DDP_FT_CACHE", tiny_cache)
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)

    def loaded(*args, **kwargs):
        raise ModelLoaded("the model loaded before the bad input was refused")

    for module in (setup, recipe):  # the loop builds through setup.build_training_model
        monkeypatch.setattr(module, "build_model", loaded)
    monkeypatch.setattr(setup, "load_qlora_model", loaded)
    run = tmp_path / "run"
    samples = len(load_raw_splits(parse_settings(BASE).data)["train"])
    layout = DataLayout(train_samples=samples, world_size=1, **SAVED)
    model, optimizer, scheduler = training_parts()
    save_checkpoint(run, model, optimizer, scheduler, TrainState(2, 0, 8, 8), DistInfo(), layout=layout)
    return run


@pytest.mark.parametrize("row", list(ROWS))
def test_named_refusal_before_load_keeps_checkpoint(row, run_dir, tmp_path, monkeypatch, capsys):
    entry, flags, error, fragment = ROWS[row]
    before = _snapshot(run_dir)
    assert len(before) >= 6, "premise: a complete checkpoint and latest"
    inputs = Inputs(tmp_path, run_dir / "ddp_ft-checkpoint-2")
    with pytest.raises(error) as raised:
        if entry in ("parse", "train", "recipe", "train-launch"):
            argv = [*BASE, "--output-dir", str(run_dir)]
            if entry in ("recipe", "train-launch") and isinstance(flags, dict):  # what accelerate launch exported
                for name, value in flags.items():
                    monkeypatch.setenv(name, value)
            else:
                argv += [flag(inputs) if callable(flag) else flag for flag in flags]
            settings = parse_settings(argv)
            if entry in ("train", "train-launch"):
                loop.train(settings, DistInfo())
            elif entry == "recipe":
                recipe.build_trainer(settings, DistInfo())
        elif entry == "config":
            check_accelerate_config(flags(inputs))
        else:
            check_accelerate_launch(flags, cuda=True)
    message = capsys.readouterr().err if error is SystemExit else str(raised.value)
    if error is SystemExit:
        assert raised.value.code not in (0, None)
    assert fragment in message, message
    assert _snapshot(run_dir) == before, "the checkpoint in --output-dir changed"


# What an earlier run leaves in its --output-dir, each enough to refuse a new run there (None: run_dir's checkpoint).
EARLIER = {
    "the loop's checkpoint": None,
    "a Trainer checkpoint": "checkpoint-3/trainer_state.json",
    "final/": "final/adapter_model.safetensors",
    "metrics.jsonl with a step": "metrics.jsonl",
}
CONFIG_ROW, TRAIN_ROW = json.dumps({"type": "config"}) + "\n", json.dumps({"type": "train", "step": 1}) + "\n"


def _used_folder(run_dir: Path, held: str | None, name: str = "used", text: str = CONFIG_ROW + TRAIN_ROW) -> Path:
    if held is None:
        return run_dir
    folder = run_dir.parent / name
    (folder / held).parent.mkdir(parents=True, exist_ok=True)
    (folder / held).write_text(text)
    return folder


@pytest.mark.parametrize("held", list(EARLIER))
@pytest.mark.parametrize("entry", ["train", "recipe"])
def test_new_run_in_a_used_folder_refused_kept(entry, held, run_dir):
    """A new run (no --resume) where an earlier one saved is refused before the model loads, naming --resume latest;
    the earlier run's files stay as they were (a run would replace final/, rotate checkpoints, mix metrics)."""
    from ddp_ft.commands.recipe import _train

    folder = _used_folder(run_dir, EARLIER[held])
    before = _snapshot(folder)
    settings = parse_settings([*BASE, "--output-dir", str(folder)])
    with pytest.raises(ValueError, match=r"holds an earlier run \(.*\).*Continue that run with --resume latest"):
        loop.train(settings, DistInfo()) if entry == "train" else _train(settings, DistInfo(), "hf")
    assert _snapshot(folder) == before


def test_elastic_restart_reuses_its_folder(run_dir, monkeypatch):
    """torchrun's restart of a run that saved no checkpoint yet (only its metrics.jsonl) goes on in its folder, and
    so does a new run where one was refused (its logs/) or stopped before its first step (metrics.jsonl without a
    step): each reaches the model (armed to fail here)."""
    folder = _used_folder(run_dir, "metrics.jsonl")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(ModelLoaded):
        loop.train(parse_settings([*BASE, "--output-dir", str(folder)]), DistInfo())
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    refused = _used_folder(run_dir, "logs/console.log", "refused")
    stopped = _used_folder(run_dir, "metrics.jsonl", "stopped", CONFIG_ROW)
    for folder in (refused, stopped):
        with pytest.raises(ModelLoaded):
            loop.train(parse_settings([*BASE, "--output-dir", str(folder)]), DistInfo())


# A resume's settings changed from the run that wrote the checkpoint; then changes a resume may make.
CHANGED = ["--lora-alpha", "64", "--max-seq-len", "128", "--learning-rate", "0.5"]
ALLOWED = ["--max-steps", "9", "--micro-batch", "1", "--no-compile", "--save-every", "3"]


@pytest.mark.parametrize("entry", ["train", "recipe"])
def test_resume_with_changed_settings_refused(entry, run_dir, caplog):
    """--resume with the LoRA alpha, sequence length and learning rate changed from the run it continues (its
    run_config.yaml) is refused before the model loads, naming each old value: the optimizer's saved learning rate
    would silently win, the others would change the run half-way. Steps, micro-batch, compile and saving may change;
    another length is warned about once (the schedule is recomputed), the same length is not."""
    from ddp_ft.commands.recipe import _train
    from ddp_ft.training.config import write_run_config

    argv = [*BASE, "--effective-batch", "4", "--output-dir", str(run_dir)]
    old = parse_settings(argv)
    write_run_config(old, DistInfo())
    if entry == "recipe":
        trainer_checkpoint(run_dir / "checkpoint-2")
    was = f"--lora-alpha {old.lora.lora_alpha} --max-seq-len {old.data.max_seq_len} "
    was += f"--learning-rate {old.train.learning_rate}"
    planned = f"{old.train.max_steps} optimizer steps" if old.train.max_steps else f"{old.train.epochs} epoch(s)"
    for flags, outcome in ((CHANGED, ValueError), (ALLOWED, ModelLoaded), (ALLOWED[2:], ModelLoaded)):
        settings = parse_settings([*argv, *flags, "--resume", "latest"])
        caplog.clear()
        with pytest.raises(outcome) as raised:
            loop.train(settings, DistInfo()) if entry == "train" else _train(settings, DistInfo(), "hf")
        if outcome is ValueError:
            assert "--lora-alpha 64, --max-seq-len 128, --learning-rate 0.5, but" in str(raised.value)
            assert f"trained with {was}" in str(raised.value), str(raised.value)
        warned = [r.getMessage() for r in caplog.records if "the run it continues was planned for" in r.getMessage()]
        assert len(warned) == (flags is ALLOWED), warned
        if flags is ALLOWED:
            assert f"planned for {planned}, this one for 9 optimizer steps" in warned[0]


def test_shipped_accelerate_configs_pass_the_checks():
    configs = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
    assert len(configs) == 4
    for path in configs:
        check_accelerate_config(path, cuda="gpu" in path.stem)


@pytest.mark.distributed
def test_one_sample_two_ranks_fails_naming_world_size(tmp_path, tiny_cache, run_dir):
    """World size larger than the dataset, as users meet it: every rank refuses before the model loads, torchrun
    exits non-zero, and the message is on stderr."""
    before = _snapshot(run_dir)
    source = tmp_path / "one.jsonl"
    source.write_text(json.dumps(_MEETING) + "\n")
    command = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "scripts" / "train.py"),
        *BASE,
        "--source",
        str(source),
        "--eval-fraction",
        "0",
        "--effective-batch",
        "2",
        "--micro-batch",
        "1",
        "--output-dir",
        str(run_dir),
    ]
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": PYTHONPATH,
        "DDP_FT_CACHE": tiny_cache,
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode != 0
    message = "the training set has 1 samples, fewer than one effective batch (effective_batch=2): fewer than the 2"
    assert run.stderr.count(message) >= 2, run.stderr[-4000:]  # both ranks
    assert "world_size=2 ranks needs: run fewer processes" in run.stderr
    assert "loaded " not in run.stderr and "Loading weights" not in run.stderr, "the model loaded"
    assert _snapshot(run_dir) == before
