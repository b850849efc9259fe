"""Each numeric setting's own range, and the checker a settings dataclass's ``__post_init__`` calls first.

A value outside its own range is refused naming the setting, its range and a valid value (the field's default),
before any relation between settings is checked: a negative learning rate is refused as a learning rate, not as
"min_learning_rate is above it". Pure Python, so ``ddp_ft.ddp`` still needs torch only; ``DDPSettings``' table is
here, the training settings' tables are in ``ddp_ft.training.ranges``.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields


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


DDP_RANGES = {
    "bucket_cap_mb": Range(0, low_open=True, also=("auto",), unit="MiB"),
    "first_bucket_cap_mb": Range(0, low_open=True, unit="MiB"),
    "powersgd_rank": Range(1),
    "powersgd_start_iter": Range(2, note="torch's PowerSGD needs one plain all-reduce step to build its state"),
    "ddp_timeout": Range(0, low_open=True, unit="seconds"),
}
"""``DDPSettings``: every numeric field."""
