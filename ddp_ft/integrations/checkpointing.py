"""Catches reentrant checkpointing that would starve frozen-base adapters of gradient.

Reentrant checkpointing recomputes a layer only if its inputs require grad.
On a frozen base they do not, unless ``enable_input_require_grads()`` was called.
Without it the adapters never train; this check names the fix before the first step.
"""

from __future__ import annotations

import torch
from torch import nn


def _reentrant(layer: nn.Module) -> bool:
    """Whether a checkpointed transformers layer runs torch's reentrant checkpoint."""
    function = getattr(layer, "_gradient_checkpointing_func", None)
    keywords = getattr(function, "keywords", None) or {}
    return keywords.get("use_reentrant") is not False  # None means reentrant


def _output_requires_grad(embeddings: nn.Module) -> bool:
    """Whether the input embeddings' output requires grad, probed on one token."""
    weight = getattr(embeddings, "weight", None)
    if weight is None:
        return True  # not an embedding table: nothing to probe
    with torch.enable_grad():
        output = embeddings(torch.zeros(1, 1, dtype=torch.long, device=weight.device))
    return bool(getattr(output, "requires_grad", True))


def check_checkpointed_adapters(model: nn.Module) -> None:
    """Refuses reentrant gradient checkpointing whose trainable layers would get no gradient.

    Args:
        model (nn.Module): the model about to train.

    Raises:
        ValueError: trainable layers are checkpointed reentrantly and the embeddings' output needs no grad.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    checkpointing = getattr(base, "is_activation_checkpointing", None)  # transformers >= 5.24
    if checkpointing is None:
        checkpointing = getattr(base, "is_gradient_checkpointing", False)
    if not checkpointing or not hasattr(base, "get_input_embeddings"):
        return
    embeddings = base.get_input_embeddings()
    if embeddings is None or any(p.requires_grad for p in embeddings.parameters()):
        return
    if _output_requires_grad(embeddings):
        return
    starved = [
        name
        for name, layer in base.named_modules()
        if getattr(layer, "gradient_checkpointing", False)
        and _reentrant(layer)
        and any(p.requires_grad for p in layer.parameters())
    ]
    if starved:
        raise ValueError(
            f"Gradient checkpointing is reentrant (use_reentrant=True, or unset) on {len(starved)} layer(s) with "
            f"trainable parameters (first: {starved[0]!r}) while the input embeddings are frozen and their output "
            "does not require grad: those layers' adapters would get no gradient. Call "
            "model.enable_input_require_grads() after enabling checkpointing, or enable it non-reentrant: "
            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
            "(TrainingArguments(gradient_checkpointing_kwargs={'use_reentrant': False}))."
        )


def is_checkpointed(model: nn.Module) -> bool:
    """Whether any of ``model``'s transformers layers has checkpointing on."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
