"""Standard rows into training samples through the chat template, with loss only on the answers.

A pair loses the middle of its transcript to fit ``max_seq_len``. A conversation keeps its system prompt and last
whole turns. A text is split into windows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .conversation import fit_completion, fit_conversation, text_windows
from .settings import (
    DEFAULT_KEEP_PROMPT_HEAD,
    DEFAULT_KEEP_PROMPT_TAIL,
    HEAD_DIALOGUE_TOKENS,
    IGNORE_INDEX,
    MIN_ANSWER_TOKENS,
    TAIL_DIALOGUE_TOKENS,
    DataSettings,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TruncatedExample:
    """One training sample: ``labels`` is -100 on the prompt."""

    input_ids: list[int]
    labels: list[int]
    prompt_cut: bool
    answer_cut: bool


def truncate_example(
    prompt_ids: Sequence[int],
    answer_ids: Sequence[int],
    max_len: int,
    keep_prompt_head: int = DEFAULT_KEEP_PROMPT_HEAD,
    keep_prompt_tail: int = DEFAULT_KEEP_PROMPT_TAIL,
    min_prompt_tokens: int | None = None,
) -> TruncatedExample:
    """Fit prompt + answer into ``max_len`` tokens, cutting the prompt's middle and the answer's end.

    A prompt's head holds the template and instruction, its tail the generation prompt, so both are kept. A long
    answer still leaves ``min_prompt_tokens`` for the prompt, so no sample is mostly answer.

    Args:
        prompt_ids (Sequence[int]): the prompt, generation prompt included.
        answer_ids (Sequence[int]): the answer, end-of-turn tokens included.
        max_len (int): the most tokens of the result.
        keep_prompt_head (int): prompt tokens always kept from the start. Default: 32
        keep_prompt_tail (int): prompt tokens always kept from the end. Default: 16
        min_prompt_tokens (int | None): room a long answer must leave the prompt. Default: head + tail

    Returns:
        TruncatedExample: at most ``max_len`` tokens, at least one answer token.

    Raises:
        ValueError: ``max_len`` too small for head and tail, an empty answer, or negative sizes.

    Example:
        >>> truncate_example(list(range(100)), [7, 8], max_len=50).prompt_cut
        True
    """
    if keep_prompt_head < 0 or keep_prompt_tail < 0:
        raise ValueError(f"keep_prompt_head={keep_prompt_head}, keep_prompt_tail={keep_prompt_tail}: must be >= 0.")
    reserve = keep_prompt_head + keep_prompt_tail
    if max_len < reserve + 1:
        raise ValueError(
            f"max_len={max_len} cannot hold the prompt head ({keep_prompt_head}) + tail ({keep_prompt_tail}) + 1 "
            f"answer token: use max_len >= {reserve + 1}."
        )
    if not answer_ids:
        raise ValueError("answer_ids is empty: a sample needs at least one answer token to train on.")
    min_prompt = reserve if min_prompt_tokens is None else max(min_prompt_tokens, reserve)
    prompt, answer = list(prompt_ids), list(answer_ids)
    answer_cut = prompt_cut = False
    if len(prompt) + len(answer) > max_len:
        answer_budget = max(1, max_len - min(len(prompt), min_prompt))
        if len(answer) > answer_budget:
            answer, answer_cut = answer[:answer_budget], True
        prompt_budget = max_len - len(answer)
        if len(prompt) > prompt_budget:
            tail = prompt_budget - keep_prompt_head  # at least keep_prompt_tail
            prompt, prompt_cut = prompt[:keep_prompt_head] + prompt[len(prompt) - tail :], True
    return TruncatedExample(prompt + answer, [IGNORE_INDEX] * len(prompt) + answer, prompt_cut, answer_cut)


@dataclass(frozen=True)
class TruncationReport:
    """How many samples ``tokenize_dataset`` had to cut, drop or split.

    Args:
        samples (int): samples made.
        prompt_cut (int): prompts cut in their middle.
        answer_cut (int): answers cut at their end.
        max_len (int): ``max_seq_len``.
        longest (int): tokens of the longest sample before cutting.
        turns_cut (int): conversations that lost their first turns.
        dropped (int): rows left with no answer token.
        texts_split (int): texts split into windows.
    """

    samples: int
    prompt_cut: int
    answer_cut: int
    max_len: int
    longest: int = field(default=0, compare=False)
    turns_cut: int = 0
    dropped: int = 0
    texts_split: int = 0

    def __str__(self) -> str:
        extra = f", {self.turns_cut} conversations lost their first turns" if self.turns_cut else ""
        extra += f", {self.dropped} dropped with no answer token left" if self.dropped else ""
        extra += f", {self.texts_split} texts split into windows" if self.texts_split else ""
        return (
            f"{self.samples} samples, {self.prompt_cut} prompts and {self.answer_cut} answers cut to "
            f"{self.max_len} tokens{extra}"
        )

    def advice(self) -> str | None:
        """What a cut costs and the setting that avoids it; None when nothing was cut."""
        cuts = (self.prompt_cut, self.answer_cut, self.turns_cut, self.dropped)
        if not (any(cuts) or self.texts_split):
            return None
        share = max(cuts) / max(1, self.samples + self.dropped)
        return (
            f"{self} ({share:.0%} of the training samples; the longest has {self.longest} tokens): a cut prompt "
            "loses the middle of its input or a conversation its first turns, a cut answer its end, so the model "
            "learns answers without the text they came from. If the cut part matters, raise --max-seq-len (up to "
            f"{self.longest} keeps every sample whole; memory per micro-batch grows with it) or shorten the inputs "
            "(docs/own_data.md)."
        )


def _id_lists(out: Any) -> list[list[int]]:
    """``apply_chat_template(tokenize=True)``'s output as id lists, on transformers 4.x or 5.x."""
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [list(ids) for ids in out]


