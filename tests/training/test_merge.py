"""``ddp-ft merge``: a run's final adapter, saved with its tokenizer, merged into its base. The merged model computes
what the adapter computed on its NF4 base; merged into the original weights instead, it differs by the NF4 error."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from ddp_ft.commands import cli
from ddp_ft.distributed import DistInfo
from ddp_ft.training.checkpoint import DATA_FILE, FINAL_DIR, save_final
from ddp_ft.training.data import DataSettings
from ddp_ft.training.data.tokenizer import load_tokenizer
from ddp_ft.training.model.merge import (
    MergePlan,
    MergeSettings,
    find_adapter,
    load_base_to_merge,
    merge_adapter,
    plan_merge,
)
from ddp_ft.training.model.qlora import EMBEDDED_MODEL, LoraSettings, ModelSettings, load_qlora_model
from ddp_ft.training.setup import resolve_model_and_tokenizer

from ..helpers.dist_harness import PYTHONPATH

# float32 compute on the CPU: the merged weight W + s*B@A against W@x + s*B@(A@x), summed in another order.
FLOAT32_TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run folder whose ``final/`` holds a tiny QLoRA adapter with random, nonzero LoRA weights."""
    model_path, tokenizer_path = resolve_model_and_tokenizer(EMBEDDED_MODEL, DistInfo())
    settings = ModelSettings(model_path, compute_dtype="float32", gradient_checkpointing=False, compile=False)
    torch.manual_seed(0)
    # no dropout: the 4-bit reference runs in train mode
    model = load_qlora_model(settings, LoraSettings(lora_r=8, lora_dropout=0.0), {"": "cpu"})
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)  # peft starts B at zero: the adapter would change nothing
    run = tmp_path_factory.mktemp("merge") / "run"
    save_final(run, model, load_tokenizer(tokenizer_path), DataSettings(source="synthetic"), DistInfo())
    return run


def _logits(model: torch.nn.Module, train_mode: bool = False) -> torch.Tensor:
    """Logits of fixed inputs. The 4-bit reference runs in train mode: in eval mode under no_grad, bitsandbytes on a
    CPU with AVX512-BF16 repacks the weight and computes in bfloat16, whatever the compute dtype."""
    ids = torch.randint(3, 1000, (2, 32), generator=torch.Generator().manual_seed(1))
    model.train(train_mode)
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _adapter_on(run_dir: Path, load_in_4bit: bool) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base_path = json.loads((run_dir / FINAL_DIR / "adapter_config.json").read_text())["base_model_name_or_path"]
    quantized = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    kwargs = {"quantization_config": quantized} if load_in_4bit else {}
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, device_map={"": "cpu"}, **kwargs)
    return _logits(PeftModel.from_pretrained(base, str(run_dir / FINAL_DIR)), train_mode=True)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": PYTHONPATH, "TOKENIZERS_PARALLELISM": "false"}


def test_final_folder_holds_adapter_tokenizer_and_data(run_dir):
    final = run_dir / FINAL_DIR
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (final / name).is_file(), name
    assert json.loads((final / DATA_FILE).read_text()) == asdict(DataSettings(source="synthetic"))
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".")]  # nothing left from the atomic save


def test_merge_computes_the_adapter_on_its_nf4_base(run_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    command = [sys.executable, "-m", "ddp_ft", "merge", str(run_dir), "--out", str(out), "--dtype", "float32"]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "NF4 weights dequantised" in done.stderr
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert (out / DATA_FILE).read_text() == (run_dir / FINAL_DIR / DATA_FILE).read_text()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == load_tokenizer(str(run_dir / FINAL_DIR)).chat_template
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(_logits(merged), _adapter_on(run_dir, load_in_4bit=True), **FLOAT32_TOL)


def test_original_base_differs_from_nf4_by_its_error(run_dir, tmp_path):
    """Merged into the published weights (here through --base-model: the base moved since training), the model is
    the adapter on the unquantised base; the two bases differ by at most NF4's half step per 64-weight block."""
    from transformers import AutoModelForCausalLM

    moved = tmp_path / "moved-base"
    base_path = json.loads((run_dir / FINAL_DIR / "adapter_config.json").read_text())["base_model_name_or_path"]
    shutil.copytree(base_path, moved)
    adapter = shutil.copytree(run_dir / FINAL_DIR, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(tmp_path / "x")}))
    with pytest.raises(ValueError, match="base_model_name_or_path in .* no such folder. Pass --base-model"):
        plan_merge(adapter, MergeSettings())

    settings = MergeSettings(base="original", dtype="float32", base_model=str(moved), device="cpu")
    merged = AutoModelForCausalLM.from_pretrained(merge_adapter(adapter, tmp_path / "out", settings))
    torch.testing.assert_close(_logits(merged), _adapter_on(run_dir, load_in_4bit=False), **FLOAT32_TOL)

    plan = MergePlan(
        adapter, str(moved), quantized=True, double_quant=True, dtype=torch.float32, device=torch.device("cpu")
    )
    nf4 = dict(load_base_to_merge(plan).named_parameters())
    original = dict(AutoModelForCausalLM.from_pretrained(moved, dtype=torch.float32).named_parameters())
    quantized = [name for name in original if "proj" in name]
    assert quantized and not any(torch.equal(nf4[name], original[name]) for name in quantized)
    for name in quantized:
        blocks = original[name].detach().reshape(-1, 64)
        error = (nf4[name].detach().reshape(-1, 64) - blocks).abs().amax(dim=1)
        # NF4's widest gap between codes is 0.304 of a block's absmax; double quantisation moves absmax by < 1%.
        assert (error <= 0.16 * blocks.abs().amax(dim=1)).all(), name


