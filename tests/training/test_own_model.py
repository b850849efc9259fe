"""A user's own model: a tiny Llama saved with its own tokenizer, which has no chat template, trains with
``ddp-ft train --model-name-or-path DIR --source my.jsonl --nproc 2`` and nothing else, on the plain template and
without a token added; ``train`` and ``recipe`` start from the same default when no model is named; a hub id that
cannot be reached fails in seconds, naming the fixes; sequences past a model's learned positions are refused before
training or generating, and those past its rotary trained ones warned."""

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_ft.commands import cli
from ddp_ft.report.metrics import read_jsonl
from ddp_ft.training.config import parse_settings
from ddp_ft.training.data import IGNORE_INDEX, DataSettings, load_raw_splits, tokenize_dataset
from ddp_ft.training.data.synthetic import generate_synthetic_meetings
from ddp_ft.training.data.tokenizer import PLAIN_SEPARATOR, load_tokenizer
from ddp_ft.training.model.source import choose_default

from ..helpers.dist_harness import PYTHONPATH

ROWS = 40  # 5% held out: 38 training samples, 2 steps per epoch at the default effective batch 16, 3 epochs


def _save_tiny_llama(folder: Path) -> None:
    """A byte-level BPE like Llama's (``<s>`` added before every text, ``</s>`` eos, no pad, no chat template) and a
    random Llama (about 200K parameters) whose embedding has exactly its vocabulary, saved as a user would."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = [m[key] for m in generate_synthetic_meetings(80, seed=3) for key in ("dialogue", "summary")]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    assert tokenizer.chat_template is None and tokenizer.pad_token is None
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> tuple[Path, Path]:
    """(model folder, data file): the tiny Llama and ROWS short meetings in a JSONL of dialogue/summary."""
    root = tmp_path_factory.mktemp("own")
    _save_tiny_llama(root / "llama")
    rows = [
        {"dialogue": " ".join(m["dialogue"].split()[:60]), "summary": " ".join(m["summary"].split()[:24])}
        for m in generate_synthetic_meetings(ROWS, seed=5)
    ]
    data = root / "my.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root / "llama", data


def _gpt2_beside(llama: Path, folder: Path, positions: int) -> Path:
    """A random tiny GPT-2 with learned position embeddings for ``positions`` tokens, and the Llama's tokenizer."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(llama)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=positions)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **extra}


def test_base_tokenizer_gets_plain_format_no_new_token(own, tmp_path):
    model_dir, data = own
    tokenizer = load_tokenizer(str(model_dir))
    assert len(tokenizer) == json.loads((model_dir / "config.json").read_text())["vocab_size"]
    assert (tokenizer.pad_token, tokenizer.padding_side) == ("</s>", "right")
    settings = DataSettings(source=str(data), eval_fraction=0.0)
    dataset, _ = tokenize_dataset(load_raw_splits(settings, cache_dir=str(tmp_path))["train"], tokenizer, settings)
    separator = tokenizer(PLAIN_SEPARATOR, add_special_tokens=False)["input_ids"]
    for ids, labels in zip(dataset["input_ids"][:5], dataset["labels"][:5], strict=True):
        prompt = labels.count(IGNORE_INDEX)
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
        assert ids[prompt - len(separator) : prompt] == separator  # the prompt ends with the generation prompt
        assert labels[prompt:] == ids[prompt:] and labels[-1] == tokenizer.eos_token_id  # the answer learns to stop
        assert max(ids) < len(tokenizer)


@pytest.mark.distributed
@pytest.mark.slow
def test_llama_without_template_trains_with_no_flags(own, tmp_path):
    model_dir, data = own
    command = [sys.executable, "-m", "ddp_ft.commands.cli", "train", "--model-name-or-path", str(model_dir)]
    command += ["--source", str(data), "--nproc", "2"]
    run = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-6000:]
    lines = [line for line in run.stderr.splitlines() if "[rank0]" in line and "bitsandbytes:" not in line]
    first = lines[0]  # after the upstream bitsandbytes notice that logging's setup releases, the run's first line
    assert f"model {model_dir}, preset none (--model-name-or-path names the model" in first, first
    assert "2 process(es)" in first
    assert run.stderr.count("chat template: plain") == 1, run.stderr[-6000:]  # logged once, by rank 0
    records = read_jsonl(tmp_path / "runs" / model_dir.name / "metrics.jsonl")  # the default: named after the model
    config = next(r for r in records if r["type"] == "config")
    assert config["world_size"] == 2
    assert [r["step"] for r in records if r["type"] == "train"] == list(range(1, 7))  # 2 steps x 3 epochs


@pytest.mark.parametrize("command", ["train", "recipe"])
@pytest.mark.parametrize("named", [False, True])
def test_train_and_recipe_share_the_default_model_rule(command, named, own, monkeypatch, caplog):
    from ddp_ft.commands import recipe, train

    ran = {}
    monkeypatch.setattr(train, "train", lambda settings, info: ran.setdefault("settings", settings))
    monkeypatch.setattr(recipe, "_train", lambda settings, info, *rest: ran.setdefault("settings", settings))
    for module in (train, recipe):
        monkeypatch.setattr(module, "setup_logging", lambda info: None)  # keep pytest's log capture
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["--model-name-or-path", str(own[0])] if named else []
    with caplog.at_level(logging.INFO, logger="ddp_ft.training.model.source"):
        cli.main([command, *argv])
    settings = ran["settings"]
    if named:  # no preset imposed: the dataclass defaults and the user's flags
        assert (settings.preset, settings.model.model_name_or_path) == ("", str(own[0]))
        assert (settings.data.source, settings.train.effective_batch) == ("knkarthick/AMI", 16)
        assert "preset none (--model-name-or-path names the model" in caplog.text
    else:
        assert (settings.preset, settings.model.model_name_or_path) == ("tiny", "embedded:tiny-qwen3")
        assert "preset tiny (no model named and no CUDA: the embedded default, offline" in caplog.text