def _messages(instruction: str, dialogue: str, summary: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": f"{instruction}\n\n{dialogue}"}]
    if summary is not None:
        messages.append({"role": "assistant", "content": summary})
    return messages


def template_overhead(tokenizer, instruction: str) -> tuple[int, int]:
    """Prompt tokens the template and instruction add before and after the transcript."""
    marker = "\u2063TRANSCRIPT\u2063"
    text = tokenizer.apply_chat_template(_messages(instruction, marker), add_generation_prompt=True, tokenize=False)
    if text.count(marker) != 1:
        logger.warning("could not locate the transcript in the chat template; using default truncation sizes")
        return DEFAULT_KEEP_PROMPT_HEAD - HEAD_DIALOGUE_TOKENS, DEFAULT_KEEP_PROMPT_TAIL - TAIL_DIALOGUE_TOKENS
    before, after = text.split(marker)
    before_ids, after_ids = (tokenizer(part, add_special_tokens=False)["input_ids"] for part in (before, after))
    return len(before_ids), len(after_ids)


def _encode_batch(batch, tokenizer, instruction, max_len, head, tail, min_prompt):
    prompts = [_messages(instruction, d) for d in batch["dialogue"]]
    fulls = [_messages(instruction, d, s) for d, s in zip(batch["dialogue"], batch["summary"], strict=True)]
    prompt_ids = _id_lists(tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True))
    full_ids = _id_lists(tokenizer.apply_chat_template(fulls, tokenize=True))
    out = {"input_ids": [], "labels": [], "prompt_cut": [], "answer_cut": [], "full_len": []}
    for prompt, full, prompt_msgs, full_msgs in zip(prompt_ids, full_ids, prompts, fulls, strict=True):
        if full[: len(prompt)] == prompt:
            answer = full[len(prompt) :]
        else:  # the template renders the last turn differently, or BPE merged across
            prompt_text = tokenizer.apply_chat_template(prompt_msgs, add_generation_prompt=True, tokenize=False)
            full_text = tokenizer.apply_chat_template(full_msgs, tokenize=False)
            answer_text = (
                full_text[len(prompt_text) :] if full_text.startswith(prompt_text) else full_msgs[-1]["content"]
            )
            answer = tokenizer(answer_text, add_special_tokens=False)["input_ids"]
        sample = truncate_example(prompt, answer, max_len, head, tail, min_prompt)
        for key in ("input_ids", "labels", "prompt_cut", "answer_cut"):
            out[key].append(getattr(sample, key))
        out["full_len"].append(len(prompt) + len(answer))
    return out


