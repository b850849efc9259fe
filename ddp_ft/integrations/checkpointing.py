"""A trap of gradient checkpointing on a frozen base, caught when the plugin prepares a model for training.

Reentrant checkpointing (``use_reentrant=True``, torch's default when unset) recomputes a layer in a nested backward
that only runs if the layer's inputs require grad. On a frozen base (QLoRA) the hidden states entering the first
checkpointed layer do not, unless the input embeddings' output is made to (``model.enable_input_require_grads()``,
which transformers' ``gradient_checkpointing_enable`` and peft's ``prepare_model_for_kbit_training`` call): without
it, the adapters inside every checkpointed layer get no gradient and never train. BucketedDDP raises at the end of
that backward (or, with ``find_unused_parameters=True``, treats them as unused: silently); this check names the fix
before the first step. Non-reentrant checkpointing does not need it.
"""

from __future__ import annotations

import torch
from torch import nn


def _reentrant(layer: nn.Module) -> bool:
    """Whether a transformers layer with checkpointing on runs torch's reentrant checkpoint."""
    function = getattr(layer, "_gradient_checkpointing_func", None)
    keywords = getattr(function, "keywords", None) or {}
    return keywords.get("use_reentrant") is not False  # torch's checkpoint: None means reentrant


def _output_requires_grad(embeddings: nn.Module) -> bool:
    """Whether the input embeddings' output requires grad, found by running them on one token: the forward hooks
    that make it so (``enable_input_require_grads``, however many times it was called) run as in training."""
    weight = getattr(embeddings, "weight", None)
    if weight is None:
        return True  # not an embedding table: nothing to probe, nothing refused
    with torch.enable_grad():
        output = embeddings(torch.zeros(1, 1, dtype=torch.long, device=weight.device))
    return bool(getattr(output, "requires_grad", True))


def check_checkpointed_adapters(model: nn.Module) -> None:
    """Refuse reentrant gradient checkpointing whose trainable layers would get no gradient.

    Args:
        model (nn.Module): the model about to train (a ``PeftModel``, a transformers model, or anything else, which
            passes).

    Raises:
        ValueError: a layer holding trainable parameters is checkpointed reentrantly, the input embeddings are
            frozen, and their output (probed on one token) does not require grad; naming ``enable_input_require_grads`` and
            ``use_reentrant=False``.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    checkpointing = getattr(base, "is_activation_checkpointing", None)  # transformers >= 5.24; the old name warns
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
    """Whether any of ``model``'s transformers layers recomputes its activations in backward (checkpointing on)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
