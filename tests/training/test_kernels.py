"""--liger and --compile: refused where they cannot work, before anything loads; carried from every settings source to
both entry points; compile's device default (on for CUDA, off on the CPU, off with the reason where known to break);
regional compilation in place with the sequence dimension dynamic. Compilation under BucketedDDP on 2 real processes:
tests/training/test_compile_overlap.py."""

from types import SimpleNamespace

import pytest
import torch

from ddp_ft.distributed import DistInfo
from ddp_ft.integrations.recipe import training_arguments
from ddp_ft.training.config import parse_settings, settings_from_preset
from ddp_ft.training.loop import train
from ddp_ft.training.model.compilation import Blocker, check_compile_mode, compile_blockers, compile_repeated_blocks
from ddp_ft.training.model.kernels import LIGER_INSTALL, check_kernel_settings
from ddp_ft.training.resolve import Resolved, resolve_device_defaults, resolve_run

CUDA = torch.device("cuda", 0)  # only named: nothing here touches a GPU
CPU = torch.device("cpu")


def _installed(*names):
    """A ``find_spec`` that finds exactly ``names``."""
    return lambda name: object() if name in names else None


def test_liger_refused_on_cpu_before_anything_loads(tmp_path):
    settings = settings_from_preset("tiny", liger=True, output_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"--liger \(liger: true\): Liger's kernels are Triton kernels for CUDA GPUs"):
        resolve_run(settings, DistInfo())
    with pytest.raises(ValueError, match="Drop --liger"):
        train(settings, DistInfo())  # the plain loop: refused in its first check, nothing written
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "installed,needle",
    [
        ((), "needs Triton, which is not installed"),
        (("triton",), f"needs the liger-kernel package, which is not installed: {LIGER_INSTALL}"),
    ],
)
def test_liger_on_cuda_without_packages_names_the_fix(installed, needle):
    with pytest.raises(ValueError, match="--liger") as error:
        check_kernel_settings(True, False, CUDA, find_spec=_installed(*installed))
    assert needle in str(error.value)
    check_kernel_settings(True, False, CUDA, find_spec=_installed("triton", "liger_kernel"))  # both: allowed


def test_compile_on_cpu_without_cxx_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-c++")
    settings = settings_from_preset("tiny", compile=True, output_dir=str(tmp_path / "run"))
    with pytest.raises(
        ValueError, match=r"--compile \(compile: true\): on the CPU .*'no-such-c\+\+' .* CXX.*--no-compile"
    ):
        resolve_run(settings, DistInfo())
    monkeypatch.delenv("CXX")
    check_kernel_settings(False, True, CPU, which=lambda name: f"/usr/bin/{name}")  # a compiler: allowed


def test_compile_on_cuda_without_triton_is_refused():
    with pytest.raises(ValueError, match=r"--compile \(compile: true\): on CUDA .* Triton"):
        check_kernel_settings(False, True, CUDA, find_spec=_installed())
    check_kernel_settings(False, True, CUDA, find_spec=_installed("triton"))


def test_liger_off_compile_auto_unless_flag_or_file(tmp_path, capsys):
    defaults = parse_settings(["--preset", "tiny"]).model
    assert (defaults.liger, defaults.compile) == (False, "auto")
    flags = parse_settings(["--preset", "tiny", "--liger", "--compile"]).model
    assert (flags.liger, flags.compile) == (True, True)
    assert parse_settings(["--no-compile"]).model.compile is False
    assert parse_settings(["--compile", "false"]).model.compile is False
    assert parse_settings(["--compile", "auto"]).model.compile == "auto"
    config = tmp_path / "kernels.yaml"
    config.write_text("preset: tiny\nliger: true\nmodel:\n  compile: true\n")
    from_file = parse_settings(["--config", str(config)]).model
    assert (from_file.liger, from_file.compile) == (True, True)
    config.write_text("compile: 'yes'\n")
    with pytest.raises(SystemExit):
        parse_settings(["--config", str(config)])
    assert "compile: 'yes' is a str; compile takes true, false or 'auto'" in capsys.readouterr().err


