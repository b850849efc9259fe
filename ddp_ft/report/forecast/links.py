"""The links a forecast sends buckets over: published presets, or one fitted from ``ddp-ft doctor``'s probe.

A ring all-reduce takes ``2(N-1)`` steps, each paced by the slowest hop (docs/performance.md).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

PROBE_FILE = "doctor.json"
"""What ``ddp-ft doctor --out DIR`` writes: its checks and the all-reduce times of its bandwidth probe."""

MEASURED = "measured"

# NCCL's cost model gives each ring step a latency per link type.
_NCCL_LATENCY = "https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc (hwLat, Ring/Simple)"
_PCIE_TABLE = "https://en.wikipedia.org/wiki/PCI_Express#Comparison_table (PCI-SIG base specifications)"


@dataclass(frozen=True)
class Link:
    """One link between two neighbours of the ring.

    Args:
        name (str): the ``--link`` value.
        label (str): the table's name for it.
        bandwidth_gbps (float): GB/s each way.
        latency_us (float): microseconds per ring step.
        source (str): where the numbers come from.
    """

    name: str
    label: str
    bandwidth_gbps: float
    latency_us: float
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    "pcie4": Link(
        "pcie4",
        "PCIe 4.0 x16",
        31.5,  # each way
        5.7,
        f"bandwidth: {_PCIE_TABLE}; latency: {_NCCL_LATENCY}, PCI",
    ),
    "pcie5": Link(
        "pcie5",
        "PCIe 5.0 x16",
        63.0,  # each way
        5.7,
        f"bandwidth: {_PCIE_TABLE}; latency: {_NCCL_LATENCY}, PCI",
    ),
    "nvlink": Link(
        "nvlink",
        "NVLink 4 (H100 SXM)",
        450.0,  # half of 900 GB/s both ways
        3.4,
        f"bandwidth: https://www.nvidia.com/en-us/data-center/h100/ (NVLink 900 GB/s); latency: {_NCCL_LATENCY}, "
        "NVLink",
    ),
    "infiniband": Link(
        "infiniband",
        "InfiniBand NDR 400G",
        50.0,  # 400 Gb/s each way
        14.0,
        "bandwidth: https://docs.nvidia.com/networking/display/ConnectX7VPI/Introduction (NDR 400Gb/s per port); "
        f"latency: {_NCCL_LATENCY}, NET",
    ),
}
"""Published peaks: measured all-reduces reach less (``ddp-ft bench-comm``, ``--link measured``)."""

LINK_CHOICES = (*PRESETS, MEASURED)


def ring_allreduce_ms(nbytes: int, ranks: int, links: Sequence[Link]) -> float:
    """Milliseconds for a ring all-reduce, paced by the slowest of ``links``.

    Args:
        nbytes (int): bytes each rank contributes.
        ranks (int): ranks in the ring.
        links (Sequence[Link]): the kinds of hop the ring crosses.

    Returns:
        float: the time in ms.

    Example:
        >>> ring_allreduce_ms(1 << 20, 2, [PRESETS["nvlink"]])
    """
    if ranks <= 1:
        return 0.0
    chunk = nbytes / ranks
    step_s = max(chunk / (link.bandwidth_gbps * 1e9) + link.latency_us * 1e-6 for link in links)
    return 2 * (ranks - 1) * step_s * 1e3


def fit_link(rows: list[dict], source: str = "ddp-ft doctor") -> Link:
    """Fit bandwidth and latency to a probe's all-reduce times.

    Relative errors let small sizes set the latency and large ones the bandwidth.

    Args:
        rows (list[dict]): the probe's backend rows.
        source (str): the rows' origin. Default: ``ddp-ft doctor``.

    Returns:
        Link: the ``measured`` link.

    Raises:
        ValueError: if the rows cannot fit a link.
    """
    sizes = {r["nbytes"] for r in rows}
    worlds = {r["world_size"] for r in rows}
    if len(sizes) < 2 or min(worlds, default=1) < 2 or len(worlds) != 1:
        raise ValueError(
            f"{source}: the probe holds {len(sizes)} size(s) over world size(s) {sorted(worlds)}; a link needs two "
            "sizes or more on one world of 2+: ddp-ft doctor --nproc 2 --sizes 64K 1M 16M --out DIR"
        )
    world = worlds.pop()
    points = [(2 * (world - 1) / world * r["nbytes"], r["median_s"]) for r in rows]
    sw = sx = sy = sxx = sxy = 0.0
    for x, t in points:
        w = 1 / (t * t)
        sw, sx, sy, sxx, sxy = sw + w, sx + w * x, sy + w * t, sxx + w * x * x, sxy + w * x * t
    det = sw * sxx - sx * sx
    slope, intercept = (sw * sxy - sx * sy) / det, (sxx * sy - sx * sxy) / det
    if intercept < 0:  # fit through the origin
        slope, intercept = sxy / sxx, 0.0
    if slope <= 0:
        raise ValueError(f"{source}: the all-reduce times do not grow with size; rerun ddp-ft doctor on a quiet host")
    return Link(MEASURED, f"{world} ranks", 1 / slope / 1e9, intercept / (2 * (world - 1)) * 1e6, source)


def load_probe(path: str | Path) -> Link:
    """The link fitted from a ``doctor.json`` file or folder.

    Args:
        path (str | Path): the file or its folder.

    Returns:
        Link: the ``measured`` link.

    Raises:
        FileNotFoundError: if there is no probe.
        ValueError: if the probe cannot give a link.
    """
    path = Path(path)
    path = path / PROBE_FILE if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: --link measured reads ddp-ft doctor's probe; write it with "
            "ddp-ft doctor --nproc 2 --out DIR and pass --probe DIR, or name a preset with --link"
        )
    probe = json.loads(path.read_text())
    rows = [r for r in probe.get("all_reduce", []) if r.get("method") == "backend"]
    link = fit_link(rows, str(path))
    return replace(link, label=f"measured: {probe.get('backend', '?')} on {probe.get('device', '?')}, {link.label}")
