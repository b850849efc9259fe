"""Which attention kernel the decoder layers run (``ModelSettings.attention``), resolved once before the model loads.

Packed rows hold several sequences, kept apart by a block-diagonal mask that transformers builds from restarting
``position_ids``. sdpa computes every block of that mask, hidden or not; flex attention (torch's ``flex_attention``
with a ``BlockMask``, transformers' ``flex_attention``) skips the blocks it hides. ``auto`` chooses flex attention on
CUDA when packed rows hold two or more of the run's average samples, and transformers' default (sdpa) otherwise:
where a row is one sequence there is nothing to skip, and sdpa's causal kernel is the fastest. torch has no flex
attention backward on the CPU.
"""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Callable, Sequence

from ...ddp.autotune import AUTO

FLEX = "flex_attention"
FLEX_FROM_SEQUENCES = 2.0  # average samples per packed row from which flex attention has blocks to skip


def sequences_per_row(lengths: Sequence[int], row_tokens: int) -> float:
    """How many samples of the average length fit a packed row of ``row_tokens`` (at least 1)."""
    if not lengths:
        return 1.0
    mean = statistics.fmean(min(n, row_tokens) for n in lengths)
    return max(1.0, row_tokens / max(mean, 1.0))


def resolve_attention(
    setting: str,
    device_type: str,
    packing: bool,
    lengths: Sequence[int],
    row_tokens: int,
    find_spec: Callable[[str], object] = importlib.util.find_spec,
) -> tuple[str | None, str]:
    """The ``attn_implementation`` the model loads with (None: transformers' default), and why.

    Args:
        setting (str): ``ModelSettings.attention``: ``auto`` or an implementation transformers knows.
        device_type (str): this rank's device type.
        packing (bool): the run packs its micro-batches into rows.
        lengths (Sequence[int]): the training samples' token counts.
        row_tokens (int): the tokens of a packed row, ``max_seq_len``.
        find_spec (Callable): whether a module is installed (injectable for tests).

    Returns:
        tuple: the implementation or None, and the reason, for the log.

    Raises:
        ValueError: ``--attention flex_attention`` on the CPU, naming the fix.
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
    per_row = sequences_per_row(lengths, row_tokens)
    if device_type != "cuda":
        return None, f"auto on {device_type}: transformers' default (sdpa), flex attention has no backward here"
    if per_row < FLEX_FROM_SEQUENCES:
        return None, f"auto: sdpa, a packed row holds {per_row:.1f} average samples, so its mask hides nothing"
    if find_spec("triton") is None:
        return None, "auto: sdpa, flex attention needs Triton, which is not installed"
    return FLEX, f"auto: flex attention, a packed row holds {per_row:.1f} average samples, whose masked blocks it skips"
