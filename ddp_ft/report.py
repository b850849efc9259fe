"""What DDP bought: one run on 1 device against the same experiment with DDP on N devices.

Both runs are read from their rank-0 ``metrics.jsonl`` (see :mod:`ddp_ft.metrics`). Throughput compares
global tokens/s (non-padding tokens, summed over ranks); scaling efficiency divides the speedup by the
ratio of device counts, so 100% means N devices did N times the work. Loss curves are overlaid on
*samples seen*, not step: with the same effective batch the two runs see the same samples per step, and
with different ones it is still the axis on which their curves line up.

Everything up to :func:`markdown_table` is pure and unit-tested; :func:`plot_comparison`,
:func:`write_report` and :func:`log_report_to_wandb` are the thin I/O around it.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .metrics import read_jsonl, resolve_wandb_mode, timeline
from .records import CONFIG, EVAL, STEP_METRIC, TRAIN, eval_record, of_type

logger = logging.getLogger(__name__)

MEMORY_METRICS = ("peak_mem_gb", "peak_rss_gb")  # CUDA allocator peak (GPU), peak resident set size (CPU)
TOKENS_NOTE = "Tokens are non-padding tokens (attention mask); global tokens/s is summed over all ranks."


@dataclass
class RunSummary:
    """One run reduced to the numbers the comparison needs.

    Args:
        run_name (str): ``run_name`` of the run's first config record.
        world_size (int): devices (ranks) of the run, from its first config record.
        effective_batch (int | None): samples per optimizer step, from the first config record.
        steps (int): distinct optimizer steps logged.
        timed_steps (int): train records the medians are taken over (warm-up excluded).
        warmup_steps_skipped (int): train records left out of the medians as warm-up.
        tokens_per_s (float | None): median global tokens/s (all ranks).
        tokens_per_s_per_device (float | None): median tokens/s per device.
        step_time_s (float | None): median seconds per optimizer step.
        peak_memory_gb (float | None): max over all steps of rank 0's peak memory, in GB.
        peak_memory_metric (str | None): which metric that is: ``peak_mem_gb`` (CUDA allocator, GPU) or
            ``peak_rss_gb`` (resident set size, CPU).
        final_eval_loss (float | None): eval loss of the last eval record.
        exposed_comm_ms (float | None): median ms per step that backward waited on communication (DDP only).
        overlap (float | None): median fraction of communication hidden behind compute (DDP on CPU/gloo only).
    """

    run_name: str
    world_size: int
    effective_batch: int | None
    steps: int
    timed_steps: int
    warmup_steps_skipped: int
    tokens_per_s: float | None
    tokens_per_s_per_device: float | None
    step_time_s: float | None
    peak_memory_gb: float | None
    peak_memory_metric: str | None
    final_eval_loss: float | None
    exposed_comm_ms: float | None
    overlap: float | None

    @property
    def is_ddp(self) -> bool:
        return self.exposed_comm_ms is not None


@dataclass
class LossCurve:
    """Train and eval loss of one run against samples seen.

    Args:
        samples_seen (list[int]): ascending; one point per optimizer step.
        loss (list[float]): train loss at each of ``samples_seen``.
        eval_samples_seen (list[int]): samples seen at each eval.
        eval_loss (list[float]): eval loss at each of ``eval_samples_seen``.
    """

    samples_seen: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    eval_samples_seen: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)


@dataclass
class Comparison:
    """A baseline run against another run of the same experiment (usually 1 device against N with DDP).

    Args:
        baseline (RunSummary): the reference run (1 device).
        other (RunSummary): the run being judged (DDP on N devices).
        speedup (float | None): ``other.tokens_per_s / baseline.tokens_per_s`` (global rates).
        scaling_efficiency (float | None): ``speedup / (other.world_size / baseline.world_size)``; 1.0 is
            perfect linear scaling.
        step_time_ratio (float | None): ``other.step_time_s / baseline.step_time_s``.
        loss_gap_max (float | None): max |other loss - baseline loss| over matched points; None when the
            curves share no ``samples_seen``.
        loss_gap_mean (float | None): mean of the same; None likewise.
        matched_points (int): train steps whose ``samples_seen`` appear in both runs.
        eval_loss_delta (float | None): ``other.final_eval_loss - baseline.final_eval_loss``.
        notes (list[str]): caveats a reader must see (no overlap, unequal lengths, different batches...).
        baseline_curve (LossCurve): the baseline's loss curve, for the plot.
        other_curve (LossCurve): the other run's loss curve, for the plot.
    """

    baseline: RunSummary
    other: RunSummary
    speedup: float | None
    scaling_efficiency: float | None
    step_time_ratio: float | None
    loss_gap_max: float | None
    loss_gap_mean: float | None
    matched_points: int
    eval_loss_delta: float | None
    notes: list[str]
    baseline_curve: LossCurve
    other_curve: LossCurve

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> Comparison:
        """Rebuild from :meth:`to_dict` output (or a ``comparison.json``; keys other than the fields are ignored)."""
        values = {f.name: data[f.name] for f in fields(cls)}
        values["baseline"] = RunSummary(**values["baseline"])
        values["other"] = RunSummary(**values["other"])
        values["baseline_curve"] = LossCurve(**values["baseline_curve"])
        values["other_curve"] = LossCurve(**values["other_curve"])
        return cls(**values)


def _median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize_run(records: list[dict], skip_first: int = 1) -> RunSummary:
    """Reduce one run's ``metrics.jsonl`` records to a :class:`RunSummary`.

    Medians (tokens/s, step time, exposed communication, overlap) skip the first ``skip_first`` train
    steps as warm-up (first-iteration allocations, kernel selection, bucket rebuilds), counted from every
    config record: a resumed run appends a config record and warms up again. When that would leave no step
    at all (a run of ``skip_first`` steps or fewer), every step is used. Peak memory is the max over all
    steps, warm-up included. Identity (run name, world size, effective batch) comes from the first config
    record; train records of every segment are used.

    Args:
        records (list[dict]): the records of one ``metrics.jsonl``, in file order.
        skip_first (int): warm-up train steps left out of the medians. Default: 1.

    Returns:
        RunSummary: the run's summary.

    Raises:
        ValueError: if ``skip_first`` is negative, or there is no config record or no train record.
    """
    if skip_first < 0:
        raise ValueError(f"skip_first must be >= 0, got {skip_first}")
    configs, trains = of_type(records, CONFIG), of_type(records, TRAIN)
    if not configs:
        raise ValueError("no config record (type 'config'): is this a ddp_ft metrics.jsonl?")
    if not trains:
        raise ValueError(f"run {configs[0].get('run_name')!r} has no train record")
    timed, since_config = [], 0
    for record in records:
        if record.get("type") == CONFIG:
            since_config = 0
        elif record.get("type") == TRAIN:
            if since_config >= skip_first:
                timed.append(record)
            since_config += 1
    timed = timed or trains
    memory_metric = next((m for m in MEMORY_METRICS if any(m in r for r in trains)), None)
    evals = [r for r in of_type(records, EVAL) if r.get("eval_loss") is not None]
    first = configs[0]
    return RunSummary(
        run_name=str(first.get("run_name", "run")),
        world_size=int(first["world_size"]),
        effective_batch=first.get("effective_batch"),
        steps=len({r["step"] for r in trains}),
        timed_steps=len(timed),
        warmup_steps_skipped=len(trains) - len(timed),
        tokens_per_s=_median(timed, "tokens_per_s"),
        tokens_per_s_per_device=_median(timed, "tokens_per_s_per_device"),
        step_time_s=_median(timed, "step_time_s"),
        peak_memory_gb=max(r[memory_metric] for r in trains if memory_metric in r) if memory_metric else None,
        peak_memory_metric=memory_metric,
        final_eval_loss=evals[-1]["eval_loss"] if evals else None,
        exposed_comm_ms=_median(timed, "comm/exposed_comm_ms"),
        overlap=_median(timed, "comm/overlap"),
    )


def loss_curve(records: list[dict]) -> LossCurve:
    """Train and eval loss against samples seen; where a resumed run logged a point twice, the later wins."""
    train = {r["samples_seen"]: r["loss"] for r in of_type(records, TRAIN) if r.get("loss") is not None}
    evals = {r["samples_seen"]: r["eval_loss"] for r in of_type(records, EVAL)}
    evals = {k: v for k, v in evals.items() if v is not None}
    return LossCurve(sorted(train), [train[k] for k in sorted(train)], sorted(evals), [evals[k] for k in sorted(evals)])


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def compare_runs(
    baseline: RunSummary, baseline_records: list[dict], other: RunSummary, other_records: list[dict]
) -> Comparison:
    """Compare two summarized runs; the records supply the loss curves.

    Loss curves are matched on ``samples_seen``: a point counts only where both runs logged a train step
    after exactly that many samples, so runs of unequal length are compared over their common prefix.

    Args:
        baseline (RunSummary): the reference run (usually 1 device).
        baseline_records (list[dict]): its ``metrics.jsonl`` records.
        other (RunSummary): the run being judged (usually DDP on N devices).
        other_records (list[dict]): its ``metrics.jsonl`` records.

    Returns:
        Comparison: speedup, scaling efficiency, step-time ratio, loss-curve gap, eval-loss delta and notes.
    """
    base_curve, other_curve = loss_curve(baseline_records), loss_curve(other_records)
    base_loss = dict(zip(base_curve.samples_seen, base_curve.loss, strict=True))
    other_loss = dict(zip(other_curve.samples_seen, other_curve.loss, strict=True))
    matched = sorted(base_loss.keys() & other_loss.keys())
    gaps = [abs(other_loss[s] - base_loss[s]) for s in matched]

    notes = []
    if not matched:
        notes.append(
            "loss curves not comparable: no train step has the same samples_seen in both runs "
            f"(effective batch {baseline.effective_batch} vs {other.effective_batch})"
        )
    elif len(base_loss) != len(other_loss):
        notes.append(
            f"runs differ in length ({len(base_loss)} vs {len(other_loss)} logged steps): "
            f"loss gap over the {len(matched)} shared points"
        )
    if baseline.effective_batch != other.effective_batch:
        notes.append(
            f"effective batch differs ({baseline.effective_batch} vs {other.effective_batch}): "
            "equal samples seen means a different number of optimizer steps"
        )
    if baseline.peak_memory_metric != other.peak_memory_metric:
        notes.append(f"peak memory measured differently: {baseline.peak_memory_metric} vs {other.peak_memory_metric}")
    if baseline.tokens_per_s is None or other.tokens_per_s is None:
        notes.append("tokens_per_s missing in a run: no speedup")

    speedup = _ratio(other.tokens_per_s, baseline.tokens_per_s)
    return Comparison(
        baseline=baseline,
        other=other,
        speedup=speedup,
        scaling_efficiency=_ratio(speedup, other.world_size / baseline.world_size),
        step_time_ratio=_ratio(other.step_time_s, baseline.step_time_s),
        loss_gap_max=max(gaps) if gaps else None,
        loss_gap_mean=sum(gaps) / len(gaps) if gaps else None,
        matched_points=len(matched),
        eval_loss_delta=(
            other.final_eval_loss - baseline.final_eval_loss
            if other.final_eval_loss is not None and baseline.final_eval_loss is not None
            else None
        ),
        notes=notes,
        baseline_curve=base_curve,
        other_curve=other_curve,
    )


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

    rows = [
        ["world size", *(str(r.world_size) for r in runs)],
        ["optimizer steps", *(str(r.steps) for r in runs)],
        ["tokens/s (global)", *(_fmt(r.tokens_per_s, ",.1f") for r in runs)],
        ["tokens/s per device", *(_fmt(r.tokens_per_s_per_device, ",.1f") for r in runs)],
        ["step time (s)", *(_fmt(r.step_time_s, ".3f") for r in runs)],
        ["peak memory per device (GB)", *(memory(r) for r in runs)],
        ["final eval loss", *(_fmt(r.final_eval_loss, ".4f") for r in runs)],
    ]
    if any(r.is_ddp for r in runs):
        rows.append(["exposed comm / overlap (DDP)", *(comm(r) for r in runs)])
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
    warmup = max(base.warmup_steps_skipped, other.warmup_steps_skipped)
    return [
        f"- **Speedup** (global tokens/s, {other.run_name} / {base.run_name}): {_fmt(c.speedup, '.2f')}x",
        f"- **Scaling efficiency** (speedup / {devices:g}x devices): {_fmt(c.scaling_efficiency, '.1%')}",
        f"- **Step time ratio** ({other.run_name} / {base.run_name}): {_fmt(c.step_time_ratio, '.3f')}",
        f"- **Loss-curve gap** (|delta loss| at equal samples seen): {gap}",
        f"- **Eval loss delta** ({other.run_name} - {base.run_name}): {eval_delta}",
        "",
        f"{TOKENS_NOTE} Tokens/s and step time are medians over steps after {warmup} warm-up step(s) per "
        "run segment; peak memory is the max over all steps of rank 0's process.",
        *(f"Note: {n}." for n in c.notes),
    ]


def markdown_table(comparison: Comparison) -> str:
    """The comparison as markdown: one column per run, then speedup, efficiency and loss-gap lines."""
    columns, rows = table_rows(comparison)
    lines = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join([*lines, "", *summary_lines(comparison)]) + "\n"


def plot_comparison(comparison: Comparison, path: str | Path) -> Path:
    """Save a two-panel PNG: loss vs samples seen (eval loss as markers) and throughput bars.

    Args:
        comparison (Comparison): what to draw.
        path (str | Path): the PNG to write.

    Returns:
        Path: ``path``.
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

    groups = ("global", "per device")
    width = 0.38
    for i, (name, run, color) in enumerate(zip(names, (base, other), ("tab:blue", "tab:orange"), strict=True)):
        values = [run.tokens_per_s or 0.0, run.tokens_per_s_per_device or 0.0]
        bars = bar_ax.bar([g + (i - 0.5) * width for g in range(len(groups))], values, width, color=color, label=name)
        bar_ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], padding=2)
    bar_ax.set_xticks(range(len(groups)), [f"tokens/s {g}" for g in groups])
    bar_ax.set(ylabel="non-padding tokens/s (median)", title=f"Throughput (speedup {_fmt(comparison.speedup, '.2f')}x)")
    bar_ax.margins(y=0.12)  # room for the value labels
    bar_ax.legend()
    fig.suptitle(f"{base.run_name} ({base.world_size} device(s)) vs {other.run_name} ({other.world_size} device(s))")
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


