"""Reduce one run's records to a :class:`RunSummary` and two runs to a :class:`Comparison`."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields

from ..forecast.build import Forecast
from ..records import CONFIG, EVAL, TRAIN, of_type, timed_train_records
from .fairness import HOST_FIELDS, host_notes, mismatch

MEMORY_METRICS = ("peak_mem_gb", "peak_rss_gb")  # GPU allocator peak, CPU resident set peak


@dataclass
class RunSummary:
    """One run reduced to the numbers the comparison needs.

    Args:
        run_name (str): the config record's run name, else the caller's name.
        world_size (int): ranks of the run.
        effective_batch (int | None): samples per optimizer step.
        steps (int): distinct optimizer steps logged.
        timed_steps (int): train records behind the medians.
        warmup_steps_skipped (int): train records skipped as warm-up.
        tokens_per_s (float | None): median global tokens/s.
        tokens_per_s_per_device (float | None): median tokens/s per device.
        step_time_s (float | None): median seconds per step.
        peak_memory_gb (float | None): rank 0's peak memory in GB.
        peak_memory_metric (str | None): ``peak_mem_gb`` (GPU) or ``peak_rss_gb`` (CPU).
        final_eval_loss (float | None): the last eval loss.
        exposed_comm_ms (float | None): median ms backward waited on communication.
        overlap (float | None): median fraction of communication hidden.
        imbalance (float | None): median slowest over fastest rank compute.
        wait_for_slowest_ms (float | None): median ms rank 0 waited.
        threads_per_process (int | None): intra-op threads per process.
        device_type (str | None): ``cpu`` or ``cuda``.
        local_world_size (int | None): processes on rank 0's host.
        usable_cpus (int | None): CPUs rank 0 could use.
        host_load_1m (float | None): host load average at start.
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
    imbalance: float | None = None
    wait_for_slowest_ms: float | None = None
    threads_per_process: int | None = None
    device_type: str | None = None
    local_world_size: int | None = None
    usable_cpus: int | None = None
    host_load_1m: float | None = None

    @property
    def is_ddp(self) -> bool:
        return self.exposed_comm_ms is not None


@dataclass
class LossCurve:
    """Train and eval loss of one run against samples seen.

    Args:
        samples_seen (list[int]): ascending, one per optimizer step.
        loss (list[float]): train loss at each point.
        eval_samples_seen (list[int]): samples seen at each eval.
        eval_loss (list[float]): eval loss at each eval.
    """

    samples_seen: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    eval_samples_seen: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)


