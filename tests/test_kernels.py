"""--liger and --compile: refused where they cannot work, before anything loads; carried from every settings source to
both entry points; and --compile under BucketedDDP on 2 real processes trains as the uncompiled loop does."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from ddp_ft.config import parse_settings, settings_from_preset
from ddp_ft.distributed import DistInfo
from ddp_ft.integrations.recipe import training_arguments
from ddp_ft.kernels import LIGER_INSTALL, check_kernel_settings, compile_repeated_blocks
from ddp_ft.loop import train
from ddp_ft.setup import check_run_settings

from .dist_harness import run_distributed

CUDA = torch.device("cuda", 0)  # only named: nothing here touches a GPU
CPU = torch.device("cpu")


def _installed(*names):
    """A ``find_spec`` that finds exactly ``names``."""
    return lambda name: object() if name in names else None


def test_liger_is_refused_on_the_cpu_before_anything_loads_naming_the_setting(tmp_path):
    settings = settings_from_preset("tiny", liger=True, output_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"--liger \(liger: true\): Liger's kernels are Triton kernels for CUDA GPUs"):
        check_run_settings(settings, DistInfo())
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
def test_liger_on_cuda_without_its_packages_is_refused_naming_the_fix(installed, needle):
    with pytest.raises(ValueError, match="--liger") as error:
        check_kernel_settings(True, False, CUDA, find_spec=_installed(*installed))
    assert needle in str(error.value)
    check_kernel_settings(True, False, CUDA, find_spec=_installed("triton", "liger_kernel"))  # both: allowed


def test_compile_without_a_cpp_compiler_on_the_cpu_is_refused_naming_the_setting_and_cxx(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-c++")
    settings = settings_from_preset("tiny", compile=True, output_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"--compile \(compile: true\) on the CPU: .*'no-such-c\+\+' .* CXX"):
        check_run_settings(settings, DistInfo())
    monkeypatch.delenv("CXX")
    check_kernel_settings(False, True, CPU, which=lambda name: f"/usr/bin/{name}")  # a compiler: allowed


def test_compile_on_cuda_without_triton_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"--compile \(compile: true\) on CUDA: .* Triton"):
        check_kernel_settings(False, True, CUDA, find_spec=_installed())
    check_kernel_settings(False, True, CUDA, find_spec=_installed("triton"))


def test_liger_and_compile_are_off_by_default_and_set_by_flags_and_config_files_flat_or_by_section(tmp_path, capsys):
    defaults = parse_settings(["--preset", "tiny"]).model
    assert (defaults.liger, defaults.compile) == (False, False)
    flags = parse_settings(["--preset", "tiny", "--liger", "--compile"]).model
    assert (flags.liger, flags.compile) == (True, True)
    config = tmp_path / "kernels.yaml"
    config.write_text("preset: tiny\nliger: true\nmodel:\n  compile: true\n")
    from_file = parse_settings(["--config", str(config)]).model
    assert (from_file.liger, from_file.compile) == (True, True)
    config.write_text("compile: 'yes'\n")
    with pytest.raises(SystemExit):
        parse_settings(["--config", str(config)])
    assert "compile: 'yes' is a str; compile takes a bool" in capsys.readouterr().err


def test_the_recipe_hands_liger_and_compile_to_the_trainer():
    precision = SimpleNamespace(dtype=torch.float32)
    for liger, compile in ((False, False), (True, True)):
        settings = settings_from_preset("tiny", liger=liger, compile=compile, report_to="none")
        arguments = training_arguments(settings, DistInfo(), precision, accumulation=4)
        assert (arguments["use_liger_kernel"], arguments["torch_compile"]) == (liger, compile)


class _Stop(Exception):
    """Raised in place of building the model: the test has seen what it needs."""


def test_the_loop_applies_liger_to_qwen3_before_it_builds_the_model(monkeypatch, tmp_path):
    """On a GPU with liger-kernel (both faked here): Liger's Qwen3 patch, fused linear cross-entropy included, is
    applied before the model is built, so ``from_pretrained`` builds Liger's layers."""
    import sys
    from types import ModuleType

    import ddp_ft.loop
    import ddp_ft.setup

    calls = []
    fake = ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_qwen3 = lambda **kwargs: calls.append(("liger", kwargs))
    monkeypatch.setitem(sys.modules, "liger_kernel", ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    monkeypatch.setattr(ddp_ft.setup, "check_kernel_settings", lambda *args: calls.append(("checked", args)))

    def build_model(*args):
        calls.append(("build_model", ()))
        raise _Stop

    monkeypatch.setattr(ddp_ft.loop, "build_model", build_model)
    settings = settings_from_preset("tiny", liger=True, output_dir=str(tmp_path / "run"), report_to="none")
    with pytest.raises(_Stop):
        train(settings, DistInfo())
    names = [name for name, _ in calls]
    assert names[-2:] == ["liger", "build_model"] and set(names[:-2]) == {"checked"}, names  # checked first
    assert calls[0][1][:2] == (True, False)  # the settings' liger and compile reach the check
    assert calls[-2][1] == dict(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)


def test_liger_refuses_a_model_that_is_not_qwen3_naming_the_setting(tmp_path):
    from transformers import LlamaConfig

    from ddp_ft.kernels import apply_liger_to_qwen3

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"--liger \(liger: true\) applies Liger's Qwen3 kernels, and .* 'llama'"):
        apply_liger_to_qwen3(str(tmp_path))


