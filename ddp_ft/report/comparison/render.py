"""Render a :class:`~ddp_ft.report.comparison.summary.Comparison` as a table, sentences, markdown and a figure.

Only :func:`plot_comparison` writes a file.
"""

from __future__ import annotations

from pathlib import Path

from .fairness import mismatch
from .summary import Comparison, RunSummary

TOKENS_NOTE = "Tokens are non-padding tokens (attention mask); global tokens/s is summed over all ranks."


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _column_names(comparison: Comparison) -> tuple[str, str]:
    a, b = comparison.baseline.run_name, comparison.other.run_name
    return (f"{a} (baseline)", f"{b} (other)") if a == b else (a, b)


def table_rows(comparison: Comparison) -> tuple[list[str], list[list[str]]]:
    """The per-run table as column names and rows of strings (shared by markdown and wandb).

    Returns:
        tuple[list[str], list[list[str]]]: ``["metric", <baseline name>, <other name>]`` and one row per metric.
    """
    runs = (comparison.baseline, comparison.other)

    def memory(run: RunSummary) -> str:
        suffix = " (RSS)" if run.peak_memory_metric == "peak_rss_gb" else ""
        return _fmt(run.peak_memory_gb, ".2f") + suffix

    def comm(run: RunSummary) -> str:
        if not run.is_ddp:
            return "-"
        return f"{_fmt(run.exposed_comm_ms, '.2f')} ms / {_fmt(run.overlap, '.0%')}"

    def balance(run: RunSummary) -> str:
        if run.imbalance is None or run.world_size == 1:
            return "-"
        return f"{_fmt(run.imbalance, '.2f')}x / {_fmt(run.wait_for_slowest_ms, '.1f')} ms"

    def host(run: RunSummary) -> str:
        if run.usable_cpus is None:
            return "unknown"
        return f"{run.usable_cpus} / {_fmt(run.host_load_1m, '.2f')}"

    rows = [
        ["world size", *(str(r.world_size) for r in runs)],
        [
            "device / threads per process",
            *(f"{r.device_type or 'unknown'} / {r.threads_per_process or 'unknown'}" for r in runs),
        ],
        ["host: usable CPUs / load average", *(host(r) for r in runs)],
        ["optimizer steps", *(str(r.steps) for r in runs)],
        ["tokens/s (global)", *(_fmt(r.tokens_per_s, ",.1f") for r in runs)],
        ["tokens/s per device", *(_fmt(r.tokens_per_s_per_device, ",.1f") for r in runs)],
        ["step time (s)", *(_fmt(r.step_time_s, ".3f") for r in runs)],
        ["peak memory per device (GB)", *(memory(r) for r in runs)],
        ["final eval loss", *(_fmt(r.final_eval_loss, ".4f") for r in runs)],
    ]
    if any(r.is_ddp for r in runs):
        rows.append(["exposed comm / overlap (DDP)", *(comm(r) for r in runs)])
    if any(r.imbalance is not None and r.world_size > 1 for r in runs):
        rows.append(["rank imbalance (max/min compute) / wait for slowest", *(balance(r) for r in runs)])
    return ["metric", *_column_names(comparison)], rows