def test_recipe_hands_liger_and_compile_to_trainer():
    precision = SimpleNamespace(dtype=torch.float32)
    for liger, compile in ((False, False), (True, True)):
        settings = settings_from_preset("tiny", liger=liger, compile="auto", report_to="none")
        resolved = Resolved(2, 4, compile, precision, {"": "cpu"}, "--micro-batch 2", "a test's")
        arguments = training_arguments(settings, DistInfo(), precision, resolved)
        assert (arguments["use_liger_kernel"], arguments["torch_compile"]) == (liger, compile)
        assert (arguments["per_device_train_batch_size"], arguments["gradient_accumulation_steps"]) == (2, 4)


class _Stop(Exception):
    """Raised in place of building the model: the test has seen what it needs."""


def test_loop_applies_liger_before_building_the_model(monkeypatch, tmp_path):
    """On a GPU with liger-kernel (both faked here): Liger's Qwen3 patch, fused linear cross-entropy included, is
    applied before the model is built, so ``from_pretrained`` builds Liger's layers."""
    import sys
    from types import ModuleType

    import ddp_ft.training.loop
    import ddp_ft.training.resolve
    import ddp_ft.training.setup

    calls = []
    fake = ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_qwen3 = lambda **kwargs: calls.append(("liger", kwargs))
    monkeypatch.setitem(sys.modules, "liger_kernel", ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    monkeypatch.setattr(ddp_ft.training.resolve, "check_kernel_settings", lambda *args: calls.append(("checked", args)))

    def build_model(*args):
        calls.append(("build_model", ()))
        raise _Stop

    monkeypatch.setattr(
        ddp_ft.training.setup, "build_model", build_model
    )  # the loop's model: setup.build_training_model
    settings = settings_from_preset("tiny", liger=True, output_dir=str(tmp_path / "run"), report_to="none")
    with pytest.raises(_Stop):
        train(settings, DistInfo())
    names = [name for name, _ in calls]
    assert names[-2:] == ["liger", "build_model"] and set(names[:-2]) == {"checked"}, names  # checked first
    assert calls[0][1][:2] == (True, False)  # the settings' liger and compile reach the check
    assert calls[-2][1] == dict(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)


def test_liger_refuses_a_model_other_than_qwen3(tmp_path):
    from transformers import LlamaConfig

    from ddp_ft.training.model.kernels import apply_liger_to_qwen3

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"--liger \(liger: true\) applies Liger's Qwen3 kernels, and .* 'llama'"):
        apply_liger_to_qwen3(str(tmp_path))


def test_compile_repeated_layers_in_place_or_refuse():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])  # compiled with Block

        def forward(self, x):
            return x

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList([Block(), Block(), Block()]))
    names = [name for name, _ in model.named_parameters()]
    assert compile_repeated_blocks(model) == 3
    assert [name for name, _ in model.named_parameters()] == names  # names, so checkpoints, unchanged
    assert all(block.forward.compiled._torchdynamo_orig_callable == block.forward.eager for block in model[1])
    assert not any(hasattr(linear.forward, "compiled") for block in model[1] for linear in block.inner)
    assert compile_repeated_blocks(model) == 0  # compiled already: left as it is
    with pytest.raises(ValueError, match=r"--compile \(compile: true.*\) compiles the model's repeated layers"):
        compile_repeated_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh()))


def _info(device: torch.device, rank: int = 0) -> DistInfo:
    return DistInfo(rank, rank, 1, 1, device, "nccl" if device.type == "cuda" else "gloo")