def test_compile_takes_the_repeated_layers_in_place_and_refuses_a_model_without_them():
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
    assert all(block._compiled_call_impl is not None for block in model[1])
    assert all(linear._compiled_call_impl is None for block in model[1] for linear in block.inner)
    with pytest.raises(ValueError, match=r"--compile \(compile: true\) compiles the model's repeated layers"):
        compile_repeated_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh()))


STEPS = 3


def _loop_with_and_without_compile(rank, world_size, root):
    """The plain loop on the tiny preset, uncompiled then --compile, on this rank; dynamo's graph count after each."""
    from torch._dynamo.utils import counters

    info = DistInfo(rank, rank, world_size, world_size, torch.device("cpu"), "gloo")
    graphs = []
    for compile in (False, True):
        settings = settings_from_preset(
            "tiny",
            compile=compile,
            output_dir=f"{root}/compile-{compile}",
            max_steps=STEPS,
            lora_dropout=0.0,  # the ranks' dropout masks aside, the two runs are the same computation
            eval_fraction=0.0,
            report_to="none",
        )
        train(settings, info)
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_loop_under_bucketed_ddp_on_two_ranks_trains_as_the_uncompiled_one(tmp_path):
    """--compile on the plain loop, 2 gloo ranks, BucketedDDP: each step's loss and gradient norm equal the
    uncompiled run's to 1e-5 relative (measured: ~1e-7), and the compiled run really compiled (dynamo graphs)."""
    results = run_distributed(_loop_with_and_without_compile, str(tmp_path), timeout=420)
    for rank, (uncompiled, compiled) in enumerate(results):
        assert uncompiled == 0, f"rank {rank}: the run without --compile compiled {uncompiled} graphs"
        assert compiled > 0, f"rank {rank}: --compile compiled nothing"

    def steps(compile):
        rows = [json.loads(line) for line in (tmp_path / f"compile-{compile}" / "metrics.jsonl").open()]
        return [(row["loss"], row["grad_norm"]) for row in rows if row.get("type") == "train"]

    assert (tmp_path / "compile-True" / "run_config.yaml").read_text().count("compile: true") == 1
    plain, compiled = torch.tensor(steps(False)), torch.tensor(steps(True))
    assert plain.shape == (STEPS, 2), plain
    assert_close(compiled, plain, rtol=1e-5, atol=0.0)
