"""Each numeric setting's own range, checked first by a settings dataclass's ``__post_init__``.

Ranges come before relations, so a negative learning rate is refused as such.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields


@dataclass(frozen=True)
class Range:
    """The values one numeric setting takes.

    Args:
        low (float): the lower bound.
        high (float | None): the upper bound. Default: None.
        low_open (bool): exclude ``low``. Default: False.
        high_open (bool): exclude ``high``. Default: False.
        also (tuple): values outside the range that mean something, e.g. ``"auto"``. Default: ().
        note (str): what a value means, for the error. Default: "".
        unit (str): the unit, for the error. Default: "".
    """

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple = ()
    note: str = ""
    unit: str = ""

    def contains(self, value: float) -> bool:
        """Whether ``value`` lies in the range; NaN never does."""
        above = value > self.low if self.low_open else value >= self.low
        if self.high is None:
            return above and value != math.inf
        return above and (value < self.high if self.high_open else value <= self.high)

    def rule(self, whole: bool) -> str:
        """The range in words, e.g. ``a positive number of MiB``."""
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
    """Refuse the first field of ``settings`` that is not a number in its range.

    Args:
        settings (object): a settings dataclass.
        ranges (dict[str, Range]): field name to its range.
        prefix (str): put before the field's name in the error. Default: "".

    Raises:
        ValueError: naming the field, its range and its default.
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
        if not number and not rule.startswith("a "):  # name the kind too
            rule = f"{'a whole number' if whole else 'a number'} {rule}"
        also = "".join(f" or {v!r}" for v in allowed.also)
        note = f" ({allowed.note})" if allowed.note else ""
        example = f"; e.g. {name}={defaults[name]!r}, the default" if defaults[name] is not MISSING else ""
        raise ValueError(f"{prefix}{name}={value!r}: must be {rule}{also}{note}{example}.")


def _declared_int(cls: type, name: str) -> bool:
    """Whether field ``name`` is declared ``int``, per annotations; HfArgumentParser rewrites ``Field.type``."""
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