@dataclass
class Comparison:
    """A baseline run against another run of the same experiment.

    Args:
        baseline (RunSummary): the reference run.
        other (RunSummary): the run being judged.
        speedup (float | None): other's global tokens/s over the baseline's.
        scaling_efficiency (float | None): speedup over the world-size ratio.
        step_time_ratio (float | None): other's step time over the baseline's.
        loss_gap_max (float | None): largest loss gap over matched points.
        loss_gap_mean (float | None): mean loss gap over matched points.
        matched_points (int): train steps at equal ``samples_seen``.
        eval_loss_delta (float | None): other's final eval loss minus the baseline's.
        notes (list[str]): caveats the reader must see.
        baseline_curve (LossCurve): the baseline's loss curve.
        other_curve (LossCurve): the other run's loss curve.
        limit_tokens_per_s (float | None): summed tokens/s of independent single-device runs.
        of_limit (float | None): other's tokens/s over that limit.
        not_comparable (list[str]): why a speed ratio is withheld, with the fix.
        forecast (dict | None): the forecast row for other's world size.
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
    limit_tokens_per_s: float | None = None
    of_limit: float | None = None
    not_comparable: list[str] = field(default_factory=list)
    forecast: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> Comparison:
        """Rebuild from :meth:`to_dict` output, ignoring unknown keys."""
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data or f.name in required}
        values["baseline"] = RunSummary(**values["baseline"])
        values["other"] = RunSummary(**values["other"])
        values["baseline_curve"] = LossCurve(**values["baseline_curve"])
        values["other_curve"] = LossCurve(**values["other_curve"])
        return cls(**values)


def _median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize_run(records: list[dict], skip_first: int = 1, name: str = "run") -> RunSummary:
    """Reduce one run's ``metrics.jsonl`` records to a :class:`RunSummary`.

    Medians skip ``skip_first`` warm-up steps after each config record, since a resumed run warms up again.

    Args:
        records (list[dict]): the run's records in file order.
        skip_first (int): warm-up steps left out of the medians. Default: 1.
        name (str): the run's name if its config record has none. Default: run

    Returns:
        RunSummary: the run's summary.

    Raises:
        ValueError: if ``skip_first`` is negative or a record type is missing.

    Example:
        >>> summary = summarize_run(records, skip_first=2)
    """
    if skip_first < 0:
        raise ValueError(f"skip_first must be >= 0, got {skip_first}")
    configs, trains = of_type(records, CONFIG), of_type(records, TRAIN)
    if not configs:
        raise ValueError("no config record (type 'config'): is this a ddp_ft metrics.jsonl?")
    if not trains:
        raise ValueError(f"run {configs[0].get('run_name')!r} has no train record")
    timed = timed_train_records(records, skip_first)
    memory_metric = next((m for m in MEMORY_METRICS if any(m in r for r in trains)), None)
    evals = [r for r in of_type(records, EVAL) if r.get("eval_loss") is not None]
    first = configs[0]
    return RunSummary(
        run_name=str(first.get("run_name") or name),
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
        imbalance=_median(timed, "imbalance"),
        wait_for_slowest_ms=_median(timed, "wait_for_slowest_ms"),
        **{key: first.get(key) for key in HOST_FIELDS},
    )


def loss_curve(records: list[dict]) -> LossCurve:
    """Train and eval loss against samples seen; a repeated point keeps the later value."""
    train = {r["samples_seen"]: r["loss"] for r in of_type(records, TRAIN) if r.get("loss") is not None}
    evals = {r["samples_seen"]: r["eval_loss"] for r in of_type(records, EVAL)}
    evals = {k: v for k, v in evals.items() if v is not None}
    return LossCurve(sorted(train), [train[k] for k in sorted(train)], sorted(evals), [evals[k] for k in sorted(evals)])


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def compare_runs(
    baseline: RunSummary,
    baseline_records: list[dict],
    other: RunSummary,
    other_records: list[dict],
    independent: list[RunSummary] | None = None,
    forecast: Forecast | None = None,
) -> Comparison:
    """Compare two summarized runs, matching loss curves on ``samples_seen``.

    Args:
        baseline (RunSummary): the reference run.
        baseline_records (list[dict]): its records.
        other (RunSummary): the run being judged.
        other_records (list[dict]): its records.
        independent (list[RunSummary] | None): side-by-side single-device runs, one per device. Default: None.
        forecast (Forecast | None): the baseline's forecast. Default: None.

    Returns:
        Comparison: the ratios, loss gap and notes.

    Example:
        >>> comparison = compare_runs(base, base_records, ddp, ddp_records)
    """
    base_curve, other_curve = loss_curve(baseline_records), loss_curve(other_records)
    base_loss = dict(zip(base_curve.samples_seen, base_curve.loss, strict=True))
    other_loss = dict(zip(other_curve.samples_seen, other_curve.loss, strict=True))
    matched = sorted(base_loss.keys() & other_loss.keys())
    gaps = [abs(other_loss[s] - base_loss[s]) for s in matched]
    notes = _run_notes(baseline, other, len(base_loss), len(other_loss), len(matched))
    notes += host_notes([baseline, other, *(independent or [])])
    refused = mismatch(baseline, other)
    unfair_limit = [reason for run in independent or [] if (reason := mismatch(run, other))]
    limit = _limit(other, independent, notes) if independent else None
    of_limit = None if unfair_limit else _ratio(other.tokens_per_s, limit)
    if of_limit is not None and of_limit > 1.0:
        notes.append(_over_the_limit_note(baseline, other, independent, of_limit))

    speedup = None if refused else _ratio(other.tokens_per_s, baseline.tokens_per_s)
    beside = _forecast_row(forecast, baseline, other, notes) if forecast is not None else None
    return Comparison(
        baseline=baseline,
        other=other,
        speedup=speedup,
        scaling_efficiency=_ratio(speedup, other.world_size / baseline.world_size),
        step_time_ratio=None if refused else _ratio(other.step_time_s, baseline.step_time_s),
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
        limit_tokens_per_s=limit,
        of_limit=of_limit,
        not_comparable=[reason for reason in (refused, *unfair_limit) if reason],
        forecast=beside,
    )


def _forecast_row(forecast: Forecast, baseline: RunSummary, other: RunSummary, notes: list[str]) -> dict | None:
    """The forecast row for ``other``'s world size; caveats go to ``notes``."""
    if forecast.run_name != baseline.run_name:
        notes.append(f"the forecast was made from {forecast.run_name}, not from the baseline {baseline.run_name}")
    row = forecast.row(other.world_size)
    if row is None:
        notes.append(
            f"the forecast has no row for {other.world_size} processes: ddp-ft forecast BASELINE --nproc "
            f"{other.world_size} --out DIR"
        )
        return None
    return {**asdict(row), "from_run": forecast.run_name}


def _run_notes(baseline: RunSummary, other: RunSummary, base_points: int, other_points: int, matched: int) -> list:
    """The caveats on comparing the two runs."""
    notes = []
    if not matched:
        notes.append(
            "loss curves not comparable: no train step has the same samples_seen in both runs "
            f"(effective batch {baseline.effective_batch} vs {other.effective_batch})"
        )
    elif base_points != other_points:
        notes.append(
            f"runs differ in length ({base_points} vs {other_points} logged steps): "
            f"loss gap over the {matched} shared points"
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
    return notes


def _limit(other: RunSummary, independent: list[RunSummary], notes: list[str]) -> float | None:
    """The summed tokens/s of the independent runs; caveats go to ``notes``."""
    if len(independent) != other.world_size or any(r.world_size != 1 for r in independent):
        raise ValueError(
            f"the independent runs must be {other.world_size} single-device runs (one per device of "
            f"{other.run_name}); got world sizes {[r.world_size for r in independent]}"
        )
    if any(r.effective_batch != other.effective_batch for r in independent):
        notes.append(
            f"the independent runs' effective batch {[r.effective_batch for r in independent]} differs from "
            f"{other.run_name}'s ({other.effective_batch}): the limit is another experiment"
        )
    if any(r.tokens_per_s is None for r in independent):
        notes.append("tokens_per_s missing in an independent run: no limit")
        return None
    return sum(r.tokens_per_s for r in independent)


def _over_the_limit_note(
    baseline: RunSummary, other: RunSummary, independent: list[RunSummary], of_limit: float
) -> str:
    """Explain a ratio over 100%: the independent runs were slowed by a busy host."""
    alone = " and ".join(f"{r.tokens_per_s:,.0f}" for r in independent)
    single = f"; {baseline.run_name} alone: {baseline.tokens_per_s:,.0f}" if baseline.world_size == 1 else ""
    return (
        f"{other.run_name} at {of_limit:.1%} of the limit is not a result: over 100% means the independent runs, "
        f"which do no communication, ran slower than DDP (tokens/s {alone}{single}), so the host was busy while "
        "they ran; rerun the comparison on a quiet host"
    )
