"""4-bit layers kept in the layout training needs (``ddp_ft.ddp.four_bit``)."""

import pytest
import torch

from ddp_ft.ddp.four_bit import keep_4bit_training_layout
from ddp_ft.distributed import DistInfo


def test_weights_repacked_by_an_evaluation_unpacked():
    """A user's model evaluated before training: bitsandbytes has repacked its 4-bit weights for CPU inference.
    Preparing it for training restores every weight byte for byte, and evaluation repacks nothing after."""
    bnb = pytest.importorskip("bitsandbytes")
    if not bnb.functional.has_avx512bf16():
        pytest.skip("this CPU has no AVX-512 bf16: bitsandbytes never repacks")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from ddp_ft.training.model.qlora import EMBEDDED_MODEL
    from ddp_ft.training.setup import resolve_model_and_tokenizer

    path, _ = resolve_model_and_tokenizer(EMBEDDED_MODEL, DistInfo())
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, device_map={"": "cpu"})
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    packed = [layer.weight.data.clone() for layer in layers]
    ids = torch.randint(3, 100, (2, 8))
    with torch.no_grad():
        model.eval()(input_ids=ids)
    assert all(layer.weight.quant_state.packing_format_for_cpu for layer in layers)  # what the evaluation did
    keep_4bit_training_layout(model)
    with torch.no_grad():
        model(input_ids=ids)
    assert not any(layer.weight.quant_state.packing_format_for_cpu for layer in layers)
    for layer, before in zip(layers, packed, strict=True):
        assert torch.equal(layer.weight.data, before)
