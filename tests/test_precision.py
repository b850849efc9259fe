"""The compute dtype a run picks (issue 11, item 3): one pure choice from the setting, the device type and the GPU's
compute capability, checked on CPU without a GPU (torch.cuda's capability query monkeypatched where it is asked)."""

import pytest
import torch

from ddp_ft.model import ModelSettings
from ddp_ft.precision import choose_precision


@pytest.mark.parametrize(
    ("requested", "device_type", "capability", "dtype", "loss_scaling"),
    [
        ("auto", "cuda", (9, 0), torch.bfloat16, False),  # H100
        ("auto", "cuda", (8, 0), torch.bfloat16, False),  # A100: the first with native bf16
        ("auto", "cuda", (7, 5), torch.float16, True),  # T4: bf16 is only emulated
        ("auto", "cuda", (7, 0), torch.float16, True),  # V100
        ("auto", "cpu", None, torch.float32, False),
        ("float16", "cuda", (9, 0), torch.float16, True),
        ("float16", "cpu", None, torch.float16, True),
        ("float32", "cuda", (7, 5), torch.float32, False),
        ("bfloat16", "cpu", None, torch.bfloat16, False),
    ],
)
def test_auto_picks_bf16_only_from_compute_capability_8(requested, device_type, capability, dtype, loss_scaling):
    chosen = choose_precision(requested, device_type, capability)
    assert (chosen.dtype, chosen.loss_scaling, chosen.autocast) == (dtype, loss_scaling, dtype != torch.float32)
    if device_type == "cpu":  # a CUDA scaler disables itself without CUDA
        assert chosen.grad_scaler().is_enabled() == loss_scaling


@pytest.mark.parametrize("capability", [(7, 5), (7, 0), (6, 1)])
def test_bf16_on_a_card_that_only_emulates_it_is_refused_naming_the_fix(capability):
    with pytest.raises(ValueError, match=r"--compute-dtype bfloat16 .* capability .*--compute-dtype float16"):
        choose_precision("bfloat16", "cuda", capability)


def test_the_model_settings_ask_the_device_s_capability(monkeypatch):
    """``ModelSettings.precision`` asks the real device (a T4 here, mocked): it used to pick bf16 whenever CUDA
    existed, because ``torch.cuda.is_bf16_supported()`` is True on a T4."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert ModelSettings().precision(torch.device("cuda", 0)).dtype == torch.float16
    assert ModelSettings().precision(torch.device("cpu")).dtype == torch.float32
