"""Padding-free micro-batches: a micro-batch's samples packed whole into rows, each sequence masked off from its
neighbours by ``position_ids`` that restart at 0 (``DataSettings.packing``).

A right-padded micro-batch of mixed lengths computes ``size x longest`` tokens; packed, it computes about the sum of
its lengths. The samples of a micro-batch, hence of a step and its gradient, do not change: only their layout does.

* Rows: ``pack_rows`` puts the samples into rows of at most ``row_tokens`` (the run's ``max_seq_len``) first-fit
  decreasing; rows are right-padded to the longest row. Rows, not one long row, because sdpa and eager attention pay
  for the whole row squared (a dense block-diagonal mask): rows no longer than a padded sample cost no more attention
  than the padded batch, and far fewer tokens.
* Isolation: with no ``attention_mask`` and no cache, ``transformers.masking_utils`` (``find_packed_sequence_indices``)
  reads a restart of ``position_ids`` as a sequence boundary and builds a block-diagonal causal mask for sdpa, eager
  and flex attention; rotary positions restart with them. Flash attention reads boundaries from ``position_ids`` only
  in a batch of one row (``_is_packed_sequence``): with several rows it would let a sequence attend to the one before
  it, so :func:`packing_problem` refuses it, as it refuses every other way the mask could be lost.
* Loss: ``labels`` is -100 at each sequence's first position, so no token predicts across a boundary (the causal LM
  loss shifts labels left by one), and on the padding. Every other label is the sample's own: the per-token losses,
  the answer-token count (``answer_tokens``) and so the normalised loss equal the padded batch's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .settings import IGNORE_INDEX

# Attention implementations that honour a packed row's position_ids through transformers' mask functions.
MASKED_ATTENTION = ("sdpa", "eager", "flex_attention")
# Flash kernels honour position_ids only in a batch of one row: several packed rows would leak across sequences.
ONE_ROW_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


def pack_rows(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """First-fit decreasing: the positions of ``lengths`` grouped into rows of at most ``row_tokens`` tokens.

    Longest first (ties by position, so the result is deterministic), each into the first row it fits; a sample
    longer than ``row_tokens`` gets a row of its own. Every position appears exactly once.

    Args:
        lengths (Sequence[int]): token lengths of the micro-batch's samples.
        row_tokens (int): the most tokens of a row holding more than one sample.

    Returns:
        list[list[int]]: positions into ``lengths``, one list per row, in the order placed.

    Raises:
        ValueError: ``row_tokens < 1`` or a length below 1.
    """
    if row_tokens < 1:
        raise ValueError(f"row_tokens={row_tokens}: must be >= 1.")
    if any(length < 1 for length in lengths):
        raise ValueError(f"lengths {list(lengths)}: every sample needs at least one token.")
    rows: list[list[int]] = []
    room: list[int] = []
    for position in sorted(range(len(lengths)), key=lambda p: (-lengths[p], p)):
        row = next((r for r, free in enumerate(room) if free >= lengths[position]), None)
        if row is None:
            rows.append([position])
            room.append(row_tokens - lengths[position])
        else:
            rows[row].append(position)
            room[row] -= lengths[position]
    return rows


def packed_cost(lengths: Sequence[int], row_tokens: int) -> int:
    """Tokens a packed micro-batch computes, padding included: its rows times its longest row."""
    rows = pack_rows(lengths, row_tokens)
    return len(rows) * max(sum(lengths[p] for p in row) for row in rows)


class PackedCollator:
    """Collate samples into packed rows: ``input_ids``, ``labels`` and ``position_ids``, no ``attention_mask``.

    Each row holds whole samples (:func:`pack_rows`); its ``position_ids`` restart at 0 for each sample, ``labels``
    is -100 at each sample's first position (the one token that would be predicted from the previous sample). Rows
    are right-padded to the longest row with ``pad_token_id``, labels -100 and position ids counting from 0 (one
    more block, after every real token: causal attention never lets a real token see it). A drop-in for
    ``make_collator``'s collator: the same samples, the same loss.

    Args:
        pad_token_id (int): the tokenizer's pad token, for the padding at the end of rows.
        row_tokens (int): the most tokens of a row, the run's ``max_seq_len``.
    """

    def __init__(self, pad_token_id: int, row_tokens: int) -> None:
        if pad_token_id is None:
            raise ValueError("PackedCollator needs the tokenizer's pad_token_id, for the end of rows.")
        self.pad_token_id, self.row_tokens = int(pad_token_id), row_tokens

    def cost(self, lengths: Sequence[int]) -> int:
        """Tokens one micro-batch of these sample lengths computes: what ``balanced_plan`` balances over ranks."""
        return packed_cost(lengths, self.row_tokens)

    def __call__(self, features: list[dict]) -> dict:
        import torch

        ids = [list(f["input_ids"]) for f in features]
        labels = [list(f["labels"]) if "labels" in f else list(f["input_ids"]) for f in features]
        rows = pack_rows([len(i) for i in ids], self.row_tokens)
        width = max(sum(len(ids[p]) for p in row) for row in rows)
        out = {name: torch.empty(len(rows), width, dtype=torch.int64) for name in ("input_ids", "labels")}
        out["position_ids"] = torch.empty(len(rows), width, dtype=torch.int64)
        for r, row in enumerate(rows):
            row_ids, row_labels, row_positions = [], [], []
            for p in sorted(row):  # samples in batch order within a row: the order does not change the loss
                row_ids += ids[p]
                row_labels += [IGNORE_INDEX] + labels[p][1:]
                row_positions += range(len(ids[p]))
            pad = width - len(row_ids)
            out["input_ids"][r] = torch.tensor(row_ids + [self.pad_token_id] * pad)
            out["labels"][r] = torch.tensor(row_labels + [IGNORE_INDEX] * pad)
            out["position_ids"][r] = torch.tensor(row_positions + list(range(pad)))
        return out


def packing_problem(config, model_class: type | None = None) -> str | None:
    """Why packed rows would let a sequence attend to its neighbour in this model, or None when they cannot.

    Packed rows are isolated only by the mask ``transformers.masking_utils`` builds from ``position_ids`` when there is
    no ``attention_mask`` and no cache. So the model must build its mask there (its modeling module imports
    ``create_causal_mask``: remote code and hand-written masks may not), with an attention implementation that
    applies that mask within a row (:data:`MASKED_ATTENTION`), and without a cache (``config.use_cache`` on makes an
    evaluation forward build one, and the mask then ignores the restarts).

    Args:
        config (PretrainedConfig): the model's config; ``_attn_implementation`` None means transformers' default
            (sdpa, else eager), both fine.
        model_class (type | None): the model's class. Default: the causal-LM class transformers maps ``config`` to.

    Returns:
        str | None: the reason, naming what is wrong, or None.
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
    """``DataSettings.packing`` for this run: whether to pack, and why (logged once on rank 0).

    ``auto`` packs on CUDA, where padding is compute the GPU spends for nothing and the micro-batches are large
    enough to hold mixed lengths; on the CPU it keeps the padded batches the tests and demos were measured with. It
    does not pack a model that :func:`packing_problem` rejects, and says why.

    Args:
        packing (bool | str): True, False or ``"auto"``.
        device_type (str): this rank's device type (``cuda``, ``cpu``).
        problem (str | None): :func:`packing_problem` of the model to train.

    Returns:
        tuple[bool, str]: pack or not, and the reason.

    Raises:
        ValueError: ``packing=True`` with a ``problem``, naming the setting and the fixes.
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
    """Refuse, before training, to pack batches for a model that would let a sequence attend to its neighbour.

    Args:
        model (torch.nn.Module): the loaded model, a peft model or the transformers model itself.

    Raises:
        ValueError: :func:`packing_problem`'s reason, naming ``--packing`` and the fixes.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    resolve_packing(True, "", packing_problem(base.config, type(base)))
