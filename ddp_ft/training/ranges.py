"""The training settings' numeric ranges, one table per settings dataclass, and the brief CLI error. Pure."""

from __future__ import annotations

import sys
import typing

from ..ddp.ranges import Range

SEED_MAX = 2**32 - 1  # numpy's seed range, which transformers' set_seed needs

TRAIN_RANGES = {
    "effective_batch": Range(1),
    "micro_batch": Range(1, also=("auto",)),
    "epochs": Range(1),
    "max_steps": Range(1, also=(-1,), note="-1: run all epochs"),
    "learning_rate": Range(0, low_open=True),
    "min_learning_rate": Range(0, note="the cosine decay's floor, at most learning_rate"),
    "warmup_ratio": Range(0, 1, high_open=True, note="the fraction of the steps spent warming up"),
    "weight_decay": Range(0),
    "max_grad_norm": Range(0, note="0: no clipping"),
    "seed": Range(0, SEED_MAX),
    "save_every": Range(0, note="0: only at the end"),
    "save_total_limit": Range(0, note="0: keep all"),
    "eval_every": Range(0, note="0: only at the end"),
    "predict": Range(0, note="0: no predictions"),
    "max_new_tokens": Range(1),
}
"""``TrainSettings``: every numeric field."""

LORA_RANGES = {
    "lora_r": Range(1),
    "lora_alpha": Range(0, low_open=True, note="the adapters' scale is lora_alpha / lora_r"),
    "lora_dropout": Range(0, 1, high_open=True),
}
"""``LoraSettings``: every numeric field (``ModelSettings`` has none)."""

DATA_RANGES = {
    "eval_fraction": Range(0, 1, high_open=True, note="0: no eval hold-out"),
    "num_synthetic": Range(2, note="at least one training and one eval sample"),
    "data_seed": Range(0, SEED_MAX),
}
"""``DataSettings``: every numeric field but ``max_seq_len``, whose floor ``DataSettings`` explains itself."""


def brief_usage_error(prog: str, message: str) -> typing.NoReturn:
    """A command-line error as argparse's (exit status 2), without its usage: one line and where the settings are."""
    sys.stderr.write(f"{prog}: error: {message}\n{prog} --help lists the settings.\n")
    raise SystemExit(2)