WANDB_PREFIX = "wandb:"


def records_from_wandb(run_path: str, api: object | None = None) -> list[dict]:
    """A wandb run (``entity/project/run_id``) as ``metrics.jsonl`` records, for runs logged online.

    Uses the keys both ddp_ft paths log: ``train/*`` (against ``train/samples_seen``) and ``eval/loss``;
    the run config gives world size and batch arithmetic.

    Args:
        run_path (str): ``entity/project/run_id``.
        api (object | None): a ``wandb.Api()`` (or a stand-in with ``run(path)``). Default: a new ``wandb.Api()``.
    """
    if api is None:
        import wandb

        api = wandb.Api()
    run = api.run(run_path)
    records: list[dict] = [{"type": CONFIG, "run_name": run.name, **dict(run.config)}]
    for row in run.scan_history():
        samples = row.get(STEP_METRIC)
        if row.get("train/loss") is not None:
            train = {k.removeprefix("train/"): v for k, v in row.items() if k.startswith("train/") and v is not None}
            records.append({"type": TRAIN, "step": train.get("step", row.get("_step")), **train})
        if row.get("eval/loss") is not None:
            records.append(eval_record(step=row.get("_step"), samples_seen=samples, eval_loss=row["eval/loss"]))
    return records


def load_run(run_dir: str | Path, skip_first: int = 1) -> tuple[RunSummary, list[dict]]:
    """Read ``run_dir/metrics.jsonl`` (or the wandb run ``wandb:entity/project/run_id``); return summary and records.

    Raises:
        FileNotFoundError: if ``run_dir`` holds no ``metrics.jsonl``.
    """
    if str(run_dir).startswith(WANDB_PREFIX):
        records = records_from_wandb(str(run_dir)[len(WANDB_PREFIX) :])
        return summarize_run(records, skip_first), records
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass the output_dir of a training run")
    records = timeline(read_jsonl(path))
    return summarize_run(records, skip_first), records


