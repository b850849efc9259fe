"""Which attention kernel the decoder layers run, resolved once before the model loads.

Packed rows keep their sequences apart with a block-diagonal mask.
sdpa computes every block; flex attention skips the hidden ones.
``auto`` picks flex attention on CUDA when rows pack two or more samples, sdpa otherwise.
torch has no flex attention backward on the CPU.
"""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Callable, Sequence

from ...ddp.autotune import AUTO

FLEX = "flex_attention"
FLEX_FROM_SEQUENCES = 2.0  # samples per row from which flex has blocks to skip


def sequences_per_row(lengths: Sequence[int], row_tokens: int) -> float:
    """How many average-length samples fit a packed row, at least 1."""
    if not lengths:
        return 1.0
    mean = statistics.fmean(min(n, row_tokens) for n in lengths)
    return max(1.0, row_tokens / max(mean, 1.0))


def resolve_attention(
    setting: str,
    device_type: str,
    packing: bool,
    lengths: Callable[[], Sequence[int]],
    row_tokens: int,
    find_spec: Callable[[str], object] = importlib.util.find_spec,
) -> tuple[str | None, str]:
    """The ``attn_implementation`` the model loads with, and why.

    Args:
        setting (str): ``auto`` or an implementation transformers knows.
        device_type (str): this rank's device type.
        packing (bool): the run packs its micro-batches into rows.
        lengths (Callable): the training samples' token counts, read only where the choice needs them.
        row_tokens (int): tokens per packed row, ``max_seq_len``.
        find_spec (Callable): whether a module is installed; injectable for tests.

    Returns:
        tuple[str | None, str]: the implementation, None for transformers' default, and the reason.

    Raises:
        ValueError: ``--attention flex_attention`` on the CPU.
    """
    if setting != AUTO:
        if setting == FLEX and device_type == "cpu":
            raise ValueError(
                "--attention flex_attention: torch has no flex attention backward on the CPU. Use --attention sdpa, "
                "or auto (sdpa there)."
            )
        return setting, f"--attention {setting}"
    if not packing:
        return None, "auto: transformers' default (sdpa), rows are not packed"
    if device_type != "cuda":
        return None, f"auto on {device_type}: transformers' default (sdpa), flex attention has no backward here"
    per_row = sequences_per_row(lengths(), row_tokens)
    if per_row < FLEX_FROM_SEQUENCES:
        return None, f"auto: sdpa, a packed row holds {per_row:.1f} average samples, so its mask hides nothing"
    if find_spec("triton") is None:
        return None, "auto: sdpa, flex attention needs Triton, which is not installed"
    return FLEX, f"auto: flex attention, a packed row holds {per_row:.1f} average samples, whose masked blocks it skips"


def check_attention(setting: str) -> None:
    """Refuse an attention transformers does not know; ``org/kernel`` names a hub kernel it loads itself."""
    if setting == AUTO:  # the default: transformers not imported for it
        return
    known = known_attention()
    if setting not in known and "/" not in setting:
        raise ValueError(
            f"ModelSettings.attention={setting!r}: transformers knows no such attention; choose {', '.join(known)}."
        )


def known_attention() -> list[str]:
    """``auto`` and the attention implementations this transformers registers, ``eager`` first."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return [AUTO, "eager", *sorted(k for k in ALL_ATTENTION_FUNCTIONS.valid_keys() if k != "paged|eager")]