def summary_lines(comparison: Comparison) -> list[str]:
    """Speedup, scaling efficiency, step-time ratio, loss gap and eval-loss delta, one sentence each."""
    c, base, other = comparison, comparison.baseline, comparison.other
    devices = other.world_size / base.world_size
    if c.loss_gap_max is None:
        gap = "not comparable (no shared samples_seen)"
    else:
        gap = f"max {c.loss_gap_max:.4g} / mean {c.loss_gap_mean:.4g} at {c.matched_points} matched points"
    eval_delta = "n/a" if c.eval_loss_delta is None else f"{c.eval_loss_delta:+.4f}"
    withheld = "not comparable (see below)" if mismatch(base, other) else None
    limit_withheld = " (not comparable, see below)" if len(c.not_comparable) > bool(withheld) else ""
    warmup = max(base.warmup_steps_skipped, other.warmup_steps_skipped)
    over = " (over 100%: the host was busy, see the note below)" if c.of_limit is not None and c.of_limit > 1 else ""
    return [
        f"- **Speedup** (global tokens/s, {other.run_name} / {base.run_name}): "
        f"{withheld or _fmt(c.speedup, '.2f') + 'x'}",
        f"- **Scaling efficiency** (speedup / {devices:g}x devices): {withheld or _fmt(c.scaling_efficiency, '.1%')}",
        *(
            [
                f"- **Against the limit** ({other.world_size:g} independent single-device runs side by side, no "
                f"communication: {c.limit_tokens_per_s:,.1f} tokens/s): {other.run_name} reaches "
                f"{_fmt(c.of_limit, '.1%')} of it{over}{limit_withheld}"
            ]
            if c.limit_tokens_per_s is not None
            else []
        ),
        f"- **Step time ratio** ({other.run_name} / {base.run_name}): {withheld or _fmt(c.step_time_ratio, '.3f')}",
        f"- **Loss-curve gap** (|delta loss| at equal samples seen): {gap}",
        f"- **Eval loss delta** ({other.run_name} - {base.run_name}): {eval_delta}",
        "",
        f"{TOKENS_NOTE} Tokens/s and step time are medians over steps after {warmup} warm-up step(s) per "
        "run segment; peak memory is the max over all steps of rank 0's process.",
        *(f"**Not comparable**: {reason}." for reason in c.not_comparable),
        *(f"Note: {n}." for n in c.notes),
    ]


def forecast_lines(comparison: Comparison) -> list[str]:
    """The forecast beside the measured DDP run, as a markdown table; none without a forecast."""
    f, other = comparison.forecast, comparison.other
    if f is None:
        return []
    rows = [
        ("step time (s)", _fmt(f["step_time_s"], ".3f"), _fmt(other.step_time_s, ".3f")),
        ("exposed comm (ms)", _fmt(f["exposed_comm_ms"], ".2f"), _fmt(other.exposed_comm_ms, ".2f")),
        ("tokens/s (global)", _fmt(f["tokens_per_s"], ",.1f"), _fmt(other.tokens_per_s, ",.1f")),
        ("scaling efficiency", _fmt(f["scaling_efficiency"], ".1%"), _fmt(comparison.scaling_efficiency, ".1%")),
    ]
    return [
        "",
        f"Forecast beside the measured run (ddp-ft forecast of {f['from_run']}: {f['setup']} over {f['link']}):",
        "",
        f"| metric | forecast | {other.run_name} (measured) |",
        "|---|---:|---:|",
        *(f"| {name} | {predicted} | {measured} |" for name, predicted, measured in rows),
    ]


def markdown_table(comparison: Comparison) -> str:
    """The comparison as markdown: the table, the summary lines, then any forecast."""
    columns, rows = table_rows(comparison)
    lines = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join([*lines, "", *summary_lines(comparison), *forecast_lines(comparison)]) + "\n"


def plot_comparison(comparison: Comparison, path: str | Path) -> Path:
    """Save :func:`comparison_figure` as a PNG.

    Args:
        comparison (Comparison): what to draw.
        path (str | Path): the PNG to write.

    Returns:
        Path: ``path``.
    """
    path = Path(path)
    comparison_figure(comparison).savefig(path, dpi=110)
    return path


LIMIT_CAVEAT = "not a result"  # the text report's words for a limit over 100%
NOT_COMPARABLE = "not comparable"  # the text report's words for a withheld ratio


