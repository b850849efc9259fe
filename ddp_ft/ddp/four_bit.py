"""bitsandbytes 4-bit weights kept in the layout training needs.

On CPUs with AVX-512 bf16 a ``Linear4bit`` repacks its weight for fast inference at its first forward in eval mode
without gradients, as in an evaluation, and keeps it so. Training on the repacked weight computes wrong gradients.
"""

from __future__ import annotations

import sys

import torch


def keep_4bit_training_layout(model: torch.nn.Module) -> None:
    """Turn off each ``Linear4bit``'s CPU inference repacking, and unpack a weight already repacked."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:  # never imported: no 4-bit layer exists
        return
    for layer in model.modules():
        if not isinstance(layer, bnb.nn.Linear4bit):
            continue
        layer.support_avx512bf16_for_cpu = False
        weight, state = layer.weight, getattr(layer.weight, "quant_state", None)
        if getattr(state, "packing_format_for_cpu", False):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
