"""A :class:`~ddp_ft.report.forecast.build.Forecast` as markdown (pure), and its files: ``forecast.md`` and
``forecast.json``, which ``ddp-ft compare`` reads back.
"""

from __future__ import annotations

import json
from pathlib import Path

from .build import Forecast, ForecastRow

FORECAST_FILE = "forecast.json"

COLUMNS = (
    "setup",
    "ranks",
    "link",
    "accumulation",
    "exposed comm (ms)",
    "link busy (ms)",
    "step time (s)",
    "tokens/s",
    "scaling efficiency",
)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def _cells(row: ForecastRow, asked: bool) -> list[str]:
    setup = f"**{row.setup}**" if asked else row.setup
    efficiency = "-" if row.scaling_efficiency is None else f"{row.scaling_efficiency:.1%}"
    return [
        setup,
        str(row.ranks),
        row.link,
        str(row.accumulation),
        f"{row.exposed_comm_ms:.2f}",
        f"{row.comm_ms:.2f}",
        f"{row.step_time_s:.3f}",
        f"{row.tokens_per_s:,.0f}",
        efficiency,
    ]


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "."


def markdown(forecast: Forecast) -> str:
    """The table (the ``--nproc`` row in bold), then the links with their sources, the assumptions and the notes."""
    f = forecast
    buckets = ", ".join(_size(n) for n in f.bucket_bytes)
    lines = [
        f"Forecast of BucketedDDP from {f.run_name} (1 process on {f.device_type or 'an unknown device'}, micro-batch "
        f"{f.micro_batch} x accumulation {f.accumulation} = {f.effective_batch} samples per step; "
        f"{len(f.bucket_bytes)} bucket(s): {buckets}), medians over {f.timed_steps} step(s).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|---:|---|" + "---:|" * (len(COLUMNS) - 3),
    ]
    for row in f.rows:
        asked = row.ranks == f.nproc and row.nodes == 1
        lines.append("| " + " | ".join(_cells(row, asked)) + " |")
    lines += ["", "Links:"]
    lines += [
        f"- {k['label']}: {k['bandwidth_gbps']:.3g} GB/s each way, {k['latency_us']:.3g} us per ring step "
        f"({k['source']})"
        for k in f.links
    ]
    lines += ["", "Assumptions:", *(f"- {_sentence(a)}" for a in f.assumptions)]
    if f.notes:
        lines += ["", "Notes:", *(f"- {_sentence(n)}" for n in f.notes)]
    return "\n".join(lines) + "\n"


def write_forecast(forecast: Forecast, out_dir: str | Path) -> dict[str, str]:
    """Write ``forecast.md`` and ``forecast.json`` into ``out_dir`` (created); returns their paths by suffix."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"md": str(out / "forecast.md"), "json": str(out / FORECAST_FILE)}
    Path(files["md"]).write_text(markdown(forecast))
    Path(files["json"]).write_text(json.dumps(forecast.to_dict(), indent=2))
    return files


def load_forecast(path: str | Path) -> Forecast:
    """A ``forecast.json``, or the one in folder ``path``.

    Raises:
        FileNotFoundError: no such file, naming the command that writes it.
        ValueError: the file is not a forecast.
    """
    path = Path(path)
    path = path / FORECAST_FILE if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: write it with ddp-ft forecast RUN --nproc N --out DIR")
    return Forecast.from_dict(json.loads(path.read_text()))
