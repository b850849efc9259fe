"""Each numeric setting's own range: one table per settings dataclass, one checker its ``__post_init__`` calls first.

A value outside its own range is refused naming the setting, its range and a valid value (the field's default),
before any relation between settings is checked: a negative learning rate is refused as a learning rate, not as
"min_learning_rate is above it". Pure (no torch): the settings of every layer use it. Also the one-line command-line
error the settings' parsers raise (``brief_usage_error``).
"""

from __future__ import annotations

import math
import sys
import typing
from dataclasses import MISSING, dataclass, fields

SEED_MAX = 2**32 - 1  # numpy's seed range, which transformers' set_seed (the Trainer's) passes the seed to


@dataclass(frozen=True)
class Range:
    """The values one numeric setting takes.

    Args:
        low (float): the lowest value; with ``low_open``, the bound the values lie above.
        high (float | None): the highest value; with ``high_open``, the bound they lie below. Default: none
        low_open (bool): ``low`` itself is refused. Default: False
        high_open (bool): ``high`` itself is refused. Default: False
        also (tuple): values outside the range that mean something (``-1``: all epochs; ``"auto"``). Default: none
        note (str): what a value means, in the error (``"0: no clipping"``). Default: ""
        unit (str): the unit, in the error (``"MiB"``). Default: ""
    """

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple = ()
    note: str = ""
    unit: str = ""

    def contains(self, value: float) -> bool:
        """``value`` lies in the range (NaN never does)."""
        above = value > self.low if self.low_open else value >= self.low
        if self.high is None:
            return above and value != math.inf
        return above and (value < self.high if self.high_open else value <= self.high)

    def rule(self, whole: bool) -> str:
        """The range in words: ``a positive number of MiB``, ``a whole number >= 1``, ``a number in [0, 1)``."""
        unit = f" of {self.unit}" if self.unit else ""
        if self.high is not None:
            ends = f"{_num(self.low)}, {_num(self.high)}"
            return f"in {'(' if self.low_open else '['}{ends}{')' if self.high_open else ']'}{unit}"
        if self.low_open and self.low == 0:
            return f"a positive {'whole ' if whole else ''}number{unit}"
        return f"{'>' if self.low_open else '>='} {_num(self.low)}{unit}"


def _num(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def check_ranges(settings: object, ranges: dict[str, Range], prefix: str = "") -> None:
    """Refuse the first field of ``settings`` outside its range, or not a number (a whole one for an ``int`` field).

    Args:
        settings (object): a settings dataclass, from its ``__post_init__``.
        ranges (dict[str, Range]): field name -> its range.
        prefix (str): put before the field's name in the error (``"DataSettings."``). Default: ""

    Raises:
        ValueError: ``<prefix><name>=<value>: must be <range>[ or <also>][ (<note>)]; e.g. <name>=<default>, the
            default.``
    """
    defaults = {f.name: f.default for f in fields(settings)}
    for name, allowed in ranges.items():
        value, whole = getattr(settings, name), _declared_int(type(settings), name)
        if value in allowed.also and not isinstance(value, bool):
            continue
        number = not isinstance(value, bool) and isinstance(value, int if whole else int | float)
        if number and allowed.contains(value):
            continue
        rule = allowed.rule(whole)
        if not number and not rule.startswith("a "):  # say the kind too: "a whole number >= 1"
            rule = f"{'a whole number' if whole else 'a number'} {rule}"
        also = "".join(f" or {v!r}" for v in allowed.also)
        note = f" ({allowed.note})" if allowed.note else ""
        example = f"; e.g. {name}={defaults[name]!r}, the default" if defaults[name] is not MISSING else ""
        raise ValueError(f"{prefix}{name}={value!r}: must be {rule}{also}{note}{example}.")


def _declared_int(cls: type, name: str) -> bool:
    """Field ``name`` of ``cls`` is declared ``int`` (or ``int | str``): from the class annotations as written, not
    ``Field.type``, which HfArgumentParser rewrites in place."""
    annotation = next(
        vars(c)["__annotations__"][name] for c in cls.__mro__ if name in vars(c).get("__annotations__", {})
    )
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    return text.startswith("int")


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

DDP_RANGES = {
    "bucket_cap_mb": Range(0, low_open=True, also=("auto",), unit="MiB"),
    "first_bucket_cap_mb": Range(0, low_open=True, unit="MiB"),
    "powersgd_rank": Range(1),
    "powersgd_start_iter": Range(2, note="torch's PowerSGD needs one plain all-reduce step to build its state"),
    "ddp_timeout": Range(0, low_open=True, unit="seconds"),
}
"""``DDPSettings``: every numeric field."""


def brief_usage_error(prog: str, message: str) -> typing.NoReturn:
    """A command-line error as argparse's (exit status 2), without its usage: one line and where the settings are."""
    sys.stderr.write(f"{prog}: error: {message}\n{prog} --help lists the settings.\n")
    raise SystemExit(2)
