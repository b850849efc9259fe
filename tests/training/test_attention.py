"""The layers' attention kernel (``ddp_ft.training.model.attention``): flex attention where packed rows hold several
samples on CUDA, transformers' default elsewhere, and packed rows through flex attention computing what padded rows
through sdpa compute."""

import pytest
import torch

from ddp_ft.distributed import DistInfo
from ddp_ft.training.model.attention import FLEX, resolve_attention, sequences_per_row

TRITON = lambda name: object()  # noqa: E731  (a host where Triton is installed)


def test_auto_picks_flex_for_rows_of_short_samples():
    impl, why = resolve_attention("auto", "cuda", True, lambda: [370] * 50, 2048, find_spec=TRITON)
    assert impl == FLEX and "5.5 average samples" in why


@pytest.mark.parametrize(
    ("device", "packing", "lengths", "spec", "said"),
    [
        ("cuda", True, [512] * 50, TRITON, "holds 1.0 average samples"),  # every sample fills its row
        ("cuda", False, [100] * 50, TRITON, "rows are not packed"),
        ("cpu", True, [100] * 50, TRITON, "no backward here"),
        ("cuda", True, [100] * 50, lambda name: None, "needs Triton"),
    ],
)
def test_auto_keeps_sdpa_where_flex_gains_nothing(device, packing, lengths, spec, said):
    impl, why = resolve_attention("auto", device, packing, lambda: lengths, 512, find_spec=spec)
    assert impl is None and said in why


def test_named_kernel_kept_flex_on_cpu_refused():
    assert resolve_attention("eager", "cpu", True, lambda: [10], 512) == ("eager", "--attention eager")
    with pytest.raises(ValueError, match="--attention flex_attention: torch has no flex attention backward"):
        resolve_attention(FLEX, "cpu", True, lambda: [10], 512)


def test_unknown_kernel_refused_naming_the_choices():
    from ddp_ft.training.model.qlora import ModelSettings

    with pytest.raises(ValueError, match=r"attention='foo': .*choose auto, .*flex_attention.*sdpa"):
        ModelSettings(attention="foo")


def test_samples_per_row_counts_cut_ones_as_full():
    assert sequences_per_row([4096, 4096], 2048) == 1.0 and sequences_per_row([], 2048) == 1.0
    assert sequences_per_row([256, 768], 2048) == 4.0


def test_loop_refuses_flex_on_cpu_before_loading(tmp_path, monkeypatch):
    import ddp_ft.training.setup as setup
    from ddp_ft.training.config import settings_from_preset
    from ddp_ft.training.loop import train

    monkeypatch.setattr(setup, "load_qlora_model", lambda *a, **k: pytest.fail("the model loaded"))
    settings = settings_from_preset("tiny", attention=FLEX, output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="--attention flex_attention: torch has no flex attention backward"):
        train(settings, DistInfo())


def _model(attention: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    from ddp_ft.training.setup import resolve_model_and_tokenizer

    path, _ = resolve_model_and_tokenizer("embedded:tiny-qwen3", DistInfo())
    torch.manual_seed(0)
    kwargs = {"attn_implementation": attention, "dtype": torch.float32, "use_cache": False}
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device)


def _forward(model, packed: bool):
    """Two sequences of 20 and 12 tokens: one packed row, or two padded rows."""
    device = model.device
    generator = torch.Generator().manual_seed(1)
    a = torch.randint(3, 500, (20,), generator=generator)
    b = torch.randint(3, 500, (12,), generator=generator)
    if packed:  # positions restart at b: transformers builds the mask from them
        ids = torch.cat([a, b])[None]
        labels = ids.clone()
        labels[0, len(a)] = -100  # no token predicts across the boundary
        positions = torch.cat([torch.arange(len(a)), torch.arange(len(b))])[None]
        return model(input_ids=ids.to(device), position_ids=positions.to(device), labels=labels.to(device))
    ids = torch.zeros(2, len(a), dtype=torch.long)
    ids[0], ids[1, : len(b)] = a, b
    mask = (torch.arange(len(a))[None] < torch.tensor([[len(a)], [len(b)]])).long()
    labels = ids.masked_fill(mask == 0, -100)
    return model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))


def test_packed_flex_equals_padded_sdpa_forward():
    """On the CPU torch runs flex attention forward only: the logits and the loss of each sequence match."""
    with torch.no_grad():
        padded, packed = _forward(_model("sdpa"), False), _forward(_model(FLEX), True)
    torch.testing.assert_close(packed.loss, padded.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.logits[0, :20], padded.logits[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed.logits[0, 20:], padded.logits[1, :12], rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_packed_flex_grads_equal_padded_on_cuda(run_on_gpu):
    """The backward half, which torch runs on CUDA only, in a process that sees the GPU."""
    run_on_gpu("from tests.training.test_attention import cuda_gradients_match; cuda_gradients_match()")


def cuda_gradients_match() -> None:
    grads = []
    for attention, packed in (("sdpa", False), (FLEX, True)):
        model = _model(attention, "cuda")
        _forward(model, packed).loss.backward()
        grads.append([p.grad for p in model.parameters() if p.grad is not None])
    for g, h in zip(*grads, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-5)