def write_report(baseline_dir: str | Path, other_dir: str | Path, out_dir: str | Path, skip_first: int = 1) -> dict:
    """Compare two run directories; write ``comparison.md``, ``comparison.png`` and ``comparison.json``.

    Args:
        baseline_dir (str | Path): output_dir of the baseline run (1 device).
        other_dir (str | Path): output_dir of the DDP run.
        out_dir (str | Path): where the three files go (created).
        skip_first (int): warm-up steps left out of the medians. Default: 1.

    Returns:
        dict: the content of ``comparison.json``: :meth:`Comparison.to_dict` plus ``table``
        (``columns``, ``rows``), ``markdown`` and ``files`` (the three paths).
    """
    baseline, baseline_records = load_run(baseline_dir, skip_first)
    other, other_records = load_run(other_dir, skip_first)
    comparison = compare_runs(baseline, baseline_records, other, other_records)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    markdown = markdown_table(comparison)
    files = {name: str(out / f"comparison.{name}") for name in ("md", "png", "json")}
    Path(files["md"]).write_text(markdown)
    plot_comparison(comparison, files["png"])
    columns, rows = table_rows(comparison)
    report = {**comparison.to_dict(), "table": {"columns": columns, "rows": rows}, "markdown": markdown, "files": files}
    Path(files["json"]).write_text(json.dumps(report, indent=2))
    logger.info("wrote %s", ", ".join(files.values()))
    return report


