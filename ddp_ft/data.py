"""Meeting transcripts -> ChatML prompt/answer ids -> truncated, label-masked samples -> per-rank batches.

The pipeline: ``load_raw_splits`` (hub id, local file or the embedded synthetic meetings; columns renamed to
``dialogue``/``summary``, empty rows dropped, an eval split found or held out), ``tokenize_dataset`` (chat
template, loss only on the answer, ``truncate_example`` to ``max_seq_len``), ``make_collator`` (right
padding, labels padded with -100) and ``EpochLoader`` (a ``DistributedSampler`` that cannot be iterated
without choosing the epoch; the same steps on every world size, no sample twice; exact resume inside an epoch
on any world size, see ``DataLayout``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .synthetic import generate_synthetic_meetings

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
SYNTHETIC = "synthetic"
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
# Suffixes that mark a source as a file rather than a hub id ("org/name"), to refuse formats we cannot read.
_OTHER_FILE_SUFFIXES = {".txt", ".tsv", ".xlsx", ".xls", ".arrow", ".gz", ".zip", ".xml", ".pkl", ".md"}

# Truncation defaults (see ``truncate_example``). ``tokenize_dataset`` derives the actual head and tail from the
# tokenizer's template overhead plus these many dialogue tokens; the static numbers bound ``max_seq_len`` early.
HEAD_DIALOGUE_TOKENS = 16
TAIL_DIALOGUE_TOKENS = 8
DEFAULT_KEEP_PROMPT_HEAD = 32
DEFAULT_KEEP_PROMPT_TAIL = 16
MIN_ANSWER_TOKENS = 16
MIN_MAX_SEQ_LEN = DEFAULT_KEEP_PROMPT_HEAD + DEFAULT_KEEP_PROMPT_TAIL + MIN_ANSWER_TOKENS


@dataclass
class DataSettings:
    """Where the (dialogue, summary) pairs come from and how they become training samples."""

    source: str = field(
        default="knkarthick/AMI",
        metadata={"help": "Hub dataset id, a local .jsonl/.json/.csv/.parquet file, or 'synthetic' (embedded)."},
    )
    dialogue_column: str = field(default="dialogue", metadata={"help": "Column holding the transcript."})
    summary_column: str = field(default="summary", metadata={"help": "Column holding the reference summary."})
    split: str = field(default="train", metadata={"help": "Split to train on (local files have only 'train')."})
    eval_split: str | None = field(
        default="validation",
        metadata={
            "help": "Split to evaluate on; if the source lacks it (or None), eval_fraction of train is held out."
        },
    )
    eval_fraction: float = field(
        default=0.05, metadata={"help": "Fraction of train held out for eval when there is no eval split (0: none)."}
    )
    max_seq_len: int = field(
        default=512, metadata={"help": "Tokens per sample; long transcripts are cut in the middle, answers at the end."}
    )
    num_synthetic: int = field(default=512, metadata={"help": "Samples generated when source is 'synthetic'."})
    # Not `seed`: one flag namespace holds every settings dataclass, and TrainSettings.seed owns --seed.
    data_seed: int = field(default=0, metadata={"help": "Seed of the synthetic data and of the eval hold-out."})
    instruction: str = field(
        default="Summarize the following meeting transcript.",
        metadata={"help": "Instruction put before the transcript in the user turn."},
    )

    def __post_init__(self) -> None:
        if not self.source or not self.source.strip():
            raise ValueError(
                "DataSettings.source is empty: give a hub dataset id, a .jsonl/.json/.csv/.parquet file or 'synthetic'."
            )
        suffix = Path(self.source).suffix.lower()
        if suffix in _OTHER_FILE_SUFFIXES or (suffix and suffix not in FILE_BUILDERS and Path(self.source).is_file()):
            raise ValueError(
                f"DataSettings.source={self.source!r}: unknown file extension {suffix!r}; use one of "
                f"{', '.join(FILE_BUILDERS)}, a hub dataset id, or 'synthetic'."
            )
        for name in ("dialogue_column", "summary_column", "split", "instruction"):
            if not getattr(self, name):
                raise ValueError(f"DataSettings.{name} is empty: give a non-empty string.")
        if self.dialogue_column == self.summary_column:
            raise ValueError(
                f"DataSettings.dialogue_column and summary_column are both {self.dialogue_column!r}: they must differ."
            )
        if self.eval_split == "":
            raise ValueError("DataSettings.eval_split is empty: give a split name or None (hold out eval_fraction).")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"DataSettings.eval_fraction={self.eval_fraction}: must be in [0, 1).")
        if self.max_seq_len < MIN_MAX_SEQ_LEN:
            raise ValueError(
                f"DataSettings.max_seq_len={self.max_seq_len}: must be >= {MIN_MAX_SEQ_LEN}, the least that holds "
                f"a prompt head ({DEFAULT_KEEP_PROMPT_HEAD} tokens: template, instruction, start of the transcript), "
                f"a prompt tail ({DEFAULT_KEEP_PROMPT_TAIL} tokens: end of the transcript and the assistant "
                f"generation prompt) and {MIN_ANSWER_TOKENS} answer tokens."
            )
        if self.num_synthetic < 2:
            raise ValueError(f"DataSettings.num_synthetic={self.num_synthetic}: must be >= 2 (train and eval).")

    @property
    def source_kind(self) -> str:
        """'synthetic', 'file' (a known file extension) or 'hub' (anything else, also a local dataset folder)."""
        if self.source == SYNTHETIC:
            return "synthetic"
        return "file" if Path(self.source).suffix.lower() in FILE_BUILDERS else "hub"


# ---------------------------------------------------------------------------------------------------------------
# Loading.


def _load_source(settings: DataSettings, cache_dir: str | None):
    """The source as a DatasetDict (files and synthetic data have one split, 'train')."""
    from datasets import Dataset, DatasetDict, load_dataset

    kind = settings.source_kind
    if kind == "synthetic":
        rows = generate_synthetic_meetings(settings.num_synthetic, settings.data_seed)
        return DatasetDict({"train": Dataset.from_list(rows)})
    if kind == "file":
        path = Path(settings.source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"DataSettings.source={settings.source!r}: no such file (resolved to {path.resolve()}); "
                "fix --source or use a hub dataset id or 'synthetic'."
            )
        if path.stat().st_size == 0:
            raise ValueError(f"DataSettings.source={settings.source!r}: the file is empty (split 'train' has no rows).")
        builder = FILE_BUILDERS[path.suffix.lower()]
        try:
            return load_dataset(builder, data_files={"train": str(path)}, cache_dir=cache_dir)
        except Exception as err:  # e.g. a CSV with only a header: "corresponds to no data"
            raise ValueError(
                f"DataSettings.source={settings.source!r}: no rows could be read as {builder} (empty or malformed "
                f"file?): {type(err).__name__}: {err}"
            ) from err
    try:
        return load_dataset(settings.source, cache_dir=cache_dir)
    except Exception as err:  # re-raised with the setting to change
        raise RuntimeError(
            f"DataSettings.source={settings.source!r}: could not load it as a hub dataset or local dataset folder "
            f"({type(err).__name__}: {err}). Offline? Use a local .jsonl/.json/.csv/.parquet file or 'synthetic'."
        ) from err


def _check_columns(ds, settings: DataSettings, split: str) -> None:
    wanted = {"dialogue_column": settings.dialogue_column, "summary_column": settings.summary_column}
    missing = {name: col for name, col in wanted.items() if col not in ds.column_names}
    if missing:
        what = "; ".join(f"{col!r} (--{name.replace('_', '-')}, DataSettings.{name})" for name, col in missing.items())
        raise ValueError(
            f"DataSettings.source={settings.source!r}, split {split!r}: missing column(s) {what}. Available columns: "
            f"{ds.column_names}. Set the setting to the column that holds the transcript / summary."
        )


def _non_empty(batch: dict[str, list]) -> list[bool]:
    pairs = zip(batch["dialogue"], batch["summary"], strict=True)
    return [bool(str(d or "").strip() and str(s or "").strip()) for d, s in pairs]


def _standardise(ds, settings: DataSettings, split: str):
    """Keep the two columns, named ``dialogue`` and ``summary``; drop rows where either is empty."""
    if len(ds) == 0:
        raise ValueError(f"DataSettings.source={settings.source!r}: split {split!r} is empty; nothing to train on.")
    _check_columns(ds, settings, split)
    ds = ds.select_columns([settings.dialogue_column, settings.summary_column])
    renames = {settings.dialogue_column: "dialogue", settings.summary_column: "summary"}
    ds = ds.rename_columns({k: v for k, v in renames.items() if k != v})
    before = len(ds)
    ds = ds.filter(_non_empty, batched=True)
    if len(ds) < before:
        logger.warning(
            "split %r: dropped %d of %d rows with an empty dialogue or summary", split, before - len(ds), before
        )
    if len(ds) == 0:
        raise ValueError(
            f"DataSettings.source={settings.source!r}: all {before} rows of split {split!r} have an empty dialogue "
            "or summary."
        )
    return ds


def load_raw_splits(settings: DataSettings, cache_dir: str | None = None):
    """Load ``settings.source`` as a DatasetDict with ``train`` and ``eval``, columns ``dialogue`` and ``summary``.

    The eval split is ``settings.eval_split`` when the source has it; otherwise (and when it is None)
    ``eval_fraction`` of train is held out, the same rows for the same seed (0: an empty eval split).
    Every check runs here, before any model is loaded.

    Args:
        settings (DataSettings): the source, columns, splits and seed.
        cache_dir (str | None): ``datasets`` cache folder. Default: None (the ``datasets`` default)

    Returns:
        datasets.DatasetDict: ``train`` and ``eval``.

    Raises:
        FileNotFoundError: a local file that does not exist.
        ValueError: a missing split or column (naming the setting to change), an empty split.
        RuntimeError: a hub dataset that cannot be loaded (e.g. offline).
    """
    from datasets import DatasetDict

    source = _load_source(settings, cache_dir)
    if settings.split not in source:
        raise ValueError(
            f"DataSettings.split={settings.split!r} not in {settings.source!r}; available splits: {list(source)}."
        )
    train = _standardise(source[settings.split], settings, settings.split)
    if settings.eval_split and settings.eval_split in source and settings.eval_split != settings.split:
        evaluation = _standardise(source[settings.eval_split], settings, settings.eval_split)
    elif settings.eval_fraction == 0.0:
        evaluation = train.select([])
    else:
        n_eval = max(1, round(settings.eval_fraction * len(train)))
        if n_eval >= len(train):
            raise ValueError(
                f"DataSettings.eval_fraction={settings.eval_fraction}: holding out {n_eval} of {len(train)} rows "
                "leaves nothing to train on; lower it or give an eval_split."
            )
        parts = train.train_test_split(test_size=n_eval, shuffle=True, seed=settings.data_seed)
        train, evaluation = parts["train"], parts["test"]
        logger.info(
            "no eval split %r: held out %d train rows (seed %d)", settings.eval_split, n_eval, settings.data_seed
        )
    return DatasetDict({"train": train, "eval": evaluation})


# ---------------------------------------------------------------------------------------------------------------
# Truncation and tokenization.


@dataclass(frozen=True)
class TruncatedExample:
    """One training sample: ``labels`` is -100 on the prompt and the answer ids on the answer."""

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
    """Fit prompt + answer into ``max_len`` tokens, cutting the prompt in its middle and the answer at its end.

    A prompt is ``<|im_start|>user\\n{instruction}\\n\\n{transcript}<|im_end|>\\n<|im_start|>assistant\\n``: its
    head holds the template and the instruction, its tail the generation prompt the model answers after, so
    both are kept and the transcript loses its middle. The answer first gives up its end, keeping at most
    ``max_len - min(len(prompt), min_prompt_tokens)`` tokens (never fewer than one); then the prompt keeps its
    first ``keep_prompt_head`` tokens and as many last tokens as fit exactly (at least ``keep_prompt_tail``).
    ``tokenize_dataset`` sets head and tail to the template overhead plus 16 and 8 transcript tokens, and
    ``min_prompt_tokens`` to half of ``max_len``, so no sample is mostly answer with no transcript.

    Args:
        prompt_ids (Sequence[int]): the prompt, generation prompt included.
        answer_ids (Sequence[int]): the answer, end-of-turn tokens included.
        max_len (int): the most tokens of the result.
        keep_prompt_head (int): prompt tokens always kept from the start. Default: 32
        keep_prompt_tail (int): prompt tokens always kept from the end. Default: 16
        min_prompt_tokens (int | None): prompt tokens a long answer must leave room for (at least head + tail).
            Default: None (head + tail)

    Returns:
        TruncatedExample: ``len(input_ids) <= max_len``, at least one answer token.

    Raises:
        ValueError: ``max_len`` below ``keep_prompt_head + keep_prompt_tail + 1``, an empty answer, negative sizes.
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
            tail = prompt_budget - keep_prompt_head  # >= keep_prompt_tail by the budgets above
            prompt, prompt_cut = prompt[:keep_prompt_head] + prompt[len(prompt) - tail :], True
    return TruncatedExample(prompt + answer, [IGNORE_INDEX] * len(prompt) + answer, prompt_cut, answer_cut)