def test_run_without_final_merges_newest_checkpoint(tmp_path):
    for adapter in (tmp_path / "ddp_ft-checkpoint-4" / "adapter", tmp_path / "checkpoint-2"):
        adapter.mkdir(parents=True)
        (adapter / "adapter_config.json").write_text("{}")
    (tmp_path / "latest").write_text("ddp_ft-checkpoint-4")
    assert find_adapter(tmp_path) == tmp_path / "ddp_ft-checkpoint-4" / "adapter"
    (tmp_path / "checkpoint-6").mkdir()
    (tmp_path / "checkpoint-6" / "adapter_config.json").write_text("{}")
    assert find_adapter(tmp_path) == tmp_path / "checkpoint-6"
    assert find_adapter(tmp_path / "checkpoint-2") == tmp_path / "checkpoint-2"


def test_merge_refuses_no_adapter_and_a_full_out_dir(run_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as refused:
        cli.main(["merge", str(tmp_path / "empty"), "--out", str(tmp_path / "out")])
    assert "no adapter in" in str(refused.value) and "final/" in str(refused.value)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as refused:
        cli.main(["merge", str(run_dir), "--out", str(full)])
    assert f"--out {full} exists and is not an empty folder" in str(refused.value)
    assert [p.name for p in full.iterdir()] == ["keep.txt"] and not list(tmp_path.glob(".tmp-*"))


def test_generate_writes_what_the_nf4_adapter_writes(run_dir, tmp_path, capsys):
    """`ddp-ft generate RUN --prompt` against greedy decoding by hand: the adapter on its 4-bit base, the prompt
    written as the pair format's training prompt (instruction, blank line, text, generation prompt)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    out = tmp_path / "predictions.jsonl"
    text = "A: shall we start with the budget? B: yes, twelve euros fifty."
    cli.main(
        ["generate", str(run_dir), "--prompt", text, "--out", str(out), "--dtype", "float32", "--max-new-tokens", "12"]
    )
    (written,) = [json.loads(line) for line in out.read_text().splitlines()]
    tokenizer = load_tokenizer(str(run_dir / FINAL_DIR))
    user = f"{DataSettings().instruction}\n\n{text}"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert tokenizer(written["prompt"], add_special_tokens=False)["input_ids"] == ids and written["reference"] is None
    base_path = json.loads((run_dir / FINAL_DIR / "adapter_config.json").read_text())["base_model_name_or_path"]
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    base = AutoModelForCausalLM.from_pretrained(
        base_path, dtype=torch.float32, device_map={"": "cpu"}, quantization_config=nf4
    )
    model = PeftModel.from_pretrained(base, str(run_dir / FINAL_DIR)).train()  # see _logits: train mode on the CPU
    greedy = []
    with torch.no_grad():
        for _ in range(12):
            token = int(model(input_ids=torch.tensor([ids + greedy])).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            greedy.append(token)
    assert written["prediction"] == tokenizer.decode(greedy, skip_special_tokens=True).strip() != ""
    assert capsys.readouterr().out.splitlines()[0] == written["prediction"]
    with pytest.raises(SystemExit, match=r"--out .* exists; generate never replaces a file"):
        cli.main(["generate", str(run_dir), "--prompt", text, "--out", str(out)])


def test_generate_without_out_prints_writes_nothing(run_dir, tmp_path, monkeypatch, capsys):
    """Without ``--out`` the predictions are printed only: no file appears, so the same command runs again."""
    monkeypatch.chdir(tmp_path)
    argv = ["generate", str(run_dir), "--prompt", "A: the budget? B: fifty.", "--max-new-tokens", "4"]
    cli.main(argv)
    cli.main(argv)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and printed[0] == printed[1] and list(tmp_path.iterdir()) == []
