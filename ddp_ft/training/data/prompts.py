"""Prompts for generation, cut from the training encoding itself so the two cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass

from .conversation import encode_messages
from .formatting import _id_lists, _messages
from .settings import IGNORE_INDEX, DataSettings

_PLACEHOLDER = "\u2063"  # rendered, then cut off again


@dataclass(frozen=True)
class Prompt:
    """A prompt to generate from, and the row's own answer.

    Args:
        input_ids (list[int]): the tokens, ending where the answer starts.
        text (str): the same, decoded.
        reference (str | None): the row's answer, if any.
    """

    input_ids: list[int]
    text: str
    reference: str | None


def prompt_of(row: dict, tokenizer, settings: DataSettings) -> Prompt:
    """The generation prompt of one standard row, and its reference answer.

    Example:
        >>> prompt_of({"dialogue": "A: hi", "summary": None}, tokenizer, settings.data).text
    """
    if "summary" in row:
        messages = _messages(settings.instruction, row["dialogue"])
        ids = _id_lists(tokenizer.apply_chat_template([messages], add_generation_prompt=True, tokenize=True))[0]
        return _prompt(tokenizer, ids, row["summary"])
    if "completion" in row:
        return _prompt(tokenizer, tokenizer(row["prompt"])["input_ids"], row["completion"])
    if "text" in row:
        return _prompt(tokenizer, tokenizer(row["text"])["input_ids"], None)
    return chat_prompt(row["messages"], tokenizer, row.get("loss_from", 0))


def first_prompts(rows, tokenizer, settings: DataSettings, n: int) -> list[Prompt]:
    """The prompts of the first ``n`` standard rows, which ``--predict`` writes after."""
    return [prompt_of(rows[i], tokenizer, settings) for i in range(min(n, len(rows)))]


def chat_prompt(messages: list[dict], tokenizer, loss_from: int = 0) -> Prompt:
    """The tokens before the last answer, from the row's training encoding."""
    reference = None
    if messages and messages[-1]["role"] == "assistant":
        reference = messages[-1]["content"]
    else:
        messages = [*messages, {"role": "assistant", "content": _PLACEHOLDER}]
    ids, labels = encode_messages(tokenizer, messages, loss_from=min(loss_from, len(messages) - 1))
    start = len(labels)
    while start > 0 and labels[start - 1] == IGNORE_INDEX:  # back over the template's end of turn
        start -= 1
    while start > 0 and labels[start - 1] != IGNORE_INDEX:  # back over the last answer
        start -= 1
    return _prompt(tokenizer, ids[:start], reference)


def _prompt(tokenizer, ids: list[int], reference: str | None) -> Prompt:
    return Prompt(list(ids), tokenizer.decode(ids), reference)


def user_prompt(text: str, shape: str) -> dict:
    """A ``--prompt`` as a standard row of the run's shape, with no answer."""
    if shape == "pair":
        return {"dialogue": text, "summary": None}
    if shape == "completion":
        return {"prompt": text, "completion": None}
    if shape == "text":
        return {"text": text}
    return {"messages": [{"role": "user", "content": text}], "loss_from": 0}