def log_report_to_wandb(report: dict, png_path: str | Path, project: str, group: str) -> None:
    """Log a :func:`write_report` result to wandb as one ``compare`` job of ``group``; never raises.

    Logs the per-run table as a ``wandb.Table``, the PNG as a ``wandb.Image`` and the headline numbers
    (speedup, scaling efficiency, loss gap, ...) to the run summary. The mode comes from
    :func:`resolve_wandb_mode`. If wandb is missing or fails, a warning is logged and nothing else happens.

    Args:
        report (dict): what :func:`write_report` returned.
        png_path (str | Path): the comparison plot.
        project (str): wandb project.
        group (str): wandb group, shared with the two training runs; the run is named ``{group}-compare``.
    """
    try:
        import wandb
    except ImportError:
        logger.warning("wandb is not installed: comparison not logged to wandb")
        return
    mode = resolve_wandb_mode(os.environ)
    run = None
    try:
        run = wandb.init(project=project, group=group, job_type="compare", name=f"{group}-compare", mode=mode)
        table = report["table"]
        run.log(
            {
                "comparison/table": wandb.Table(columns=table["columns"], data=table["rows"]),
                "comparison/plot": wandb.Image(str(png_path)),
            }
        )
        keys = (
            "speedup",
            "scaling_efficiency",
            "step_time_ratio",
            "loss_gap_max",
            "loss_gap_mean",
            "matched_points",
            "eval_loss_delta",
        )
        run.summary.update({f"comparison/{k}": report[k] for k in keys if report.get(k) is not None})
        logger.info("logged comparison to wandb (%s mode): %s", mode, run.dir)
    except Exception as error:  # a broken wandb must not cost the user the report already on disk
        logger.warning("could not log the comparison to wandb (%s mode): %s", mode, error)
    finally:
        if run is not None:
            try:
                run.finish()
            except Exception as error:
                logger.warning("wandb finish failed: %s", error)