def comparison_figure(comparison: Comparison):
    """Two panels: loss against samples seen, and throughput bars with any limit.

    The figure travels without the text, so it carries the caveats itself.
    A limit over 100% is drawn grey and hatched as "not a result".

    Args:
        comparison (Comparison): what to draw.

    Returns:
        matplotlib.figure.Figure: the figure, with an Agg canvas.

    Example:
        >>> comparison_figure(comparison).savefig("comparison.png")
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    base, other = comparison.baseline, comparison.other
    names = _column_names(comparison)
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, bar_ax = fig.subplots(1, 2)
    styles = (("tab:blue", "-", "o"), ("tab:orange", "--", "s"))  # dashed on top: identical curves stay visible
    for name, curve, (color, line, marker) in zip(
        names, (comparison.baseline_curve, comparison.other_curve), styles, strict=True
    ):
        loss_ax.plot(curve.samples_seen, curve.loss, color=color, linestyle=line, marker=".", label=f"{name} train")
        loss_ax.scatter(
            curve.eval_samples_seen,
            curve.eval_loss,
            color=color,
            marker=marker,
            zorder=3,
            edgecolors="black",
            label=f"{name} eval",
        )
    loss_ax.set(xlabel="samples seen", ylabel="loss", title="Loss vs samples seen")
    loss_ax.legend()
    loss_ax.grid(alpha=0.3)
    _throughput_bars(bar_ax, comparison, names)
    fig.suptitle(f"{base.run_name} ({base.world_size} device(s)) vs {other.run_name} ({other.world_size} device(s))")
    captions = []
    if comparison.not_comparable:
        captions.append(
            f"{NOT_COMPARABLE.capitalize()}: the runs differ in threads per process or device type, so a speed ratio "
            "measures that, not DDP.\ncomparison.md names the difference and the fix."
        )
    if comparison.of_limit is not None and comparison.of_limit > 1:
        captions.append(
            f"{other.run_name} at {comparison.of_limit:.1%} of the limit is {LIMIT_CAVEAT}: the independent runs, which "
            "do no communication,\nran slower than DDP, so the host was busy while they ran. Rerun the comparison on a "
            "quiet host."
        )
    if captions:
        fig.supxlabel("\n".join(captions), color="firebrick", fontsize=10)
    return fig


def _throughput_bars(bar_ax, comparison: Comparison, names: tuple[str, str]) -> None:
    """The bars of global and per-device tokens/s for each run, and the limit's (hatched grey when over 100%)."""
    groups = ("global", "per device")
    series = [
        (name, run.tokens_per_s, run.tokens_per_s_per_device, dict(color=color))
        for name, run, color in zip(
            names, (comparison.baseline, comparison.other), ("tab:blue", "tab:orange"), strict=True
        )
    ]
    over = comparison.of_limit is not None and comparison.of_limit > 1
    ratio = f", {_fmt(comparison.of_limit, '.1%')} of the limit" if comparison.of_limit is not None else ""
    if comparison.limit_tokens_per_s is not None:
        devices, limit = comparison.other.world_size, comparison.limit_tokens_per_s
        label = f"limit: {devices} independent runs"
        style = dict(color="tab:gray")
        if over:
            label += f" ({LIMIT_CAVEAT})"
            style = dict(facecolor="lightgray", edgecolor="dimgray", hatch="//")
            ratio = f"; the limit is {LIMIT_CAVEAT}"
        series.append((label, limit, limit / devices, style))
    width = 0.8 / len(series)
    for i, (name, total, per_device, style) in enumerate(series):
        values = [total or 0.0, per_device or 0.0]
        offset = (i - (len(series) - 1) / 2) * width
        bars = bar_ax.bar([g + offset for g in range(len(groups))], values, width, label=name, **style)
        bar_ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], padding=2)
    bar_ax.set_xticks(range(len(groups)), [f"tokens/s {g}" for g in groups])
    speedup = f"speedup {_fmt(comparison.speedup, '.2f')}x"
    if comparison.speedup is None and mismatch(comparison.baseline, comparison.other):
        speedup = f"speedup {NOT_COMPARABLE}"
    if comparison.of_limit is None and comparison.not_comparable and comparison.limit_tokens_per_s is not None:
        ratio = f"; the limit {NOT_COMPARABLE}"
    bar_ax.set(ylabel="non-padding tokens/s (median)", title=f"Throughput ({speedup}{ratio})")
    bar_ax.margins(y=0.3)  # room for the labels and the legend
    bar_ax.legend()
