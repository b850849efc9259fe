"""Padding-free micro-batches: samples packed whole into rows, separated by restarting ``position_ids``.

Packing changes only the layout; the samples, loss and gradient stay the same. Rows stay at most
``max_seq_len`` long, since sdpa and eager attention pay for the whole row squared. With no attention mask and
no cache, transformers reads a ``position_ids`` restart as a sequence boundary. Flash attention does so only
for a single row, so :func:`packing_problem` refuses it. Each sequence's first label is -100, so no token
predicts across a boundary.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .balance import batch_width
from .settings import IGNORE_INDEX

# Attention that honours a packed row's position_ids through transformers' masks.
MASKED_ATTENTION = ("sdpa", "eager", "flex_attention")
# Flash kernels honour position_ids only in a batch of one row.
ONE_ROW_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


def pack_rows(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """Group the positions of ``lengths`` into rows of at most ``row_tokens``, first-fit decreasing.

    Ties break by position, so the result is deterministic. A sample longer than ``row_tokens`` gets its own row.
    Two samples or more fill two rows at least: compiled layers specialise a batch of one row, so a single row
    after several would compile them again. Two half rows compute about the same tokens, and sdpa less.

    Args:
        lengths (Sequence[int]): token lengths of the micro-batch's samples.
        row_tokens (int): the most tokens of a row holding more than one sample.

    Returns:
        list[list[int]]: positions into ``lengths``, one list per row.

    Raises:
        ValueError: ``row_tokens < 1`` or a length below 1.

    Example:
        >>> pack_rows([3, 5, 2], row_tokens=6)
        [[1], [0, 2]]
    """
    if row_tokens < 1:
        raise ValueError(f"row_tokens={row_tokens}: must be >= 1.")
    if any(length < 1 for length in lengths):
        raise ValueError(f"lengths {list(lengths)}: every sample needs at least one token.")
    longest_first = sorted(range(len(lengths)), key=lambda p: (-lengths[p], p))
    rows: list[list[int]] = []
    room: list[int] = []
    for position in longest_first:
        row = next((r for r, free in enumerate(room) if free >= lengths[position]), None)
        if row is None:
            rows.append([position])
            room.append(row_tokens - lengths[position])
        else:
            rows[row].append(position)
            room[row] -= lengths[position]
    return rows if len(rows) > 1 else _two_rows(lengths, longest_first)


def _two_rows(lengths: Sequence[int], longest_first: list[int]) -> list[list[int]]:
    """Positions of samples that fit one row, in two rows: each in turn to the shorter row."""
    rows: list[list[int]] = [[], []]
    filled = [0, 0]
    for position in longest_first:
        row = filled.index(min(filled))
        rows[row].append(position)
        filled[row] += lengths[position]
    return [row for row in rows if row]


def packed_cost(lengths: Sequence[int], row_tokens: int) -> int:
    """Tokens a packed micro-batch computes: rows times its width."""
    rows = pack_rows(lengths, row_tokens)
    return len(rows) * _width(rows, lengths)


def _width(rows: list[list[int]], lengths: Sequence[int]) -> int:
    """The width of packed ``rows``: their longest, rounded up to a multiple of 8."""
    return batch_width(max(sum(lengths[p] for p in row) for row in rows))


class PackedCollator:
    """Collate samples into packed rows with ``position_ids`` and no ``attention_mask``.

    Pad tokens sit after every real token, so causal attention never lets a real token see them. Widths are a
    multiple of 8, as ``make_collator``'s, for which it is a drop-in with the same loss.

    Args:
        pad_token_id (int): the tokenizer's pad token.
        row_tokens (int): the most tokens of a row, the run's ``max_seq_len``.
    """

    def __init__(self, pad_token_id: int, row_tokens: int) -> None:
        if pad_token_id is None:
            raise ValueError("PackedCollator needs the tokenizer's pad_token_id, for the end of rows.")
        self.pad_token_id, self.row_tokens = int(pad_token_id), row_tokens

    def cost(self, lengths: Sequence[int]) -> int:
        """Tokens one micro-batch of these lengths computes, for ``balanced_plan``."""
        return packed_cost(lengths, self.row_tokens)

    def __call__(self, features: list[dict]) -> dict:
        import torch

        ids = [list(f["input_ids"]) for f in features]
        labels = [list(f["labels"]) if "labels" in f else list(f["input_ids"]) for f in features]
        lengths = [len(i) for i in ids]
        rows = pack_rows(lengths, self.row_tokens)
        width = _width(rows, lengths)
        out = {name: torch.empty(len(rows), width, dtype=torch.int64) for name in ("input_ids", "labels")}
        out["position_ids"] = torch.empty(len(rows), width, dtype=torch.int64)
        for r, row in enumerate(rows):
            row_ids, row_labels, row_positions = [], [], []
            for p in sorted(row):  # the order does not change the loss
                row_ids += ids[p]
                row_labels += [IGNORE_INDEX] + labels[p][1:]
                row_positions += range(len(ids[p]))
            pad = width - len(row_ids)
            out["input_ids"][r] = torch.tensor(row_ids + [self.pad_token_id] * pad)
            out["labels"][r] = torch.tensor(row_labels + [IGNORE_INDEX] * pad)
            out["position_ids"][r] = torch.tensor(row_positions + list(range(pad)))
        return out


def packing_problem(config, model_class: type | None = None) -> str | None:
    """Why packed rows would let a sequence attend to its neighbour, or None.

    The model must build its mask with ``transformers.masking_utils``, use an attention from
    :data:`MASKED_ATTENTION`, and have no cache, which would make the mask ignore the restarts.

    Args:
        config (PretrainedConfig): the model's config.
        model_class (type | None): the model's class. Default: the causal-LM class for ``config``

    Returns:
        str | None: the reason, or None.
    """
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if attention in ONE_ROW_ATTENTION:
        return (
            f"attn_implementation={attention!r} separates packed sequences only in a batch of one row, and packing "
            "makes rows of max_seq_len tokens: a sequence would attend to the one before it in its row"
        )
    if attention not in MASKED_ATTENTION:
        return (
            f"attn_implementation={attention!r} is not one of {', '.join(MASKED_ATTENTION)}, whose mask keeps "
            "packed sequences apart: it may attend across them"
        )
    if model_class is None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    module = sys.modules.get(getattr(model_class, "__module__", ""), None)
    if model_class is None or not hasattr(module, "create_causal_mask"):
        name = getattr(model_class, "__name__", type(config).__name__)
        return (
            f"{name} does not build its attention mask with transformers.masking_utils, the only place where "
            "position_ids that restart keep packed sequences apart"
        )
    if getattr(config, "use_cache", False):
        return "config.use_cache is on: a forward without gradients builds a cache, and the mask then ignores packing"
    return None


def resolve_packing(packing: bool | str, device_type: str, problem: str | None) -> tuple[bool, str]:
    """Whether to pack this run, and why.

    ``auto`` packs on CUDA, where padding wastes compute, unless :func:`packing_problem` found a problem.

    Args:
        packing (bool | str): True, False or ``"auto"``.
        device_type (str): this rank's device type.
        problem (str | None): :func:`packing_problem` of the model.

    Returns:
        tuple[bool, str]: pack or not, and the reason.

    Raises:
        ValueError: ``packing=True`` with a ``problem``.
    """
    if packing is True and problem is not None:
        raise ValueError(
            f"--packing true cannot keep packed sequences apart: {problem}. Train with --packing false (padded "
            "micro-batches), or with a model whose attention masks packed rows (transformers' sdpa or eager, "
            "config.use_cache False)."
        )
    if packing is True:
        return True, "--packing true"
    if packing is False:
        return False, "--packing false"
    if device_type != "cuda":
        return False, f"--packing auto: off on {device_type}, where the padded defaults stay"
    if problem is not None:
        return False, f"--packing auto: off, {problem}"
    return True, "--packing auto: on with CUDA, the micro-batch's samples packed into rows without padding"


def check_packed_model(model) -> None:
    """Refuse to pack batches for a model whose attention would mix sequences.

    Args:
        model (torch.nn.Module): the loaded model, peft-wrapped or not.

    Raises:
        ValueError: :func:`packing_problem`'s reason.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    resolve_packing(True, "", packing_problem(base.config, type(base)))
