"""Typed settings, named presets and the command line that fills them.

Settings become dataclasses once, at the edge (``parse_settings``); library code takes the dataclasses.
Each preset is a set of field overrides; anything given on the command line wins over the preset.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from .data import DataSettings
from .ddp import DDPSettings
from .ddp.autotune import AUTO
from .model import EMBEDDED_MODEL, LoraSettings, ModelSettings


@dataclass
class TrainSettings:
    """The optimisation: batch arithmetic, schedule, checkpoints, logging."""

    output_dir: str = field(default="runs/qwen3-4b-ami", metadata={"help": "Where checkpoints and metrics go."})
    effective_batch: int = field(
        default=16,
        metadata={"help": "Samples per optimizer step over all ranks; accumulation = effective / (micro x world)."},
    )
    micro_batch: int = field(default=1, metadata={"help": "Samples per forward/backward per rank."})
    balance_ranks: bool = field(
        default=True,
        metadata={
            "help": "Within each optimizer step, group similar lengths into micro-batches and give every rank about "
            "the same padded tokens (the step's samples, so its gradient, unchanged). --no-balance-ranks: strided."
        },
    )
    epochs: int = field(default=3, metadata={"help": "Passes over the training set."})
    max_steps: int = field(default=-1, metadata={"help": "Stop after this many optimizer steps (-1: run all epochs)."})
    learning_rate: float = field(default=2e-4, metadata={"help": "Peak AdamW learning rate."})
    min_learning_rate: float = field(default=2e-5, metadata={"help": "Cosine decay floor."})
    warmup_ratio: float = field(default=0.03, metadata={"help": "Fraction of the steps spent in linear warmup."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0 disables)."})
    seed: int = field(default=42, metadata={"help": "Seed of LoRA init, dropout and data order."})
    save_every: int = field(default=0, metadata={"help": "Checkpoint every N optimizer steps (0: only at the end)."})
    save_total_limit: int = field(default=2, metadata={"help": "Keep at most this many checkpoints (0: keep all)."})
    eval_every: int = field(default=0, metadata={"help": "Evaluate every N optimizer steps (0: only at the end)."})
    resume: str = field(
        default="", metadata={"help": "Resume from a checkpoint folder, or 'latest' for the newest in output_dir."}
    )
    run_name: str = field(default="", metadata={"help": "Run name in logs (default: derived from the world size)."})
    report_to: str = field(
        default="wandb",
        metadata={"help": "wandb (offline without WANDB_API_KEY, kept for `wandb sync`) or none. Rank 0 only."},
    )
    wandb_project: str = field(default="ddp_ft", metadata={"help": "wandb project shared by the runs to compare."})
    wandb_group: str = field(
        default="", metadata={"help": "wandb group: one experiment's single and DDP runs (default: the preset)."}
    )

    def __post_init__(self) -> None:
        for name in ("effective_batch", "micro_batch", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1.")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError(f"max_steps={self.max_steps}: must be a positive number of steps, or -1 for all epochs.")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio={self.warmup_ratio}: must be in [0, 1).")
        if self.report_to not in ("wandb", "none"):
            raise ValueError(f"report_to={self.report_to!r}: choose wandb or none.")
        if self.min_learning_rate > self.learning_rate:
            raise ValueError(
                f"min_learning_rate={self.min_learning_rate} is above learning_rate={self.learning_rate}: lower it."
            )


def gradient_accumulation_steps(effective_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-steps per optimizer step so that every world size trains on the same effective batch.

    Raises:
        ValueError: if ``effective_batch`` is not a multiple of ``micro_batch * world_size``, naming the
            settings and the nearest workable values.
    """
    per_step = micro_batch * world_size
    if effective_batch % per_step:
        lower = max(per_step, effective_batch // per_step * per_step)
        divisors = [m for m in range(1, effective_batch + 1) if effective_batch % (m * world_size) == 0]
        hint = f"--micro-batch one of {divisors}" if divisors else f"--effective-batch a multiple of {world_size}"
        raise ValueError(
            f"effective_batch={effective_batch} is not divisible by micro_batch={micro_batch} x world_size="
            f"{world_size} = {per_step}: the runs would not train on the same batch. Use --effective-batch "
            f"{lower} or {lower + per_step}, or {hint}."
        )
    return effective_batch // per_step


@dataclass
class RunSettings:
    """Everything one run needs."""

    model: ModelSettings
    lora: LoraSettings
    data: DataSettings
    ddp: DDPSettings
    train: TrainSettings
    preset: str = ""


SECTIONS = {
    "model": ModelSettings,
    "lora": LoraSettings,
    "data": DataSettings,
    "ddp": DDPSettings,
    "train": TrainSettings,
}

PRESETS: dict[str, dict[str, object]] = {
    # The reference run: Qwen3-4B QLoRA on AMI, effective batch 16, AdamW 2e-4 cosine to 2e-5, 3 epochs.
    "qwen3-4b-ami": {
        "model_name_or_path": "Qwen/Qwen3-4B",
        "source": "knkarthick/AMI",
        "max_seq_len": 512,
        "effective_batch": 16,
        "micro_batch": 1,
        "epochs": 3,
        "learning_rate": 2e-4,
        "min_learning_rate": 2e-5,
        "output_dir": "runs/qwen3-4b-ami",
    },
    # Embedded model and data: about a minute on 2 CPU cores, no network.
    "tiny": {
        "model_name_or_path": EMBEDDED_MODEL,
        "source": "synthetic",
        "num_synthetic": 160,
        "max_seq_len": 256,
        "effective_batch": 8,
        "micro_batch": 2,
        "epochs": 1,
        "max_steps": 16,
        "learning_rate": 1e-3,
        "min_learning_rate": 1e-4,
        "warmup_ratio": 0.1,
        "save_every": 8,
        "output_dir": "runs/tiny",
    },
}


def build_parser(parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    """One flag per dataclass field (``--micro-batch`` and ``--micro_batch``), documented from its help; an entry
    point's own flags come in through ``parents`` (built with ``add_help=False``), so ``--help`` lists them too."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(
        list(SECTIONS.values()), description="QLoRA fine-tuning with BucketedDDP.", parents=list(parents)
    )
    parser.add_argument("--preset", default="", help=f"Named settings to start from: {', '.join(PRESETS)}.")
    for action in parser._actions:  # HfArgumentParser types a `float | str` field as float: take "auto" too
        if action.dest == "bucket_cap_mb":
            action.type = _bucket_cap_arg
    return parser


def _bucket_cap_arg(text: str) -> float | str:
    """``--bucket-cap-mb``: a number of MiB or ``auto``."""
    if text == AUTO:
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of MiB nor {AUTO!r}") from None


def parse_settings(argv: list[str] | None = None, parents: Sequence[argparse.ArgumentParser] = ()) -> RunSettings:
    """Command line -> RunSettings: the preset's values first, explicit flags over them.

    Args:
        argv (list[str] | None): the command line. Default: ``sys.argv[1:]``
        parents (Sequence[argparse.ArgumentParser]): an entry point's own flags (see :func:`build_parser`); their
            values are not part of RunSettings.

    Raises:
        SystemExit: (argparse) for an unknown preset or flag, with the known choices.
    """
    parser = build_parser(parents)
    pre, _ = parser.parse_known_args(argv)
    if pre.preset:
        if pre.preset not in PRESETS:
            parser.error(f"unknown --preset {pre.preset!r}; choose one of: {', '.join(PRESETS)}")
        parser.set_defaults(**PRESETS[pre.preset])
    namespace = parser.parse_args(argv)
    values = vars(namespace)
    sections = {name: cls(**{f.name: values[f.name] for f in fields(cls)}) for name, cls in SECTIONS.items()}
    return RunSettings(**sections, preset=values["preset"])


def settings_from_preset(preset: str, **overrides: object) -> RunSettings:
    """RunSettings of a preset with field overrides, for code and tests (no command line)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    values = {**PRESETS[preset], **overrides}
    known = {f.name for cls in SECTIONS.values() for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; known: {sorted(known)}")
    sections = {
        name: cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values}) for name, cls in SECTIONS.items()
    }
    return RunSettings(**sections, preset=preset)
