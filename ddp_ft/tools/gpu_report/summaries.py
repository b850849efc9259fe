"""Each step's headline numbers, read from the JSON its command wrote: ``summarize(result, done) -> (summary,
problems)`` (:data:`~ddp_ft.tools.gpu_report.runner.Summarize`). A problem fails a step whose command succeeded: a
variant whose losses leave the baseline's by more than the compute dtype's tolerance."""

from __future__ import annotations

import math

from ..gpu_check import GRAD_TOL


def _gb(value: float | None) -> str:
    return f"{value:.2f} GB" if value else "n/a"


def bench_gpu(result: dict, done: dict[str, dict]) -> tuple[dict, list[str]]:
    """``scripts/bench_gpu.py``: tokens/s, MFU and peak memory per mode; the overhead or the speedup."""
    modes = {
        mode: {k: m.get(k) for k in ("tokens_per_s", "step_s", "mfu", "peak_allocated_gb", "peak_reserved_gb")}
        for mode, m in result["modes"].items()
    }
    summary = {
        "device": result["device"],
        "world_size": result["world_size"],
        "compute_dtype": result["compute_dtype"],
        "modes": modes,
    }
    parts = [f"{mode} {m['tokens_per_s']:,.0f} tokens/s" for mode, m in modes.items()]
    for key, text in (
        ("bucketed_ddp_overhead", "overhead {:+.1%}"),
        ("speedup_over_1_process", "speedup {:.2f}x"),
        ("bucketed_ddp_over_independent", "{:.1%} of independent ranks"),
    ):
        if result.get(key) is not None:
            summary[key] = result[key]
            parts.append(text.format(result[key]))
    peak = max((m["peak_allocated_gb"] or 0 for m in modes.values()), default=0)
    parts.append(f"peak allocated {_gb(peak)}")
    summary["headline"] = ", ".join(parts)
    return summary, []


def micro_batch_auto(result: dict, done: dict[str, dict]) -> tuple[dict, list[str]]:
    """``bench_gpu --micro-batch auto``: the choice, its expected peak and the measured one."""
    summary, _ = bench_gpu(result, done)
    auto = result.get("micro_batch_auto")
    if not auto:
        return summary, ["the result holds no micro_batch_auto: --micro-batch auto did not run"]
    summary["micro_batch_auto"] = auto
    measured = auto["measured_peak_allocated_gb"]
    ratio = f" ({auto['measured_over_expected']:.0%} of expected)" if auto["measured_over_expected"] else ""
    tokens = next(iter(summary["modes"].values()))["tokens_per_s"]
    arithmetic = auto.get("arithmetic")  # the first guess, when the probe (ddp_ft.training.model.probe) decided
    how = f" (probed; the arithmetic expected {_gb(arithmetic['expected_peak_gb'])})" if arithmetic else ""
    summary["headline"] = (
        f"micro-batch {auto['micro_batch']} x {auto['accumulation']} accumulation: {tokens:,.0f} tokens/s; expected "
        f"peak {_gb(auto['expected_peak_gb'])}{how}, measured {_gb(measured)}{ratio}"
    )
    over = auto["measured_over_expected"]
    gate = [f"measured peak {over:.0%} of the expected: beyond the 10% gate"] if over and abs(over - 1) > 0.10 else []
    return summary, gate


def against(baseline_step: str):
    """The summary of a variant against the step ``baseline_step`` (:func:`variant`'s, with another baseline)."""
    return lambda result, done: variant(result, done, baseline_step)


def decomposition_cell(baseline_step: str | None):
    """A cell of the compile x checkpointing x micro-batch decomposition: ``micro_batch_auto``'s summary (expected
    against measured peak) at ``auto``, and, when compiled, the loss and speed against the eager twin
    ``baseline_step``."""

    def summarize(result: dict, done: dict[str, dict]) -> tuple[dict, list[str]]:
        summary, problems = (
            micro_batch_auto(result, done) if result.get("micro_batch_auto") else bench_gpu(result, done)
        )
        if baseline_step is None:
            return summary, problems
        compared, more = variant(result, done, baseline_step)
        summary["against_eager"] = compared.get("against_baseline")
        summary["headline"] += f"; against eager: {compared['headline'].split(' = ', 1)[-1]}"
        return summary, problems + more

    return summarize


