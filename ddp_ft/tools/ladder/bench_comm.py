"""The all-reduce through the backend and through :func:`~ddp_ft.tools.ladder.ring.ring_all_reduce`, timed per size.

Bandwidths follow nccl-tests, in GB/s, for ``S`` bytes reduced in ``t`` seconds over N ranks:

- algorithm bandwidth ``algbw = S / t``;
- bus bandwidth ``busbw = algbw * 2(N-1)/N``, comparable with a link's peak for any N (docs/performance.md).

Where busbw levels off is the smallest bucket that uses the link well (:func:`favoured_size`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..bench import synchronize
from .ring import ring_all_reduce

METHODS = ("backend", "ring")
FAVOURED_FRACTION = 0.8
"""A size is favoured once its median busbw reaches this fraction of the method's peak over the sizes measured."""

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


@dataclass(frozen=True)
class CommRow:
    """One method at one size.

    Args:
        method (str): ``backend`` (``dist.all_reduce``) or ``ring`` (:func:`ring_all_reduce`).
        nbytes (int): bytes of the tensor reduced.
        world_size (int): ranks taking part.
        seconds (list[float]): every timed repeat, each the slowest rank's time.
    """

    method: str
    nbytes: int
    world_size: int
    seconds: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def algbw_gbps(self) -> float:
        """Algorithm bandwidth at the median time, GB/s."""
        return self.nbytes / self.median_s / 1e9

    @property
    def busbw_gbps(self) -> float:
        """Bus bandwidth at the median time, GB/s."""
        return self.algbw_gbps * 2 * (self.world_size - 1) / self.world_size

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "repeats": len(self.seconds),
            "median_s": self.median_s,
            "min_s": min(self.seconds),
            "max_s": max(self.seconds),
            "algbw_gbps": self.algbw_gbps,
            "busbw_gbps": self.busbw_gbps,
        }


def parse_size(text: str) -> int:
    """Bytes from ``4096``, ``4K``, ``256M`` or ``1G``, in binary units.

    Args:
        text (str): the size.

    Returns:
        int: the bytes.

    Raises:
        ValueError: if it is not a positive size.

    Example:
        >>> parse_size("4K")
        4096
    """
    clean = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = clean[-1:] if clean[-1:] in "KMG" else ""
    number = clean[: len(clean) - len(unit)]
    if not number.isdigit() or int(number) <= 0:
        raise ValueError(f"size {text!r}: expected a positive number of bytes, optionally with K, M or G (4K, 256M)")
    return int(number) * _UNITS[unit]


def default_sizes(min_bytes: int = 4 * 2**10, max_bytes: int = 256 * 2**20, factor: int = 4) -> list[int]:
    """Sizes from ``min_bytes`` to ``max_bytes``, each ``factor`` times the last."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def repeats_at(nbytes: int, repeats: int, byte_budget: int) -> int:
    """Fewer repeats for large tensors, within ``byte_budget`` but never below 3."""
    return max(min(3, repeats), min(repeats, byte_budget // nbytes))


def measure_all_reduce(
    sizes: list[int],
    repeats: int = 20,
    warmup: int = 2,
    device: torch.device | None = None,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype = torch.float32,
    byte_budget: int = 2**30,
) -> list[CommRow]:
    """Time the backend's all-reduce and the ring's at each size; every rank must call it.

    The methods alternate, so drift hits both alike. Each time is the slowest rank's.

    Args:
        sizes (list[int]): tensor sizes in bytes.
        repeats (int): timed repeats per method and size. Default: 20.
        warmup (int): untimed repeats first. Default: 2.
        device (torch.device | None): where the tensors live. Default: the CPU.
        group (ProcessGroup | None): the ranks to reduce over. Default: the default group.
        dtype (torch.dtype): element type. Default: float32.
        byte_budget (int): bytes reduced per method and size at most. Default: 1 GiB.

    Returns:
        list[CommRow]: one row per method for each size.

    Example:
        >>> rows = measure_all_reduce(default_sizes())
    """
    device = device or torch.device("cpu")
    world = dist.get_world_size(group)
    ops = {"backend": lambda t: dist.all_reduce(t, group=group), "ring": lambda t: ring_all_reduce(t, group)}
    rows = []
    for nbytes in sizes:
        tensor = torch.zeros(max(1, nbytes // dtype.itemsize), dtype=dtype, device=device)
        for _ in range(warmup):
            for method in METHODS:
                ops[method](tensor)
        count = repeats_at(tensor.nbytes, repeats, byte_budget)
        seconds = torch.zeros(len(METHODS), count, dtype=torch.float64)
        for repeat in range(count):
            for m in (0, 1) if repeat % 2 == 0 else (1, 0):
                seconds[m, repeat] = _timed(ops[METHODS[m]], tensor, group)
        slowest = seconds.to(device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        rows += [CommRow(m, tensor.nbytes, world, slowest[i].tolist()) for i, m in enumerate(METHODS)]
    return rows


def _timed(op, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    synchronize(tensor.device)
    dist.barrier(group=group)
    start = time.perf_counter()
    op(tensor)
    synchronize(tensor.device)
    return time.perf_counter() - start


def favoured_size(rows: list[CommRow], method: str, fraction: float = FAVOURED_FRACTION) -> int | None:
    """The smallest size whose busbw reaches ``fraction`` of the method's peak."""
    mine = sorted((r for r in rows if r.method == method), key=lambda r: r.nbytes)
    if not mine:
        return None
    peak = max(r.busbw_gbps for r in mine)
    return next(r.nbytes for r in mine if r.busbw_gbps >= fraction * peak)


def format_size(nbytes: int) -> str:
    """A size in the largest binary unit that divides it, e.g. ``4 KiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def markdown_table(rows: list[CommRow]) -> str:
    """One line per size: each method's median time (min..max) and its algbw and busbw."""
    header = "| size | " + " | ".join(f"{m} ms (min..max) | {m} algbw GB/s | {m} busbw GB/s" for m in METHODS) + " |"
    lines = [header, "|" + "---|" * (1 + 3 * len(METHODS))]
    by_size: dict[int, dict[str, CommRow]] = {}
    for row in rows:
        by_size.setdefault(row.nbytes, {})[row.method] = row
    for nbytes, methods in by_size.items():
        cells = [format_size(nbytes)]
        for m in METHODS:
            r = methods[m]
            ms = [1e3 * s for s in (r.median_s, min(r.seconds), max(r.seconds))]
            cells += [f"{ms[0]:.3f} ({ms[1]:.3f}..{ms[2]:.3f})", f"{r.algbw_gbps:.3f}", f"{r.busbw_gbps:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_busbw(rows: list[CommRow], path: str | Path, title: str) -> Path:
    """Save a PNG of busbw against size, one line per method."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for method, (color, marker) in zip(METHODS, (("tab:blue", "o"), ("tab:orange", "s")), strict=True):
        mine = sorted((r for r in rows if r.method == method), key=lambda r: r.nbytes)
        ax.plot([r.nbytes for r in mine], [r.busbw_gbps for r in mine], color=color, marker=marker, label=method)
        favoured = favoured_size(rows, method)
        if favoured is not None:
            label = f"{method}: {FAVOURED_FRACTION:.0%} of its peak from {format_size(favoured)}"
            ax.axvline(favoured, color=color, linestyle=":", alpha=0.7, label=label)
    sizes = sorted({r.nbytes for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [format_size(n) for n in sizes], rotation=45)
    ax.minorticks_off()
    ax.set(xlabel="all-reduce size", ylabel="bus bandwidth (GB/s, median)", title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
    return Path(path)
