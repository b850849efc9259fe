"""Where the training rows come from and how they become samples: ``DataSettings`` and the data constants."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...ddp.autotune import AUTO
from ...ddp.ranges import check_ranges
from ..ranges import DATA_RANGES
from .formats import FORMAT_NAMES
from .tokenizer import CHAT_TEMPLATES

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
DEFAULT_INSTRUCTION = "Summarize the following meeting transcript."


@dataclass
class DataSettings:
    """Where the training rows come from and how they become training samples and batches."""

    source: str = field(
        default="knkarthick/AMI",
        metadata={
            "help": "Hub dataset id, a local .jsonl/.json/.csv/.parquet file, a folder of them, or 'synthetic' "
            "(embedded)."
        },
    )
    format: str = field(
        default="auto",
        metadata={
            "help": "The rows' format: auto (found from the columns, logged), pair (--dialogue-column, "
            "--summary-column), messages, sharegpt (conversations), alpaca (instruction, input, output), "
            "prompt_completion, or text (loss on every token)."
        },
    )
    dialogue_column: str = field(default="dialogue", metadata={"help": "Pair format: the column holding the input."})
    summary_column: str = field(
        default="summary", metadata={"help": "Pair format: the column holding the answer to learn."}
    )
    split: str = field(default="train", metadata={"help": "Split to train on (local files have only 'train')."})
    eval_split: str | None = field(
        default="validation",
        metadata={
            "help": "Split to evaluate on; if the source lacks it (or None), eval_fraction of train is held out."
        },
    )
    eval_source: str = field(
        default="",
        metadata={
            "help": "A separate .jsonl/.json/.csv/.parquet file to evaluate on, in the training source's format."
        },
    )
    eval_fraction: float = field(
        default=0.05, metadata={"help": "Fraction of train held out for eval when there is no eval split (0: none)."}
    )
    max_seq_len: int = field(
        default=512, metadata={"help": "Tokens per sample; long transcripts are cut in the middle, answers at the end."}
    )
    packing: bool | str = field(
        default=AUTO,
        metadata={
            "help": "Pack each micro-batch's samples into rows of max_seq_len tokens without padding, kept apart by "
            "position_ids restarting at 0 (same loss and gradient as padded). true, false, or 'auto': on with CUDA "
            "if the model's attention keeps packed sequences apart, off on the CPU (the choice is logged, with why)."
        },
    )
    num_synthetic: int = field(default=512, metadata={"help": "Samples generated when source is 'synthetic'."})
    # Not `seed`: one flag namespace holds every settings dataclass, and TrainSettings.seed owns --seed.
    data_seed: int = field(default=0, metadata={"help": "Seed of the synthetic data and of the eval hold-out."})
    instruction: str = field(
        default=DEFAULT_INSTRUCTION,
        metadata={"help": "Pair format: the instruction put before the input in the user turn."},
    )
    chat_template: str = field(
        default="auto",
        metadata={
            "help": "How prompt and answer are written: auto (the tokenizer's own chat template, else plain), "
            "plain (instruction + transcript, '### Response:', answer + the tokenizer's eos; for base models), "
            "chatml (needs <|im_start|>/<|im_end|> in the vocabulary), or a Jinja file. No token is ever added."
        },
    )

    def __post_init__(self) -> None:
        check_ranges(self, DATA_RANGES, "DataSettings.")
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
        if self.eval_split and (Path(self.eval_split).suffix.lower() in FILE_BUILDERS or "/" in self.eval_split):
            raise ValueError(
                f"DataSettings.eval_split={self.eval_split!r} looks like a path, but it names a split of the source: "
                "give a separate evaluation file with --eval-source instead."
            )
        self._check_format()
        if self.max_seq_len < MIN_MAX_SEQ_LEN:
            raise ValueError(
                f"DataSettings.max_seq_len={self.max_seq_len}: must be >= {MIN_MAX_SEQ_LEN}, the least that holds "
                f"a prompt head ({DEFAULT_KEEP_PROMPT_HEAD} tokens: template, instruction, start of the transcript), "
                f"a prompt tail ({DEFAULT_KEEP_PROMPT_TAIL} tokens: end of the transcript and the assistant "
                f"generation prompt) and {MIN_ANSWER_TOKENS} answer tokens."
            )
        if self.packing not in (True, False, AUTO) or not isinstance(self.packing, bool | str):
            raise ValueError(f"DataSettings.packing={self.packing!r}: choose true, false or {AUTO!r}.")
        if self.chat_template not in CHAT_TEMPLATES and not Path(self.chat_template).is_file():
            raise ValueError(
                f"DataSettings.chat_template={self.chat_template!r} (--chat-template): neither one of "
                f"{', '.join(CHAT_TEMPLATES)} nor an existing Jinja file; give a choice or the path of a file."
            )

    def _check_format(self) -> None:
        if self.format not in FORMAT_NAMES:
            raise ValueError(
                f"DataSettings.format={self.format!r} (--format): choose one of {', '.join(FORMAT_NAMES)}."
            )
        if self.format != "auto":
            self.check_format_settings(self.format)

    def check_format_settings(self, name: str) -> None:
        """Refuse the pair's settings, given for a source in format ``name``, where they would be dropped.

        Raises:
            ValueError: naming the settings and the format.
        """
        if name == "pair":
            return
        given = [f"--{name.replace('_', '-')}" for name in ("dialogue_column", "summary_column") if self._changed(name)]
        given += ["--instruction"] if self.instruction != DEFAULT_INSTRUCTION else []
        if given:
            raise ValueError(
                f"{', '.join(given)} set for data in the {name} format: they shape the pair format only, and a "
                f"{name} row carries its own prompt. Drop them, or use --format pair."
            )

    def _changed(self, name: str) -> bool:
        return getattr(self, name) != type(self).__dataclass_fields__[name].default

    @property
    def pair_columns_set(self) -> bool:
        """Whether the pair's columns were named, which picks the pair format."""
        return self._changed("dialogue_column") or self._changed("summary_column")

    @property
    def source_kind(self) -> str:
        """'synthetic', 'file' (a known file extension), 'folder' (a local folder) or 'hub' (anything else)."""
        if self.source == SYNTHETIC:
            return "synthetic"
        if Path(self.source).suffix.lower() in FILE_BUILDERS:
            return "file"
        return "folder" if Path(self.source).expanduser().is_dir() else "hub"
