"""Where the (dialogue, summary) pairs come from and how they become samples: ``DataSettings`` and the data constants."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...ddp.autotune import AUTO
from ...ddp.ranges import check_ranges
from ..ranges import DATA_RANGES
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


@dataclass
class DataSettings:
    """Where the (dialogue, summary) pairs come from and how they become training samples and batches."""

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
        default="Summarize the following meeting transcript.",
        metadata={"help": "Instruction put before the transcript in the user turn."},
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

    @property
    def source_kind(self) -> str:
        """'synthetic', 'file' (a known file extension) or 'hub' (anything else, also a local dataset folder)."""
        if self.source == SYNTHETIC:
            return "synthetic"
        return "file" if Path(self.source).suffix.lower() in FILE_BUILDERS else "hub"
