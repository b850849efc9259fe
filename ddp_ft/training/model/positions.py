"""A loaded model's positions, against the longest sequence a run or a generation gives it.

Some models hold one row per position: a learned embedding (GPT-2, OPT) or a fixed sine table (GPT-J, CodeGen). A
position past the last row is an index error in the first long batch; on a GPU, a device-side assert. Rotary models
compute positions instead. They take longer sequences, but past the positions they were trained on they extrapolate.
Which kind a model is, is read from its modules, not its config: configs name these parts in many ways.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def position_rows(model: torch.nn.Module) -> int | None:
    """How many positions the model's table holds, or None where it has no table of positions.

    The table is an embedding other than the input one, or a buffer, with one row per position of the text config's
    ``max_position_embeddings``. OPT's embedding holds two rows more, its ``offset``.
    """
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if not isinstance(limit, int) or limit < 1:
        return None
    tokens = model.get_input_embeddings()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and module is not tokens:
            if module.num_embeddings - getattr(module, "offset", 0) == limit:
                return limit
        for buffer in module.buffers(recurse=False):
            if buffer.dim() == 2 and buffer.shape[0] == limit:
                return limit
    return None


def is_rotary(model: torch.nn.Module) -> bool:
    """Whether the model computes rotary positions: transformers keeps their frequencies in buffers named ``inv_freq``,
    or ``<layer type>_inv_freq`` where layer types rotate differently (Gemma 3)."""
    return any(name.endswith("inv_freq") for name, _ in model.named_buffers())


def check_positions(
    model: torch.nn.Module, tokens: int, setting: str, fix: Callable[[int], str], padded: int | None = None
) -> str | None:
    """Refuse a sequence past a model's table of positions; describe one past its rotary trained ones.

    Args:
        model (torch.nn.Module): the loaded model (a peft model too).
        tokens (int): the longest sequence's tokens.
        setting (str): the settings that make it so long, as a user writes them.
        fix (Callable[[int], str]): from the model's position limit, the sentence that says how to shorten it.
        padded (int | None): the sequence's width with padding, where that is more. Default: ``tokens``

    Returns:
        str | None: a warning for the caller to log once, where rotary positions go past the trained ones.

    Raises:
        ValueError: the sequence, padding included, past the model's table of positions.
    """
    config = model.config.get_text_config()
    name, limit = config.model_type, getattr(config, "max_position_embeddings", None)
    rows, width = position_rows(model), max(tokens, padded or 0)
    if rows is not None and width > rows:
        shown = f"{width} positions wide, padding included" if width > tokens else f"{width} tokens long"
        raise ValueError(f"{setting}: sequences up to {shown}, but {name} has positions for {rows} only. {fix(rows)}.")
    if rows is None and isinstance(limit, int) and tokens > limit and is_rotary(model):
        return (
            f"{setting}: sequences up to {tokens} tokens long, past the {limit} positions {name} was trained on. Its "
            f"rotary positions past them are extrapolated, which can degrade what it learns and writes. {fix(limit)}, "
            "or give the model rope scaling (rope_parameters in its config.json)."
        )
    return None


def check_generation(model: torch.nn.Module, prompt_tokens: int, max_new_tokens: int, setting: str) -> str | None:
    """:func:`check_positions` for a generation: the longest prompt and the tokens written after it."""
    writing = f"{setting} with --max-new-tokens {max_new_tokens}, after a prompt of {prompt_tokens} tokens"

    def fix(limit: int) -> str:
        room = limit - prompt_tokens
        if room > 0:
            return f"Set --max-new-tokens {room} or less"
        return "The prompt alone fills them: give shorter inputs"

    return check_positions(model, prompt_tokens + max_new_tokens, writing, fix)