def test_default_rule_reads_flags_and_the_config_file(tmp_path):
    with_model, with_preset, bare = (tmp_path / name for name in ("model.yaml", "preset.yaml", "bare.yaml"))
    with_model.write_text("model_name_or_path: my/model\n")
    with_preset.write_text("preset: tiny\n")
    bare.write_text("micro_batch: 2\n")
    assert choose_default([], cuda=False).preset == "tiny"
    assert choose_default([], cuda=True).preset == "qwen3-4b-ami"
    assert choose_default(["--config", str(bare)], cuda=False).preset == "tiny"  # names no model
    for argv in (["--model_name_or_path=x"], ["--preset", "tiny"], ["--config", str(with_model)]):
        assert choose_default(argv, cuda=False).preset == "", argv
    assert choose_default(["--config", str(with_preset)], cuda=True).preset == ""  # the file's preset wins
    settings = parse_settings(["--config", str(bare)], default_preset=choose_default(["--config", str(bare)]).preset)
    assert (settings.preset, settings.train.micro_batch) == ("tiny", 2)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed: connections are refused at once


@pytest.mark.parametrize("offline", ["0", "1"])
def test_unreachable_hub_id_fails_fast_naming_fixes(offline, tmp_path):
    env = _env(HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", HF_HUB_OFFLINE=offline, HF_HOME=str(tmp_path / "hf"))
    command = [
        sys.executable,
        "-m",
        "ddp_ft.commands.cli",
        "train",
        "--model-name-or-path",
        "Qwen/Qwen3-4B",
        "--nproc",
        "2",
    ]
    start = time.perf_counter()
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert run.returncode == 2, run.stderr[-3000:]
    assert "--model-name-or-path Qwen/Qwen3-4B: not in the local hub cache" in run.stderr
    assert "--model-name-or-path a local folder" in run.stderr and "--preset tiny" in run.stderr
    assert "torch.distributed.run" not in run.stderr and "[rank" not in run.stderr  # no worker started
    assert elapsed < 20, elapsed  # the hub's own retries took about 28 s per file


def _short_rows(data: Path, folder: Path) -> Path:
    """``data`` cut to 16 words a field: prompts of about 40 tokens, which leave room for generated ones."""
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    short = folder / "short.jsonl"
    short.write_text("".join(json.dumps({k: " ".join(v.split()[:16]) for k, v in r.items()}) + "\n" for r in rows))
    return short


def _own_run(model: Path, data: Path, out: Path, *flags: str):
    from ddp_ft.distributed import DistInfo
    from ddp_ft.training.loop import train

    argv = ["--model-name-or-path", str(model), "--source", str(data), "--output-dir", str(out), "--max-steps", "1"]
    return train(parse_settings([*argv, *flags]), DistInfo())


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (
            ["--max-seq-len", "100"],
            r"--max-seq-len 100: sequences up to 104 positions wide, padding included.* Set --max-seq-len 96",
        ),
        (["--max-seq-len", "96", "--predict", "1", "--max-new-tokens", "40"], r"Set --max-new-tokens \d+ or less"),
    ],
)
@pytest.mark.parametrize("entry", ["train", "recipe"])
def test_learned_positions_past_the_model_refused(entry, flags, refusal, own, tmp_path, monkeypatch):
    """GPT-2 has a position embedding row per position: a longer sequence, a micro-batch padded to a multiple of 8
    or a prediction, would be an index error mid-run (on a GPU, a device-side assert). Refused before training."""
    from ddp_ft.commands import recipe, train

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = _gpt2_beside(own[0], tmp_path / "gpt2", positions=100)
    argv = ["--model-name-or-path", str(model), "--source", str(_short_rows(own[1], tmp_path)), "--max-steps", "1"]
    with pytest.raises(ValueError, match=refusal):
        (train if entry == "train" else recipe).main([*argv, "--output-dir", str(tmp_path / "run"), *flags])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_rotary_past_trained_positions_warns(own, tmp_path, caplog):
    """The tiny Llama was trained on 512 positions: at --max-seq-len 600 its rotary positions extrapolate, which the
    run says once, and trains as asked."""
    with caplog.at_level(logging.WARNING, logger="ddp_ft.training.setup"):
        result = _own_run(own[0], own[1], tmp_path / "run", "--max-seq-len", "600")
    warned = [r.getMessage() for r in caplog.records if "positions" in r.getMessage()]
    assert len(warned) == 1 and "600 tokens long, past the 512 positions llama was trained on" in warned[0], warned
    assert result.steps == 1


def test_generate_past_learned_positions_refused(own, tmp_path):
    """``ddp-ft generate`` checks its prompts and ``--max-new-tokens`` against GPT-2's positions before writing."""
    from ddp_ft.commands import generate

    model = _gpt2_beside(own[0], tmp_path / "gpt2", positions=100)
    _own_run(model, _short_rows(own[1], tmp_path), tmp_path / "run", "--max-seq-len", "96")
    argv = [str(tmp_path / "run"), "--prompt", "A: the budget? B: twelve euros.", "--out", str(tmp_path / "p.jsonl")]
    with pytest.raises(SystemExit, match=r"--prompt with --max-new-tokens 99, after a prompt of \d+ tokens: .* Set --"):
        generate.main([*argv, "--max-new-tokens", "99"])
    assert not (tmp_path / "p.jsonl").exists()