def test_auto_defaults_by_device_logged_once_with_why(caplog):
    """compile auto: on for CUDA when nothing blocks it, off on the CPU; micro-batch auto on the CPU is 1 (on CUDA it
    is left to resolve_micro_batch); each said once on rank 0 with the reason and how to change it; the settings are
    only read."""
    nothing = lambda *args, **kwargs: []  # noqa: E731
    for device, expected in ((CUDA, True), (CPU, False)):
        settings = settings_from_preset("qwen3-4b-ami")
        assert (settings.model.compile, settings.train.micro_batch) == ("auto", "auto")  # the preset keeps them auto
        with caplog.at_level("INFO", logger="ddp_ft.training.resolve"):
            defaults = resolve_device_defaults(settings, _info(device), blockers=nothing)
        assert defaults.compile is expected
        assert defaults.micro_batch == ("auto" if device.type == "cuda" else 1)
        assert (settings.model.compile, settings.train.micro_batch) == ("auto", "auto")  # never written to
    said = [r.getMessage() for r in caplog.records]
    assert any("compile: on (auto on CUDA" in m and "--no-compile" in m for m in said), said
    assert any("compile: off (auto on cpu" in m for m in said) and any("micro-batch: 1 (auto on cpu" in m for m in said)
    assert defaults.compile_why.startswith("auto on cpu: compiling costs")  # the CPU's, the loop's last: what was said
    caplog.clear()
    quiet = settings_from_preset("qwen3-4b-ami")
    with caplog.at_level("INFO", logger="ddp_ft.training.resolve"):
        resolve_device_defaults(quiet, _info(CPU, rank=1), blockers=nothing)  # another rank: nothing said
    assert not [r for r in caplog.records if r.levelno >= 20], caplog.records
    explicit = settings_from_preset("qwen3-4b-ami", compile=False, micro_batch=4)
    kept = resolve_device_defaults(explicit, _info(CUDA), blockers=nothing)
    assert (kept.compile, kept.micro_batch) == (False, 4)  # a user's values are kept
    assert (kept.compile_why, kept.micro_batch_why) == ("--no-compile (compile: false)", "--micro-batch 4")


def test_compile_known_to_break_is_off_or_refused(caplog):
    blocked = lambda *args, **kwargs: [Blocker("bitsandbytes 0.49 graph-breaks", "pip install x")]  # noqa: E731
    settings = settings_from_preset("qwen3-4b-ami")
    with caplog.at_level("WARNING", logger="ddp_ft.training.resolve"):
        defaults = resolve_device_defaults(settings, _info(CUDA), blockers=blocked)
    assert defaults.compile is False and "pip install x" in defaults.compile_why
    assert any("compile: off" in r.getMessage() and "pip install x" in r.getMessage() for r in caplog.records)
    with pytest.raises(
        ValueError, match=r"--compile \(compile: true\): bitsandbytes 0.49 .*: pip install x.*--no-compile"
    ):
        resolve_device_defaults(settings_from_preset("qwen3-4b-ami", compile=True), _info(CUDA), blockers=blocked)


def test_blockers_old_bnb_checkpointed_lora_dropout():
    versions = {"bitsandbytes": (0, 49), "torch": (2, 10)}
    found = compile_blockers(CPU, lora_dropout=0.05, checkpointing=True, which=lambda _: "g++", version=versions.get)
    assert [b.fix for b in found] == [
        'pip install "bitsandbytes>=0.50"',
        "set --lora-dropout 0 (LoraConfig(lora_dropout=0.0)), or upgrade torch to 2.11 or later",
    ]
    assert "peft#3020" in found[1].reason
    fixed = {"bitsandbytes": (0, 50), "torch": (2, 11)}
    assert compile_blockers(CPU, lora_dropout=0.05, checkpointing=True, which=lambda _: "g++", version=fixed.get) == []
    no_dropout = compile_blockers(
        CPU, lora_dropout=0.0, checkpointing=True, which=lambda _: "g++", version=versions.get
    )
    assert no_dropout[1:] == []


def test_checkpointed_lora_dropout_blocked_cuda_2_11():
    """Compiled LoRA dropout in checkpointed layers crashed Inductor's partitioner on CUDA torch 2.11 (docs/performance.md)."""
    fixed_on_cpu = {"bitsandbytes": (0, 50), "torch": (2, 11)}
    found = compile_blockers(
        CUDA, lora_dropout=0.05, checkpointing=True, find_spec=_installed("triton"), version=fixed_on_cpu.get
    )
    assert [b.fix for b in found] == ["set --lora-dropout 0 (LoraConfig(lora_dropout=0.0))"]
    assert "on CUDA (seen on torch 2.11)" in found[0].reason
    for dropout, checkpointing in ((0.0, True), (0.05, False)):
        assert (
            compile_blockers(
                CUDA,
                lora_dropout=dropout,
                checkpointing=checkpointing,
                find_spec=_installed("triton"),
                version=fixed_on_cpu.get,
            )
            == []
        )


