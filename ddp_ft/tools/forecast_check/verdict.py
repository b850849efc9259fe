"""The check's numbers and verdicts: each run's medians, the runs' range, and whether the forecast falls inside it.
Pure: records and forecasts in, dicts and text out."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ...report.comparison import summarize_run
from ...report.forecast import Forecast
from ...report.records import BACKWARD, micro_step_ms, of_type

# The quantities compared: the key in the check's JSON, the label, the unit, the RunSummary / ForecastRow field.
QUANTITIES = {
    "step_time_s": ("step time", "s", "step_time_s"),
    "exposed_comm_ms": ("exposed communication", "ms", "exposed_comm_ms"),
}
SKIP_FIRST = 1  # the warm-up step left out: the medians are over steps 2..N, as the hand validation took them


def run_medians(records: list[dict], name: str = "run") -> dict[str, float | None]:
    """A run's median step time and exposed communication over steps 2..N, and the host's load when it started.

    Args:
        records (list[dict]): the run's ``metrics.jsonl`` records.
        name (str): the run's name where its records have none. Default: run

    Returns:
        dict[str, float | None]: one value per quantity of :data:`QUANTITIES` (exposed communication is None for a
            run of one process), and ``host_load_1m`` (None where the run did not record it).
    """
    summary = summarize_run(records, skip_first=SKIP_FIRST, name=name)
    values = {key: getattr(summary, field) for key, (_, _, field) in QUANTITIES.items()}
    return values | {"host_load_1m": summary.host_load_1m, "micro_step_ms": median_micro_step_ms(records)}


def median_micro_step_ms(records: list[dict]) -> float | None:
    """Rank 0's median micro-step over steps 2..N: the last forward and backward of each step, by the device's clock.

    The forecast takes every rank to compute a micro-step as fast as the one process did; this shows whether the
    runs did. None where the run recorded no forward time.
    """
    timed = [micro_step_ms(r) for r in of_type(records, BACKWARD) if r.get("step", 0) > SKIP_FIRST]
    times = [t for t in timed if t is not None]
    return statistics.median(times) if times else None


def forecast_values(forecast: Forecast, nproc: int) -> dict[str, float]:
    """The forecast's ``nproc``-process row on one machine, one value per quantity.

    Raises:
        ValueError: the forecast has no such row.
    """
    row = forecast.row(nproc)
    if row is None:
        raise ValueError(f"the forecast of {forecast.run_name} has no row of {nproc} processes on one machine")
    return {key: getattr(row, field) for key, (_, _, field) in QUANTITIES.items()}


def judge(forecast: float, runs: Sequence[float]) -> dict:
    """Where ``forecast`` falls against the range of ``runs``, bounds included.

    Args:
        forecast (float): the forecast value.
        runs (Sequence[float]): the measured runs' values, one or more.

    Returns:
        dict: ``forecast``, ``low``, ``high``, ``verdict`` (``inside``, ``below`` or ``above``) and ``inside``.

    Raises:
        ValueError: no run to compare with.
    """
    if not runs:
        raise ValueError("no measured run to compare the forecast with")
    low, high = min(runs), max(runs)
    verdict = "below" if forecast < low else "above" if forecast > high else "inside"
    return {"forecast": forecast, "low": low, "high": high, "verdict": verdict, "inside": verdict == "inside"}


def compare(forecasts: dict[str, dict[str, float]], runs: Sequence[dict[str, float | None]]) -> dict[str, dict]:
    """Each quantity: every forecast judged against the runs' range.

    Args:
        forecasts (dict[str, dict[str, float]]): by source (``single``, then ``pair0``, ``pair1``), the values of
            :func:`forecast_values`; the first is the headline.
        runs (Sequence[dict[str, float | None]]): the multi-process runs' :func:`run_medians`.

    Returns:
        dict[str, dict]: by quantity: ``runs`` (the values), ``by_source`` (each source's :func:`judge`), and the
            headline's ``forecast``, ``low``, ``high``, ``verdict`` and ``inside``.

    Raises:
        ValueError: no forecast, or a run without the quantity.
    """
    if not forecasts:
        raise ValueError("no forecast to judge")
    result = {}
    for key, (label, _, _) in QUANTITIES.items():
        values = [run[key] for run in runs]
        if any(v is None for v in values):
            raise ValueError(f"a multi-process run recorded no {label}: was it a run of one process?")
        by_source = {source: judge(f[key], values) for source, f in forecasts.items()}
        headline = by_source[next(iter(forecasts))]
        result[key] = {"runs": values, **headline, "by_source": by_source}
    return result


def passed(quantities: dict[str, dict]) -> bool:
    """Whether the headline forecast falls inside the runs' range for every quantity."""
    return all(q["inside"] for q in quantities.values())


def _number(value: float, unit: str) -> str:
    return f"{value:.3f} s" if unit == "s" else f"{value:.1f} ms"


def _each_run(result: dict, key: str, unit: str = "") -> str:
    """``key`` of every run behind the check (``?`` where a run has none): the one process, the pair, the runs."""

    def value(run: dict) -> str:
        return "?" if run.get(key) is None else f"{run[key]:.1f}{unit}"

    groups = (("one process", [result["single"]]), ("the pair", result["pair"]), ("the runs", result["runs"]))
    return "; ".join(f"{label} " + ", ".join(value(r) for r in runs) for label, runs in groups)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def markdown(result: dict) -> str:
    """The check's table: per quantity, the forecasts, the runs and the verdict; then the link and the runs behind it.

    Args:
        result (dict): the check's JSON (:func:`ddp_ft.tools.forecast_check.cli.run_check`'s result).
    """
    nproc = result["nproc"]
    lines = [
        f"# Forecast check: {nproc} processes on {result['device']}, preset {result['preset']}, "
        f"{result['steps']} steps, medians of steps 2..{result['steps']}",
        "",
        f"| quantity | forecast (1-process run) | forecasts (the pair's runs) | {_count(len(result['runs']), 'run')} "
        f"of {nproc} processes | verdict |",
        "|---|---:|---:|---:|---|",
    ]
    for key, (label, unit, _) in QUANTITIES.items():
        q = result["quantities"][key]
        pair = ", ".join(_number(j["forecast"], unit) for s, j in q["by_source"].items() if s != "single")
        runs = ", ".join(_number(v, unit) for v in q["runs"])
        lines.append(
            f"| {label} | **{_number(q['forecast'], unit)}** | {pair or '-'} | {runs} | **{q['verdict']}** "
            f"[{_number(q['low'], unit)}, {_number(q['high'], unit)}] |"
        )
    link = result["link"]
    pair = [
        f"{label} "
        + ", ".join(j["verdict"] for s, j in result["quantities"][key]["by_source"].items() if s != "single")
        for key, (label, _, _) in QUANTITIES.items()
    ]
    lines += [
        "",
        f"Verdict: {'PASS' if result['passed'] else 'FAIL'}: the forecast from the 1-process run "
        f"{'falls' if result['passed'] else 'does not fall'} inside the runs' range for every quantity.",
        f"From the pair's runs: {'; '.join(pair)}.",
        f"One process: {_number(result['single']['step_time_s'], 's')} per step; the pair's runs: "
        + ", ".join(_number(r["step_time_s"], "s") for r in result["pair"])
        + ".",
        f"Host load (1 min) as each run started: {_each_run(result, 'host_load_1m')}; on a loaded host the runs' "
        "range widens.",
        "Micro-step (rank 0's median forward and backward), which the forecast takes each rank to compute as fast as "
        f"the one process did: {_each_run(result, 'micro_step_ms', ' ms')}.",
        f"Link (ddp-ft doctor, measured): {link['bandwidth_gbps']:.3g} GB/s, {link['latency_us']:.3g} us per ring "
        f"step.",
    ]
    return "\n".join(lines) + "\n"
