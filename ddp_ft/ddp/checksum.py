"""Digests of the frozen base, compared across ranks: it is not broadcast, so it must already agree.

SHA-256 over dtype, shape and bytes sees any difference, reordered rows included.
A bitsandbytes 4-bit weight's meaning lives in its ``quant_state``, which is digested with it.
"""

from __future__ import annotations

import hashlib

import torch

_CHUNK_BYTES = 1 << 26  # device-to-host copies of at most 64 MiB at a time


def frozen_digest(t: torch.Tensor) -> str:
    """SHA-256 of a frozen parameter and, for a bitsandbytes 4-bit weight, of its quant state.

    Args:
        t (torch.Tensor): the parameter or buffer; never modified.

    Returns:
        str: a hex digest, equal across ranks exactly when dtype, shape, bytes and quant state are.
    """
    h = hashlib.sha256()
    _update(h, t)
    quant_state = getattr(t, "quant_state", None)
    if quant_state is not None:
        for key, value in _quant_state_items(quant_state):
            h.update(key.encode())
            if isinstance(value, torch.Tensor):
                _update(h, value)
            else:
                h.update(repr(value).encode())
    return h.hexdigest()


def _update(h, t: torch.Tensor) -> None:
    t = t.detach()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    data = t.contiguous().reshape(-1).view(torch.uint8)
    for part in data.split(_CHUNK_BYTES):
        h.update(memoryview(part.cpu().numpy()))


def _quant_state_items(state, prefix: str = "") -> list[tuple[str, object]]:
    """bitsandbytes' ``QuantState.as_dict(packed=False)`` (nested state included), else its attributes."""
    as_dict = getattr(state, "as_dict", None)
    items = as_dict(packed=False) if callable(as_dict) else vars(state)
    out = []
    for key, value in sorted(items.items()):
        if hasattr(value, "__dict__") and not isinstance(value, torch.Tensor | torch.dtype):
            out.extend(_quant_state_items(value, f"{prefix}{key}."))
        else:
            out.append((prefix + key, value))
    return out