def test_max_autotune_is_refused_only_multi_process():
    with pytest.raises(ValueError, match=r"torch_compile_mode=...\)='max-autotune' on 2 processes: .*pytorch#140395"):
        check_compile_mode("max-autotune", 2, "TrainingArguments(torch_compile_mode=...)")
    check_compile_mode("max-autotune", 1, "mode")
    check_compile_mode("max-autotune-no-cudagraphs", 2, "mode")
    check_compile_mode(None, 2, "mode")


def test_new_sequence_lengths_do_not_recompile():
    """Four padded lengths through regionally compiled tiny-Qwen3 layers, training: one graph with the sequence
    dimension marked dynamic before the first call (Dynamo's automatic dynamic shapes alone compile a second one at
    the second length); with every shape static (dynamic=False) each new length compiles again, until Dynamo's limit
    (8), after which it would run eager."""
    from torch._dynamo.utils import counters
    from transformers import Qwen3ForCausalLM

    from ddp_ft.training.model.qlora import tiny_qwen3_config

    graphs = {}
    for dynamic in (None, False):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(tiny_qwen3_config(64, num_hidden_layers=2)).train()
        compile_repeated_blocks(model, backend="eager", dynamic=dynamic)  # Dynamo's guards and graphs, no codegen
        for length in (8, 11, 16, 21):
            ids = torch.randint(0, 64, (2, length))
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # training: no KV cache to guard on
        graphs[dynamic] = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs[None] == 1, graphs
    assert graphs[False] >= 4, graphs


def _small_config(architecture: str):
    """A two-layer model of ``architecture``: hidden size 64, head size 16."""
    import transformers

    from ddp_ft.training.model.qlora import tiny_qwen3_config

    if architecture == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, eos_token_id=0, bos_token_id=0)
    if architecture == "qwen3":
        return tiny_qwen3_config(100, num_hidden_layers=2, hidden_size=64, head_dim=16)
    config = getattr(transformers, f"{architecture}Config")
    return config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=100, pad_token_id=0,
    )  # fmt: skip


@pytest.mark.parametrize("architecture", ["qwen3", "Llama", "Mistral", "Qwen2", "Phi3", "Gemma2", "gpt2"])
def test_lengths_equal_to_model_sizes_do_not_recompile(architecture):
    """Padded lengths that happen to equal the layers' head size (16) or hidden size (64), and batch sizes that
    change, with padding masks: one graph. Dimensions are marked dynamic by their place in each input, not by a
    matching size, so the model's own sizes stay static (marked on a coincidence, they forced more graphs)."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_small_config(architecture)).train()
    compile_repeated_blocks(model, backend="eager")
    try:
        for batch, length in ((2, 11), (3, 16), (2, 64), (4, 13)):
            ids, mask = torch.randint(1, 100, (batch, length)), torch.ones(batch, length, dtype=torch.long)
            mask[0, -3:] = 0  # padding: the layers get a (batch, 1, length, length) mask
            model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert graphs == 1, graphs


FLEX_BATCHES = ((30, 20, 25, 6), (30, 20, 10, 12, 25), (17, 9, 30, 33, 12, 40), (40, 30, 20, 25))  # sample lengths


def flex_graphs_per_batch(device: str, backend: str) -> list[tuple[tuple[int, int], int]]:
    """Each of :data:`FLEX_BATCHES`, packed into rows of 64, through compiled flex-attention layers: its (rows,
    width) and the graphs compiled so far. Each batch's loss is checked against sdpa's. On CUDA it trains; on the
    CPU, where flex attention has no backward, the compiled forward runs without gradients."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from ddp_ft.training.data.packing import PackedCollator

    train = device != "cpu"
    torch._dynamo.reset()
    counters.clear()
    models = {}
    for attention in ("flex_attention", "sdpa"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_small_config("qwen3"), attn_implementation=attention)
        models[attention] = model.to(device).train(train)
    compile_repeated_blocks(models["flex_attention"], backend=backend)
    for block in models["flex_attention"].model.layers if not train else ():
        block.forward = block.forward.compiled  # what training runs
    collate, seen = PackedCollator(pad_token_id=0, row_tokens=64), []
    generator = torch.Generator().manual_seed(0)
    try:
        for lengths in FLEX_BATCHES:
            batch = collate([{"input_ids": torch.randint(1, 100, (n,), generator=generator).tolist()} for n in lengths])
            inputs = {name: tensor.to(device) for name, tensor in batch.items()} | {"use_cache": False}
            with torch.set_grad_enabled(train):
                flex, sdpa = (models[attention](**inputs).loss for attention in models)
                if train:
                    flex.backward()
            torch.testing.assert_close(flex, sdpa, rtol=1e-4 if device == "cpu" else 1e-3, atol=1e-4)
            seen.append((tuple(batch["input_ids"].shape), counters["stats"]["unique_graphs"]))
    finally:
        torch._dynamo.reset()
    return seen


