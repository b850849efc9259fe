"""Data formats: which one a source is in, and its rows in one of four standard shapes.

A format is found from the columns or named with ``--format``. The shapes ``tokenize_dataset`` encodes:

* ``pair``: ``dialogue`` and ``summary``, any input-answer pair;
* ``chat``: ``messages`` and ``loss_from``, the first message that may carry loss;
* ``completion``: plain ``prompt`` and ``completion`` strings, as TRL writes them;
* ``text``: ``text``, every token trained.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

AUTO = "auto"
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}
ROLES |= {"model": "assistant", "chatgpt": "assistant"}  # ShareGPT's names


@dataclass(frozen=True)
class DataFormat:
    """One data format: its name, the columns that mark it, and its standard shape.

    Args:
        name (str): what ``--format`` calls it.
        columns (tuple[str, ...]): columns a source must have.
        shape (str): ``pair``, ``chat``, ``completion`` or ``text``.
        optional (tuple[str, ...]): columns read when present.
    """

    name: str
    columns: tuple[str, ...]
    shape: str
    optional: tuple[str, ...] = ()

    def describe(self) -> str:
        optional = "".join(f", [{column}]" for column in self.optional)
        return f"{self.name} ({', '.join(self.columns)}{optional})"


MESSAGES = DataFormat("messages", ("messages",), "chat")
SHAREGPT = DataFormat("sharegpt", ("conversations",), "chat")
ALPACA = DataFormat("alpaca", ("instruction", "output"), "chat", optional=("input", "system"))
PROMPT_COMPLETION = DataFormat("prompt_completion", ("prompt", "completion"), "chat")
PLAIN_PROMPT_COMPLETION = DataFormat("prompt_completion", ("prompt", "completion"), "completion")
TEXT = DataFormat("text", ("text",), "text")
_LAST = (PROMPT_COMPLETION, TEXT)
FORMAT_NAMES = (AUTO, "pair", "messages", "sharegpt", "alpaca", "prompt_completion", "text")


def pair_format(dialogue_column: str, summary_column: str) -> DataFormat:
    """The input-answer pair, in the columns the settings name."""
    return DataFormat("pair", (dialogue_column, summary_column), "pair")


def known_formats(settings) -> list[DataFormat]:
    """Every format, in the order ``auto`` tries them."""
    return [pair_format(settings.dialogue_column, settings.summary_column), MESSAGES, SHAREGPT, ALPACA, *_LAST]


def resolve_format(features, settings, where: str) -> DataFormat:
    """The format of a split: the one ``settings.format`` names, or the first whose columns it has.

    Non-default pair columns imply the pair format. Prompt/completion strings are plain; lists of turns are chat.

    Args:
        features (datasets.Features): the split's columns and types.
        settings (DataSettings): ``format`` and the pair's columns.
        where (str): the source, named in errors.

    Raises:
        ValueError: a named format's columns are missing, or no format matches.
    """
    columns = list(features)
    formats = {f.name: f for f in known_formats(settings)}
    named = "pair" if settings.format == AUTO and settings.pair_columns_set else settings.format
    if named == AUTO:
        fmt = next((f for f in formats.values() if set(f.columns) <= set(columns)), None)
        if fmt is None and not set(formats["pair"].columns).isdisjoint(columns):
            fmt = formats["pair"]  # the source's check names the missing column
        if fmt is None:
            raise ValueError(f"{where}: no known data format in its columns. {_columns_help(columns)}")
    else:
        fmt = formats[named]
        missing = [column for column in fmt.columns if column not in columns]
        if missing and fmt.name != "pair":  # the source's own check names the pair's
            raise ValueError(f"{where}: --format {fmt.name} needs column(s) {missing}. {_columns_help(columns, fmt)}")
    plain = fmt is PROMPT_COMPLETION and getattr(features["prompt"], "dtype", None) in ("string", "large_string")
    return PLAIN_PROMPT_COMPLETION if plain else fmt


def _columns_help(columns: list[str], fmt: DataFormat | None = None) -> str:
    shown = ", ".join(f.describe() for f in (FORMATS_HELP if fmt is None else [fmt]))
    return (
        f"Columns found: {columns}. Formats and their columns: {shown} (the pair's: --dialogue-column, "
        "--summary-column). Rename the columns, or name the format with --format (docs/own_data.md shows each)."
    )


FORMATS_HELP = [pair_format("dialogue", "summary"), MESSAGES, SHAREGPT, ALPACA, PROMPT_COMPLETION, TEXT]


# Rows into their standard shape (batched ``Dataset.map`` functions)


def standard_rows(batch: dict[str, list], fmt: DataFormat) -> dict[str, list]:
    """A batch of ``fmt`` rows in its standard shape; rows with nothing to learn get an empty answer."""
    if fmt.shape == "pair":
        dialogue, summary = fmt.columns
        return {"dialogue": batch[dialogue], "summary": batch[summary]}
    if fmt.shape == "text":
        return {"text": [text if isinstance(text, str) else "" for text in batch["text"]]}
    if fmt.shape == "completion":
        return {"prompt": batch["prompt"], "completion": batch["completion"]}
    rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
    chats = [_chat(row, fmt) for row in rows]
    return {"messages": [messages for messages, _ in chats], "loss_from": [start for _, start in chats]}


def _chat(row: dict, fmt: DataFormat) -> tuple[list[dict[str, str]], int]:
    """One row as (messages, index of the first message that may carry loss)."""
    if fmt is ALPACA:
        system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
        user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        return [*system, _turn("user", user), _turn("assistant", row["output"])], 0
    if fmt is PROMPT_COMPLETION:
        prompt, completion = _turns(row["prompt"], "prompt"), _turns(row["completion"], "completion")
        return prompt + completion, len(prompt)
    return _turns(row[fmt.columns[0]], fmt.columns[0]), 0


def _turns(turns: object, column: str) -> list[dict[str, str]]:
    if not isinstance(turns, list):
        raise ValueError(f"column {column!r}: expected a list of turns, got {type(turns).__name__}: {turns!r:.80}")
    return [_message(turn, column) for turn in turns]


def _message(turn: object, column: str) -> dict[str, str]:
    """A turn as ``{role, content}``, from OpenAI's or ShareGPT's keys."""
    if not isinstance(turn, dict):
        raise ValueError(f"column {column!r}: a turn must be a mapping with role and content, got {turn!r:.80}")
    role, content = turn.get("role", turn.get("from")), turn.get("content", turn.get("value"))
    if role is None or str(role).lower() not in ROLES:
        raise ValueError(
            f"column {column!r}: turn role {role!r} is not one of {sorted(ROLES)}; map it to system, user or "
            f"assistant before training. The turn: {turn!r:.120}"
        )
    return _turn(ROLES[str(role).lower()], _text(content, column))


def _text(content: object, column: str) -> str:
    """A turn's text: a string, or the text parts of a content list."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(part.get("text") or "" for part in content)
    raise ValueError(f"column {column!r}: only text content can be trained, got {content!r:.120}")


def _turn(role: str, content: object) -> dict[str, str]:
    return {"role": role, "content": "" if content is None else str(content)}


def has_answer(batch: dict[str, list]) -> list[bool]:
    """Whether each standard row has something to learn."""
    if "summary" in batch:
        pairs = zip(batch["dialogue"], batch["summary"], strict=True)
        return [bool(str(d or "").strip() and str(s or "").strip()) for d, s in pairs]
    if "text" in batch:
        return [bool(text.strip()) for text in batch["text"]]
    if "completion" in batch:
        return [bool(str(c or "").strip()) for c in batch["completion"]]
    return [
        any(m["role"] == "assistant" and m["content"].strip() for m in messages[start:])
        for messages, start in zip(batch["messages"], batch["loss_from"], strict=True)
    ]