@dataclass(frozen=True)
class TruncationReport:
    """How many samples ``tokenize_dataset`` had to cut."""

    samples: int
    prompt_cut: int
    answer_cut: int
    max_len: int

    def __str__(self) -> str:
        return (
            f"{self.samples} samples, {self.prompt_cut} prompts and {self.answer_cut} answers cut to "
            f"{self.max_len} tokens"
        )


def _id_lists(out: Any) -> list[list[int]]:
    """``apply_chat_template(tokenize=True)`` on a batch: a list of id lists (transformers 4.x) or a
    BatchEncoding/dict with ``input_ids`` (5.x returns a dict by default)."""
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [list(ids) for ids in out]


def _messages(instruction: str, dialogue: str, summary: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": f"{instruction}\n\n{dialogue}"}]
    if summary is not None:
        messages.append({"role": "assistant", "content": summary})
    return messages


def template_overhead(tokenizer, instruction: str) -> tuple[int, int]:
    """Prompt tokens the chat template and instruction add before and after the transcript.

    For ChatML and the default instruction with a Qwen tokenizer: about 11 before
    (``<|im_start|>user\\n`` + instruction + ``\\n\\n``) and 5 after (``<|im_end|>\\n<|im_start|>assistant\\n``).
    """
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
    out = {"input_ids": [], "labels": [], "prompt_cut": [], "answer_cut": []}
    for prompt, full, prompt_msgs, full_msgs in zip(prompt_ids, full_ids, prompts, fulls, strict=True):
        if full[: len(prompt)] == prompt:
            answer = full[len(prompt) :]
        else:  # the template renders the last turn differently, or BPE merged across the boundary
            prompt_text = tokenizer.apply_chat_template(prompt_msgs, add_generation_prompt=True, tokenize=False)
            full_text = tokenizer.apply_chat_template(full_msgs, tokenize=False)
            answer_text = (
                full_text[len(prompt_text) :] if full_text.startswith(prompt_text) else full_msgs[-1]["content"]
            )
            answer = tokenizer(answer_text, add_special_tokens=False)["input_ids"]
        sample = truncate_example(prompt, answer, max_len, head, tail, min_prompt)
        for key in out:
            out[key].append(getattr(sample, key))
    return out


def tokenize_dataset(raw, tokenizer, settings: DataSettings, num_proc: int = 1):
    """Chat-format, tokenize and truncate ``raw`` (columns ``dialogue``, ``summary``) into training samples.

    The user turn is ``f"{instruction}\\n\\n{dialogue}"``, the assistant turn the summary. Prompt ids come from
    ``apply_chat_template(user turn, add_generation_prompt=True)``, answer ids are what the full conversation
    adds after them (so the answer includes the template's end-of-turn tokens, and the model learns to stop).
    Truncation: ``truncate_example`` with head/tail = template overhead + 16/8 transcript tokens and
    ``min_prompt_tokens = max_seq_len // 2``.

    Args:
        raw (datasets.Dataset): from ``load_raw_splits``.
        tokenizer (PreTrainedTokenizerBase): with a chat template (``load_tokenizer`` guarantees one).
        settings (DataSettings): ``instruction`` and ``max_seq_len``.
        num_proc (int): worker processes for ``Dataset.map``. Default: 1

    Returns:
        tuple[datasets.Dataset, TruncationReport]: columns ``input_ids`` and ``labels`` only, and the cut counts.

    Raises:
        ValueError: ``max_seq_len`` too small for this tokenizer's template (naming the minimum).
    """
    before, after = template_overhead(tokenizer, settings.instruction)
    head, tail = before + HEAD_DIALOGUE_TOKENS, after + TAIL_DIALOGUE_TOKENS
    minimum = head + tail + MIN_ANSWER_TOKENS
    if settings.max_seq_len < minimum:
        raise ValueError(
            f"DataSettings.max_seq_len={settings.max_seq_len} is too small for this tokenizer and instruction: the "
            f"prompt head takes {head} tokens and the tail {tail}; use max_seq_len >= {minimum} "
            f"(room for {MIN_ANSWER_TOKENS} answer tokens) or a shorter instruction."
        )
    if len(raw) == 0:
        empty = raw.select_columns([]).add_column("input_ids", []).add_column("labels", [])
        return empty, TruncationReport(0, 0, 0, settings.max_seq_len)
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
    report = TruncationReport(len(ds), sum(ds["prompt_cut"]), sum(ds["answer_cut"]), settings.max_seq_len)
    logger.info("tokenized %s: %s", settings.source, report)
    return ds.remove_columns(["prompt_cut", "answer_cut"]), report


# ---------------------------------------------------------------------------------------------------------------
# Batching.


def make_collator(tokenizer):
    """Right-padding collator: ``input_ids`` padded with the pad token, ``labels`` with -100, ``attention_mask``."""
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, pad_to_multiple_of=None)