def tokenize_dataset(raw, tokenizer, settings: DataSettings, num_proc: int = 1):
    """Tokenize standard rows into training samples of at most ``max_seq_len`` tokens.

    Answers include the template's end of turn, so the model learns to stop.

    Args:
        raw (datasets.Dataset): from ``load_raw_splits``.
        tokenizer (PreTrainedTokenizerBase): with a chat template.
        settings (DataSettings): ``instruction`` and ``max_seq_len``.
        num_proc (int): worker processes for ``Dataset.map``. Default: 1

    Returns:
        tuple[datasets.Dataset, TruncationReport]: ``input_ids`` and ``labels``, and the cut counts.

    Raises:
        ValueError: ``max_seq_len`` too small for this template.

    Example:
        >>> train, report = tokenize_dataset(raw, tokenizer, settings.data)
    """
    if len(raw) == 0:
        empty = raw.select_columns([]).add_column("input_ids", []).add_column("labels", [])
        return empty, TruncationReport(0, 0, 0, settings.max_seq_len)
    if "summary" in raw.column_names:
        return _tokenize_pairs(raw, tokenizer, settings, num_proc)
    ds = raw.map(
        _encode_rows,
        batched=True,
        batch_size=64,
        fn_kwargs={"tokenizer": tokenizer, "max_len": settings.max_seq_len},
        remove_columns=raw.column_names,
        num_proc=num_proc if num_proc > 1 else None,
        desc="Tokenizing",
    )
    kept = ds.filter(lambda n: n > 0, input_columns="kept_len")
    stats = {key: ds[key] for key in ("turns_cut", "answer_cut", "split", "full_len")}
    report = TruncationReport(
        samples=len(kept),
        prompt_cut=0,
        answer_cut=sum(stats["answer_cut"]),
        max_len=settings.max_seq_len,
        longest=max(stats["full_len"]),
        turns_cut=sum(n > 0 for n in stats["turns_cut"]),
        dropped=len(ds) - len(kept),
        texts_split=sum(stats["split"]),
    )
    logger.info("tokenized %s: %s", settings.source, report)
    return kept.select_columns(["input_ids", "labels"]), report


def _encode_rows(batch, tokenizer, max_len):
    """Conversations, completions or texts as samples; ``kept_len`` 0 marks a row to drop."""
    out = {key: [] for key in ("input_ids", "labels", "turns_cut", "answer_cut", "split", "full_len", "kept_len")}

    def add(ids, labels, full_len, turns_cut=0, answer_cut=False, split=False):
        values = (ids, labels, turns_cut, answer_cut, split, full_len, len(ids))
        for key, value in zip(out, values, strict=True):
            out[key].append(value)

    if "text" in batch:
        for text in batch["text"]:
            windows = text_windows(tokenizer, text, max_len)
            for n, window in enumerate(windows):
                add(window, window, len(window), split=n == 1)
        return out
    if "completion" in batch:
        pairs = zip(batch["prompt"], batch["completion"], strict=True)
        samples = [fit_completion(tokenizer, p, c, max_len) for p, c in pairs]
    else:
        rows = zip(batch["messages"], batch["loss_from"], strict=True)
        samples = [fit_conversation(tokenizer, m, start, max_len) for m, start in rows]
    for s in samples:
        add(s.input_ids, s.labels, s.full_len, s.turns_cut, s.answer_cut)
    return out


def _tokenize_pairs(raw, tokenizer, settings: DataSettings, num_proc: int):
    """(dialogue, summary) pairs through the chat template, the transcript cut in its middle."""
    before, after = template_overhead(tokenizer, settings.instruction)
    head, tail = before + HEAD_DIALOGUE_TOKENS, after + TAIL_DIALOGUE_TOKENS
    minimum = head + tail + MIN_ANSWER_TOKENS
    if settings.max_seq_len < minimum:
        raise ValueError(
            f"DataSettings.max_seq_len={settings.max_seq_len} is too small for this tokenizer and instruction: the "
            f"prompt head takes {head} tokens and the tail {tail}; use max_seq_len >= {minimum} "
            f"(room for {MIN_ANSWER_TOKENS} answer tokens) or a shorter instruction."
        )
    kwargs = dict(
        tokenizer=tokenizer,
        instruction=settings.instruction,
        max_len=settings.max_seq_len,
        head=head,
        tail=tail,
        min_prompt=max(head + tail, settings.max_seq_len // 2),
    )
    ds = raw.map(
        _encode_batch,
        batched=True,
        batch_size=64,
        fn_kwargs=kwargs,
        remove_columns=raw.column_names,
        num_proc=num_proc if num_proc > 1 else None,
        desc="Tokenizing",
    )
    report = TruncationReport(
        len(ds), sum(ds["prompt_cut"]), sum(ds["answer_cut"]), settings.max_seq_len, max(ds["full_len"])
    )
    logger.info("tokenized %s: %s", settings.source, report)
    return ds.remove_columns(["prompt_cut", "answer_cut", "full_len"]), report
