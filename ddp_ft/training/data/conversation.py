"""Conversations, completions and texts into training samples of at most ``max_len`` tokens.

Loss falls on every trained assistant turn only. Turns are found by rendering the conversation up to each one.
Where a template rewrites history (Qwen3 drops old reasoning), each answer's text is searched for instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from .settings import IGNORE_INDEX

_MARK = "\u2063ANSWER\u2063"


@dataclass(frozen=True)
class Encoded:
    """One sample, and what fitting it cost; empty ``input_ids`` drop the row.

    Args:
        input_ids (list[int]): the tokens.
        labels (list[int]): -100 where no loss falls.
        full_len (int): tokens before fitting.
        turns_cut (int): messages dropped from the start. Default: 0
        answer_cut (bool): the end was cut. Default: False
    """

    input_ids: list[int]
    labels: list[int]
    full_len: int
    turns_cut: int = 0
    answer_cut: bool = False


def render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    """The conversation as the tokenizer's chat template writes it."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def answer_spans(tokenizer, messages: list[dict], loss_from: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its trained answers.

    Args:
        tokenizer (PreTrainedTokenizerBase): with a chat template.
        messages (list[dict]): ``{role, content}`` turns.
        loss_from (int): the first message that may carry loss. Default: 0
    """
    full = render(tokenizer, messages)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if not _trained(message, i, loss_from):
            continue
        cursor = spans[-1][1] if spans else 0
        span = _prefix_span(tokenizer, messages, i, full)
        if span is None or span[0] < cursor:
            span = _located_span(tokenizer, message["content"], full, cursor)
        spans.append(span)
    return full, spans


def _trained(message: dict, i: int, loss_from: int) -> bool:
    """An assistant turn with text, at ``loss_from`` or later."""
    return message["role"] == "assistant" and i >= loss_from and bool(message["content"].strip())


def _prefix_span(tokenizer, messages: list[dict], i: int, full: str) -> tuple[int, int] | None:
    """Turn ``i``'s span as what it adds to the conversation; None if history is rewritten."""
    if i == 0:  # a template may open with a default system prompt
        return None
    try:
        before = render(tokenizer, messages[:i], generation_prompt=True)
        through = render(tokenizer, messages[: i + 1])
    except Exception:  # a template that refuses a partial conversation
        return None
    if through.startswith(before) and full.startswith(through) and len(through) > len(before):
        return len(before), len(through)
    return None


def _located_span(tokenizer, content: str, full: str, cursor: int) -> tuple[int, int]:
    """The answer's text found after ``cursor``, with the template's end of turn."""
    start = full.find(content, cursor)
    if start < 0:
        content = content.strip()
        start = full.find(content, cursor)
    if start < 0:
        raise ValueError(
            "the chat template does not write an assistant turn's text as given, so its loss cannot be placed: "
            f"{content!r:.80}. Use a template that writes message content verbatim (--chat-template)."
        )
    end = start + len(content)
    for suffix in (_end_of_turn(tokenizer), tokenizer.eos_token or ""):
        if suffix and full.startswith(suffix, end):
            return start, end + len(suffix)
    return start, end


def _end_of_turn(tokenizer) -> str:
    """What the template writes right after an answer's text."""
    probe = render(tokenizer, [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}])
    return probe.split(_MARK, 1)[1] if _MARK in probe else ""


def encode_messages(tokenizer, messages: list[dict], loss_from: int = 0) -> tuple[list[int], list[int]]:
    """Token ids and labels of a conversation, each piece tokenized apart.

    No special tokens are added: the template writes its own.
    """
    full, spans = answer_spans(tokenizer, messages, loss_from)
    ids: list[int] = []
    labels: list[int] = []
    cursor = 0
    for start, end in [*spans, (len(full), len(full))]:
        for text, trained in ((full[cursor:start], False), (full[start:end], True)):
            if text:
                piece = tokenizer(text, add_special_tokens=False)["input_ids"]
                ids += piece
                labels += piece if trained else [IGNORE_INDEX] * len(piece)
        cursor = end
    return ids, labels


def fit_conversation(tokenizer, messages: list[dict], loss_from: int, max_len: int) -> Encoded:
    """The conversation in at most ``max_len`` tokens: system prompt and the last turns that fit.

    Where even the last exchange does not fit, it is cut at its end. No answer token left means an empty sample.
    """
    last = max(i for i, m in enumerate(messages) if _trained(m, i, loss_from))
    messages = messages[: last + 1]
    ids, labels = encode_messages(tokenizer, messages, loss_from)
    full_len = len(ids)
    if full_len <= max_len:
        return Encoded(ids, labels, full_len)
    system = 0
    while system < len(messages) and messages[system]["role"] == "system":
        system += 1
    starts = [i for i in range(system + 1, last) if messages[i]["role"] == "user"]
    lo, hi, best = 0, len(starts) - 1, None
    while lo <= hi:  # fewer turns are never longer
        mid = (lo + hi) // 2
        kept = _from(tokenizer, messages, loss_from, system, starts[mid])
        if len(kept[0]) <= max_len:
            best, hi = (starts[mid], kept), mid - 1
        else:
            lo = mid + 1
    if best is not None:
        start, (ids, labels) = best
        return Encoded(ids, labels, full_len, turns_cut=start - system)
    start = starts[-1] if starts else system
    ids, labels = _from(tokenizer, messages, loss_from, system, start) if starts else (ids, labels)
    if all(label == IGNORE_INDEX for label in labels[:max_len]):
        return Encoded([], [], full_len)
    return Encoded(ids[:max_len], labels[:max_len], full_len, turns_cut=start - system, answer_cut=True)


def _from(tokenizer, messages: list[dict], loss_from: int, system: int, start: int) -> tuple[list[int], list[int]]:
    """The system prompt and the turns from ``start``, encoded."""
    kept = messages[:system] + messages[start:]
    return encode_messages(tokenizer, kept, max(system, loss_from - start + system))


def fit_completion(tokenizer, prompt: str, completion: str, max_len: int) -> Encoded:
    """A prompt and completion as TRL encodes them: no template, eos appended, loss on the completion."""
    eos = tokenizer.eos_token or ""
    text = prompt + (completion if completion.endswith(eos) else completion + eos)
    prompt_ids, ids = tokenizer(prompt)["input_ids"], tokenizer(text)["input_ids"]
    shared = next((n for n, (a, b) in enumerate(zip(prompt_ids, ids, strict=False)) if a != b), len(prompt_ids))
    shared = min(shared, len(ids))
    labels = [IGNORE_INDEX] * shared + ids[shared:]
    if shared >= max_len or shared == len(ids):
        return Encoded([], [], len(ids))
    return Encoded(ids[:max_len], labels[:max_len], len(ids), answer_cut=len(ids) > max_len)


def text_windows(tokenizer, text: str, max_len: int) -> list[list[int]]:
    """A text and eos in windows of ``max_len`` tokens; a one-token last window is dropped."""
    eos = tokenizer.eos_token or ""
    ids = tokenizer(text if text.endswith(eos) else text + eos)["input_ids"]
    windows = [ids[i : i + max_len] for i in range(0, len(ids), max_len)]
    return [window for window in windows if len(window) > 1]
