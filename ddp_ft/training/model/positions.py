"""A model's positions, against the longest sequence a run or a generation gives it.

A model with learned position embeddings (GPT-2, OPT) has one row per position and no more.
A position past the last row is an index error in the first long batch: on a GPU, a device-side assert.
Rotary positions go on past ``max_position_embeddings``, but past what the model was trained on they extrapolate.
"""

from __future__ import annotations

from collections.abc import Callable


def check_positions(
    config, tokens: int, setting: str, fix: Callable[[int], str], padded: int | None = None
) -> str | None:
    """Refuse a sequence past a model's learned positions; describe one past its rotary trained ones.

    Args:
        config (PretrainedConfig): the model's (its text config is read, for a multimodal one).
        tokens (int): the longest sequence's tokens.
        setting (str): the settings that make it so long, as a user writes them.
        fix (Callable[[int], str]): from the model's position limit, the sentence that says how to shorten it.
        padded (int | None): the sequence's width with padding, where that is more. Default: ``tokens``

    Returns:
        str | None: a warning for the caller to log once, where rotary positions go past the trained ones.

    Raises:
        ValueError: the sequence, padding included, past learned position embeddings.
    """
    config = config.get_text_config()
    limit, name = getattr(config, "max_position_embeddings", None), config.model_type
    rotary = getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None)
    if not limit or getattr(config, "alibi", False):  # no positions to run out of
        return None
    width = max(tokens, padded or 0)
    if not rotary and width > limit:
        shown = f"{width} positions wide, padding included" if width > tokens else f"{width} tokens long"
        raise ValueError(
            f"{setting}: sequences up to {shown}, but {name} has learned position embeddings for {limit} only. "
            f"{fix(limit)}."
        )
    if rotary and tokens > limit:
        return (
            f"{setting}: sequences up to {tokens} tokens long, past the {limit} positions {name} was trained on. Its "
            f"rotary positions past them are extrapolated, which can degrade what it learns and writes. {fix(limit)}, "
            "or give the model rope scaling (rope_parameters in its config.json)."
        )
    return None


def check_generation(config, prompt_tokens: int, max_new_tokens: int, setting: str) -> str | None:
    """:func:`check_positions` for a generation: the longest prompt and the tokens written after it."""
    writing = f"{setting} with --max-new-tokens {max_new_tokens}, after a prompt of {prompt_tokens} tokens"

    def fix(limit: int) -> str:
        room = limit - prompt_tokens
        return (
            f"Set --max-new-tokens {room} or less" if room > 0 else "The prompt alone fills them: give shorter inputs"
        )

    return check_positions(config, prompt_tokens + max_new_tokens, writing, fix)
