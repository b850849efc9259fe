"""The ladder's and the bucket sweep's output: markdown tables and PNG charts from their JSON rows."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from ..bench import cpu_name
from .rungs import RUNGS


def hardware(setup, threads: int) -> str:
    """``2 x NVIDIA H100 ..., nccl`` or ``<CPU model>, 2 ranks x 1 thread(s), gloo``."""
    info = setup.info
    if info.device.type == "cuda":
        return f"{info.world_size} x {torch.cuda.get_device_name(info.device)}, {setup.backend}"
    return f"{cpu_name()}, {info.world_size} ranks x {threads} thread(s), {setup.backend}"


def write_results(args, setup, results: dict, title: str, tables: list[str], plot: Callable) -> None:
    """Print ``title``'s header and ``tables``; write the JSON (settings, hardware, ``results``) to ``args.out``, the
    markdown beside it, and ``plot(results, path)``'s PNG."""
    where = hardware(setup, args.threads)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    doc = {"hardware": where, "backend": setup.backend, "torch": torch.__version__, "settings": settings}
    header = (
        f"{title} on {where}, {setup.describe()}; per optimizer step of {args.grad_accum} micro-steps x "
        f"{args.micro_batch} x {args.seq_len} tokens per rank; medians over {args.repeats} rounds x {args.steps} steps "
        f"x {setup.info.world_size} ranks"
    )
    text = header + "\n\n" + "\n\n".join(tables)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc | {"workloads": results}, indent=2))
    args.out.with_suffix(".md").write_text(text + "\n")
    png = plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out}, {args.out.with_suffix('.md')}, {png}")


def workload_heading(workload: str, result: dict) -> str:
    return f"### {workload}: {result['description']} ({result['trainable_mib']:.2f} MiB of gradients)"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def ladder_table(rows: dict[str, dict]) -> str:
    """The reference's columns, plus bytes, exposed communication and tokens/s (median, min..max of repeats)."""
    lines = [
        "| rung | compute % | non-compute % | idle % | overlap % | all-reduce calls | all-reduce ms | MiB sent "
        "| exposed ms | tokens/s (min..max) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        lo, hi = row["tokens_per_s_range"]
        lines.append(
            f"| {RUNGS[name].title} | {_pct(row['compute_pct'])} | {_pct(row['non_compute_pct'])} "
            f"| {_pct(row['idle_pct'])} | {_pct(row['overlap_pct'])} | {row['allreduce_calls']:.0f} "
            f"| {row['allreduce_ms']:.1f} | {row['allreduce_bytes'] / 2**20:.2f} | {row['exposed_ms']:.1f} "
            f"| {row['tokens_per_s']:.0f} ({lo:.0f}..{hi:.0f}) |"
        )
    return "\n".join(lines)


def plot_ladder(results: dict[str, dict], path: Path) -> Path:
    """One panel per workload: each rung's step split into compute, non-compute and idle, overlap % annotated."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 1.2 + 0.55 * len(RUNGS) * len(results)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(results), 1, squeeze=False)[:, 0]
    parts = (("compute_pct", "compute", "tab:green"), ("non_compute_pct", "non-compute", "tab:red"))
    for ax, (workload, result) in zip(axes, results.items(), strict=True):
        rows = result["rungs"]
        names = [RUNGS[n].title for n in rows]
        left = [0.0] * len(rows)
        for key, label, color in (*parts, ("idle_pct", "idle", "tab:gray")):
            values = [row[key] for row in rows.values()]
            ax.barh(names, values, left=left, color=color, label=label)
            left = [a + b for a, b in zip(left, values, strict=True)]
        for y, row in enumerate(rows.values()):
            note = f"overlap {_pct(row['overlap_pct'])}%, {row['exposed_ms']:.0f} ms exposed, {row['tokens_per_s']:.0f} tok/s"
            ax.text(101, y, note, va="center", fontsize=8)
        ax.invert_yaxis()
        title = f"{workload}: {result['trainable_mib']:.2f} MiB of gradients per rank per step"
        ax.set(xlim=(0, 160), xlabel="% of the optimizer step", title=title)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncols=3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def sweep_table(rows: dict[str, dict]) -> str:
    """One line per bucket setting, fewest buckets last; the fastest step in bold."""
    fastest = min(rows, key=lambda label: rows[label]["step_ms"])
    lines = [
        "| series | bucket_cap_mb | first_bucket_cap_mb | buckets | all-reduce ms | exposed ms | overlap % | step ms "
        "| tokens/s (min..max) | tokens/s / default, paired (min..max) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label in sorted(rows, key=lambda label: (-rows[label]["buckets"], label)):
        row = rows[label]
        lo, hi = row["tokens_per_s_range"]
        step = f"**{row['step_ms']:.0f}**" if label == fastest else f"{row['step_ms']:.0f}"
        lines.append(
            f"| {row['series']} | {row['bucket_cap_mb']:g} | {row['first_bucket_cap_mb']:g} | {row['buckets']} "
            f"| {row['allreduce_ms']:.1f} | {row['exposed_ms']:.1f} | {_pct(row['overlap_pct'])} | {step} "
            f"| {row['tokens_per_s']:.0f} ({lo:.0f}..{hi:.0f}) | {_paired(row['vs_default_paired'])} |"
        )
    return "\n".join(lines)


def _paired(ratio: dict) -> str:
    lo, hi = ratio["range"]
    return f"{ratio['median']:.3f} ({lo:.3f}..{hi:.3f})"


def plot_sweep(results: dict[str, dict], path: Path) -> Path:
    """One panel per workload: buckets against exposed communication (left axis) and step time (right axis)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6 * len(results), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(results), squeeze=False)[0]
    markers = {"cap": "o", "first": "^", "default": "*", "auto": "D"}
    for ax, (workload, result) in zip(axes, results.items(), strict=True):
        step_ax = ax.twinx()
        for series, marker in markers.items():
            rows = sorted((r for r in result["settings"].values() if r["series"] == series), key=lambda r: r["buckets"])
            if not rows:
                continue
            buckets = [r["buckets"] for r in rows]
            style = {"marker": marker, "linestyle": "-" if series == "cap" else "none", "markersize": 8}
            ax.plot(buckets, [r["exposed_ms"] for r in rows], color="tab:red", label=f"{series}: exposed", **style)
            step_ax.plot(buckets, [r["step_ms"] for r in rows], color="tab:blue", label=f"{series}: step", **style)
        ax.set(xscale="log", xlabel="buckets", ylabel="exposed communication ms", title=workload)
        ax.set_title(f"{workload}: {result['trainable_mib']:.2f} MiB of gradients")
        step_ax.set_ylabel("optimizer step ms")
        ax.grid(alpha=0.3)
        handles = ax.get_legend_handles_labels()[0] + step_ax.get_legend_handles_labels()[0]
        labels = ax.get_legend_handles_labels()[1] + step_ax.get_legend_handles_labels()[1]
        ax.legend(handles, labels, fontsize=7, loc="upper left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