def variant(result: dict, done: dict[str, dict], baseline_step: str = "variant_baseline") -> tuple[dict, list[str]]:
    """``bench_gpu --liger`` / ``--compile`` against ``baseline_step``: the loss at every step within the compute
    dtype's tolerance (relative, ``GRAD_TOL``'s rtol), tokens/s and peak memory as ratios."""
    summary, _ = bench_gpu(result, done)
    baseline = done.get(baseline_step, {})
    if baseline.get("status") != "passed":
        summary["headline"] += f"; no baseline to compare with (its step: {baseline.get('status', 'absent')})"
        return summary, []
    (mode,) = result["modes"]  # one mode, as planned
    ours, theirs = result["modes"][mode], baseline["result"]["modes"][mode]
    dtype = result["compute_dtype"]
    rtol = GRAD_TOL[dtype][0]
    a, b = ours["losses"], theirs["losses"]
    problems = []
    if len(a) != len(b) or not a:
        problems.append(f"{len(a)} losses against the baseline's {len(b)}: not the same steps")
    diffs = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=False)]
    worst = max(diffs, default=math.nan)
    if not all(math.isfinite(x) for x in a) or not worst <= rtol:
        problems.append(f"loss differs from the baseline's by {worst:.2e} relative (tolerance {rtol:g} in {dtype})")
    peak, base_peak = ours["peak_allocated_gb"], theirs["peak_allocated_gb"]
    summary["against_baseline"] = {
        "loss_max_relative_difference": worst,
        "loss_rtol": rtol,
        "losses_compared": min(len(a), len(b)),
        "tokens_per_s_ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "peak_allocated_ratio": peak / base_peak if peak and base_peak else None,
    }
    against = summary["against_baseline"]
    memory = f", peak {against['peak_allocated_ratio']:.2f}x" if against["peak_allocated_ratio"] else ""
    summary["headline"] = (
        f"{ours['tokens_per_s']:,.0f} tokens/s = {against['tokens_per_s_ratio']:.2f}x the baseline{memory}; loss "
        f"within {worst:.1e} relative over {against['losses_compared']} steps (tolerance {rtol:g}, {dtype})"
    )
    return summary, problems


def gpu_check(result: dict, done: dict[str, dict]) -> tuple[dict, list[str]]:
    """``scripts/gpu_check.py``: the verdict, and each phase's checks."""
    phases = {
        str(p["world_size"]): {c["name"]: c["passed"] for c in p.get("checks", [])} or {"error": p.get("error")}
        for p in result["phases"]
    }
    summary = {"passed": result["passed"], "backend": result["backend"], "gpus": result["gpus"], "phases": phases}
    details = [
        f"{p['world_size']} process(es): " + "; ".join(c["detail"] for c in p.get("checks", [])[1:3])
        for p in result["phases"]
    ]
    verdict = "PASS" if result["passed"] else "FAIL"
    summary["headline"] = f"{verdict} on {result['backend']}: " + " | ".join(details)
    return summary, [] if result["passed"] else ["gpu_check failed (see its result)"]


def ladder(result: dict, done: dict[str, dict]) -> tuple[dict, list[str]]:
    """``scripts/ladder.py``: tokens/s and exposed communication per rung, per workload."""
    workloads = {
        name: {rung: row["tokens_per_s"] for rung, row in w["rungs"].items()} for name, w in result["workloads"].items()
    }
    summary = {"hardware": result["hardware"], "backend": result["backend"], "tokens_per_s": workloads}
    parts = [
        f"{name}: " + ", ".join(f"{rung} {rate:,.0f}" for rung, rate in rungs.items())
        for name, rungs in workloads.items()
    ]
    summary["headline"] = "tokens/s " + "; ".join(parts)
    return summary, []


def forecast_check(result: dict, done: dict[str, dict]) -> tuple[dict, list[str]]:
    """``python -m ddp_ft.tools.forecast_check``: the forecast against the runs' range, per quantity."""
    quantities = {
        key: {k: q[k] for k in ("forecast", "low", "high", "verdict")} for key, q in result["quantities"].items()
    }
    summary = {"passed": result["passed"], "device": result["device"], "quantities": quantities}
    step, exposed = quantities["step_time_s"], quantities["exposed_comm_ms"]
    summary["headline"] = (
        f"{'PASS' if result['passed'] else 'FAIL'}: step time {step['forecast']:.3f} s {step['verdict']} "
        f"[{step['low']:.3f}, {step['high']:.3f}] s, exposed communication {exposed['forecast']:.1f} ms "
        f"{exposed['verdict']} [{exposed['low']:.1f}, {exposed['high']:.1f}] ms ({len(result['runs'])} run{'' if len(result['runs']) == 1 else 's'} of 2 processes)"
    )
    return summary, []