@torch.compiler.config.patch(dynamic_sources="L['x']")  # the user's, restored after
def test_flex_new_widths_and_row_counts_reuse_graphs():
    """Packed batches of new widths and row counts through compiled flex attention: the layers and transformers'
    compiled block-mask builder compile once each. Unmarked, each recompiles at the first new width and again at
    the first new row count. The user's own dynamic sources are kept."""
    seen = flex_graphs_per_batch("cpu", backend="eager")
    assert [shape for shape, _ in seen] == [(2, 64), (2, 56), (3, 64), (2, 64)]  # (rows, width)
    assert [graphs for _, graphs in seen] == [2, 2, 2, 2], seen
    assert torch.compiler.config.dynamic_sources.split(",")[0] == "L['x']"


@pytest.mark.cuda
def test_compiled_flex_trains_without_recompiling(run_on_gpu):
    """The same, training, through TorchInductor's flex attention kernels, in a process that sees the GPU."""
    run_on_gpu(
        "from tests.training.test_kernels import flex_graphs_per_batch\n"
        "seen = flex_graphs_per_batch('cuda', backend='inductor')\n"
        "assert [graphs for _, graphs in seen] == [2, 2, 2, 2], seen"
    )


@pytest.mark.parametrize(
    ("shape", "dims"),
    [
        ((3, 64, 256), [0, 1]),  # hidden states
        ((3, 64, 64), [0, 1]),  # rotary cos or sin: the head size equals the length
        ((1, 64, 64), [1]),  # the same, batch broadcast
        ((3, 1, 64, 64), [0, 2, 3]),  # a mask
        ((1, 1, 64, 64), [2, 3]),
        ((64,), [0]),  # cache positions
        ((64, 64), [0]),  # (sequence, head size): a layout without batch
        ((), []),  # a scalar
        ((256,), []),
    ],
)
def test_dynamic_dims_follow_layout_not_size(shape, dims):
    from ddp_ft.training.model.compilation import _batch_and_sequence_dims

    assert _batch_and_sequence_dims(shape, batch=3, length=64) == dims


def test_user_model_refused_where_compile_breaks():
    """TrainingArguments(torch_compile=True) on a LoRA model with dropout in checkpointed layers, on a torch before 2.11
    (faked): refused naming the setting and the fix; with dropout 0, or on torch 2.11, allowed."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    from ddp_ft.training.model.compilation import check_model_compile
    from ddp_ft.training.model.qlora import tiny_qwen3_config

    def model(dropout: float):
        base = Qwen3ForCausalLM(tiny_qwen3_config(64, num_hidden_layers=2))
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return get_peft_model(base, LoraConfig(r=4, lora_dropout=dropout, target_modules=["q_proj", "v_proj"]))

    def on_torch(version):
        versions = {"torch": version, "bitsandbytes": (0, 50)}
        return lambda *args, **kwargs: compile_blockers(*args, version=versions.get, **kwargs)

    setting = "torch_compile=True"
    with pytest.raises(ValueError, match=r"torch_compile=True: LoRA dropout 0.1 .*peft#3020.*--lora-dropout 0"):
        check_model_compile(model(0.1), CPU, setting, backend="aot_eager", blockers=on_torch((2, 10)))
    check_model_compile(model(0.0), CPU, setting, backend="aot_eager", blockers=on_torch((2, 10)))
    check_model_compile(model(0.1), CPU, setting, backend="aot_eager", blockers=on_torch((2, 11)))