def count_tokens(batch: dict) -> int:
    """Non-padding tokens of a collated batch (the sum of its attention mask): what throughput counts."""
    return int(batch["attention_mask"].sum())


def answer_tokens(batch: dict) -> int:
    """Tokens of a collated batch that carry loss: labels other than IGNORE_INDEX after the causal shift."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class DataLayout:
    """What fixes an epoch's global order and how one optimizer step reads it; stored in every checkpoint.

    Epoch ``e`` is one permutation of the training set (``DistributedSampler``'s, seeded by ``seed + e``), the same
    for every world size. Step ``s`` trains its positions ``[s * E, (s + 1) * E)``, ``E`` the effective batch: rank
    ``r`` reads positions ``r, r + world_size, ...`` of that range, ``micro_batch`` at a time. So the samples of a
    step, and a resume position counted in samples, mean the same on any ``world_size x micro_batch`` that divides
    ``E``; ``train_samples``, ``seed`` and ``effective_batch`` must not change within a run.

    Args:
        train_samples (int): samples in the training set.
        seed (int): shuffle seed.
        effective_batch (int): samples per optimizer step, over all ranks and micro-steps.
        world_size (int): ranks.
        micro_batch (int): samples per forward on one rank.

    Raises:
        ValueError: ``effective_batch`` not a multiple of ``micro_batch * world_size``, sizes below 1.
    """

    train_samples: int
    seed: int
    effective_batch: int
    world_size: int
    micro_batch: int

    def __post_init__(self) -> None:
        for name in ("train_samples", "effective_batch", "world_size", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"DataLayout.{name}={getattr(self, name)}: must be >= 1.")
        if self.effective_batch % (self.micro_batch * self.world_size):
            raise ValueError(
                f"effective_batch={self.effective_batch} is not divisible by micro_batch={self.micro_batch} x "
                f"world_size={self.world_size}: the step would not be one effective batch."
            )

    @property
    def accumulation(self) -> int:
        """Micro-batches per rank per optimizer step."""
        return self.effective_batch // (self.micro_batch * self.world_size)

    @property
    def steps_per_epoch(self) -> int:
        """``floor(train_samples / effective_batch)``: the trailing partial batch is dropped, on every world size."""
        return self.train_samples // self.effective_batch

    def describe(self) -> str:
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        return (
            f"effective batch {self.effective_batch} = {ranks} x micro-batch {self.micro_batch} x accumulation "
            f"{self.accumulation}, {self.train_samples} training samples, seed {self.seed}"
        )


def check_resume(saved: DataLayout, current: DataLayout, sample_in_epoch: int) -> None:
    """Refuse a resume that cannot continue the data exactly; any world size and micro-batch dividing the same
    effective batch over the same training set and seed can.

    Args:
        saved (DataLayout): the checkpoint's.
        current (DataLayout): this run's.
        sample_in_epoch (int): the checkpoint's position in its epoch's global order.

    Raises:
        ValueError: naming both layouts and the setting to change.
    """
    if saved.effective_batch != current.effective_batch:
        fix = (
            f"the position ({sample_in_epoch} samples into the epoch) and every step after it are counted in steps of "
            f"{saved.effective_batch} samples. Resume with --effective-batch {saved.effective_batch} (any "
            f"--micro-batch and world size that divide it)"
        )
    elif saved.train_samples != current.train_samples:
        fix = (
            f"the training set changed ({saved.train_samples} -> {current.train_samples} samples), so the shuffled "
            "order differs. Resume on the same data (--source, --eval-fraction, --max-seq-len, --data-seed)"
        )
    elif saved.seed != current.seed:
        fix = f"the shuffle seed changed, so the order differs. Resume with --seed {saved.seed}"
    else:
        return
    raise ValueError(
        f"cannot resume exactly: the checkpoint was written with {saved.describe()}; this run has "
        f"{current.describe()}: {fix}, or start a new run in another --output-dir."
    )


class EpochLoader:
    """This rank's micro-batches, one epoch at a time: ``for batch in loader.epoch(n, start_sample=k)``.

    Policy: **no sample trains twice in an epoch and every world size trains the same steps.** An epoch is
    ``floor(len(dataset) / effective_batch)`` optimizer steps on any world size; the trailing partial batch (fewer
    than ``effective_batch`` samples) is dropped, never padded with repeats. The global order is the permutation of a
    ``DistributedSampler`` (``drop_last=True``, shuffled by ``seed + epoch``), the same for every world size: step
    ``s`` is its positions ``[s * effective_batch, (s + 1) * effective_batch)``, of which this rank reads every
    ``world_size``-th (see ``DataLayout``). Only ``epoch()`` iterates, and it always calls ``sampler.set_epoch``
    first, so the classic bug of every epoch seeing the same order cannot happen (``iter(loader)`` raises).
    ``start_sample`` (samples of the epoch already trained, over all ranks) resumes exactly, also on another world
    size or micro-batch: skipped samples are skipped as indices, never loaded.

    Args:
        dataset: a map-style dataset of tokenized samples.
        collate_fn: e.g. ``make_collator(tokenizer)``.
        micro_batch (int): samples per batch.
        rank (int): this rank.
        world_size (int): number of ranks.
        seed (int): shuffle seed, the same on every rank.
        shuffle (bool): shuffle each epoch. Default: True
        effective_batch (int | None): samples per optimizer step over all ranks, a multiple of
            ``micro_batch * world_size``. Default: None (``micro_batch * world_size``, no accumulation)
        pin_memory (bool): collate into page-locked memory, so the copy to a GPU with ``non_blocking=True``
            overlaps instead of waiting. Default: False (set it when training on CUDA)

    Raises:
        ValueError: bad sizes, an empty dataset or one smaller than an effective batch.
    """

    def __init__(
        self,
        dataset,
        collate_fn,
        micro_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        effective_batch: int | None = None,
        pin_memory: bool = False,
    ) -> None:
        from torch.utils.data import DistributedSampler

        if micro_batch < 1:
            raise ValueError(f"micro_batch={micro_batch}: must be >= 1.")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: need world_size >= 1 and 0 <= rank < world_size.")
        if len(dataset) == 0:
            raise ValueError("EpochLoader got an empty dataset.")
        effective_batch = micro_batch * world_size if effective_batch is None else effective_batch
        self.layout = DataLayout(len(dataset), seed, effective_batch, world_size, micro_batch)
        if self.layout.steps_per_epoch == 0:
            raise ValueError(
                f"the dataset has {len(dataset)} samples, fewer than one effective batch "
                f"(effective_batch={effective_batch}): lower --effective-batch or use more data."
            )
        self.dataset, self.collate_fn, self.micro_batch = dataset, collate_fn, micro_batch
        self.pin_memory = pin_memory
        self.sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
        )

    @property
    def samples_per_epoch(self) -> int:
        """Samples trained per epoch over all ranks: whole effective batches only."""
        return self.layout.steps_per_epoch * self.layout.effective_batch

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank, all full: ``steps_per_epoch * accumulation``."""
        return self.layout.steps_per_epoch * self.layout.accumulation

    def __iter__(self):
        raise TypeError(
            "EpochLoader is not iterable: use `for batch in loader.epoch(epoch)` so the shuffle changes "
            "every epoch (it calls sampler.set_epoch)."
        )

    def epoch(self, epoch: int, start_sample: int = 0) -> Iterator[dict]:
        """The batches of ``epoch`` on this rank, from global position ``start_sample`` on (checked at the call).

        Raises:
            ValueError: ``start_sample`` off a step boundary or past the epoch's last step, negative ``epoch``.
        """
        import torch
        from torch.utils.data import DataLoader

        if epoch < 0:
            raise ValueError(f"epoch={epoch}: must be >= 0.")
        layout = self.layout
        if start_sample % layout.effective_batch or not 0 <= start_sample <= self.samples_per_epoch:
            raise ValueError(
                f"start_sample={start_sample}: a resume position must be a multiple of the effective batch "
                f"({layout.effective_batch}) within the epoch's {layout.steps_per_epoch} steps of "
                f"{layout.effective_batch} samples ({layout.train_samples} samples, the remainder dropped)."
            )
        self.sampler.set_epoch(epoch)
        # The sampler's shard holds global positions rank, rank + world_size, ...: the epoch's steps from
        # start_sample on are shard[start_sample / world_size : samples_per_epoch / world_size].
        shard = list(self.sampler)
        indices = shard[start_sample // layout.world_size : self.samples_per_epoch // layout.world_size]
        # A private generator: a DataLoader otherwise draws its base seed from the global RNG, which would shift
        # dropout masks by one draw in a resumed run (it builds this loader after restoring the RNG state).
        generator = torch.Generator().manual_seed(self.sampler.seed + epoch)
        loader = DataLoader(
            self.dataset, batch_size=self.micro_batch, sampler=indices, collate_fn=self.collate_fn, num_workers=0,
            generator=generator, pin_memory=self.pin_memory,
        )  # fmt: skip
        return iter(loader)
