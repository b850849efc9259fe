"""End-to-end DDP throughput against its limit: 2-rank DDP vs two independent single processes run side by side.

    python scripts/bench_e2e.py --repeats 3 --out bench_results/bench_e2e.json     # make bench-e2e

Two independent single-process runs of the same fine-tune, started together, are what two devices do with no
communication at all: the limit. Each repeat runs, in an order that rotates every repeat, on each data set:

- ``pair-loop``: two ``python scripts/train.py`` at once; the limit is the sum of their tokens/s;
- ``ddp-loop``: ``torchrun --nproc_per_node=2 scripts/train.py`` (BucketedDDP);
- ``pair-recipe``: two ``accelerate launch --config_file accelerate_configs/single.yaml recipes/qwen_ami.py`` at once;
- ``ddp-recipe``: ``accelerate launch --config_file accelerate_configs/2cpu_gloo.yaml recipes/qwen_ami.py``.

Every run is the tiny preset (effective batch 8, micro-batch 2) with one thread per process, ``--report-to none``;
data ``tiny`` is the preset's own meetings (every sample fills 256 tokens) and ``mixed`` a local jsonl of meetings
of mixed lengths (``ddp_ft.synthetic.write_mixed_length_meetings``: 60 to 256 tokens). A run's tokens/s is the
median over its steps after the first (``ddp_ft.report.summarize_run``, as ``scripts/compare.py``). The ratio
DDP / pair is taken within each repeat; the table gives its median and range, and tokens/s, rank imbalance and the
wait for the slower rank of each configuration. Writes the JSON and a PNG beside it.

Where DDP's step goes (``step_parts``): the ranks' compute per 1,000 tokens (the pair's too: same work, same speed?),
the share of the step the ranks wait for the slower one, and DDP / pair had no rank waited, which is what
communication, the optimizer and logging allow. A DDP step waits for the slower of its ranks and an independent
process never waits, so on equal work the gap between the two ratios is the ranks' step-to-step compute noise.
The plan ceiling (``plan_ceiling``, also ``--plan-ceiling`` alone, no runs) is DDP / pair at best on the data: a step's
samples cannot always be split evenly over the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddp_ft.report import load_run
from ddp_ft.synthetic import write_mixed_length_meetings

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENTRIES = ("loop", "recipe")
CONFIGS = tuple(f"{kind}-{entry}" for entry in ENTRIES for kind in ("pair", "ddp"))


def _command(config: str, out: Path, source: str | None, max_steps: int) -> list[list[str]]:
    """The command lines of one configuration (two for a pair, started together)."""
    kind, entry = config.split("-")
    flags = ["--preset", "tiny", "--report-to", "none", "--max-steps", str(max_steps)]
    flags += ["--source", source] if source else []
    script = str(ROOT / ("scripts/train.py" if entry == "loop" else "recipes/qwen_ami.py"))
    if kind == "pair":
        if entry == "loop":
            return [[sys.executable, script, *flags, "--output-dir", str(out / f"alone{i}")] for i in range(2)]
        launch = [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs/single.yaml")]
        return [[*launch, script, *flags, "--output-dir", str(out / f"alone{i}")] for i in range(2)]
    if entry == "loop":
        launch = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2"]
    else:
        launch = [str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_configs/2cpu_gloo.yaml")]
    return [[*launch, script, *flags, "--output-dir", str(out / "ddp")]]


def run_config(config: str, out: Path, source: str | None, max_steps: int) -> dict:
    """Run one configuration; its tokens/s (a pair: the sum), per-run medians, balance and wall seconds."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    started = time.perf_counter()
    logs = [open(out / f"{config}-{i}.log", "w") for i in range(2)]  # noqa: SIM115  (closed below)
    try:
        processes = [
            subprocess.Popen(c, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            for c, log in zip(_command(config, out, source, max_steps), logs, strict=False)
        ]
        codes = [p.wait(timeout=900) for p in processes]
    finally:
        for log in logs:
            log.close()
    wall = time.perf_counter() - started
    if any(codes):
        tail = (out / f"{config}-0.log").read_text()[-3000:]
        raise RuntimeError(f"{config} failed (exit codes {codes}); log {out}:\n{tail}")
    folders = [out / "ddp"] if config.startswith("ddp") else [out / "alone0", out / "alone1"]
    loaded = [load_run(f) for f in folders]
    summaries = [summary for summary, _ in loaded]
    parts = [step_parts(records) for _, records in loaded]
    return {
        "tokens_per_s": sum(s.tokens_per_s for s in summaries),
        "tokens_per_s_each": [s.tokens_per_s for s in summaries],
        "step_time_s": statistics.median(s.step_time_s for s in summaries),
        "imbalance": summaries[0].imbalance if config.startswith("ddp") else None,
        "wait_for_slowest_ms": summaries[0].wait_for_slowest_ms if config.startswith("ddp") else None,
        "exposed_comm_ms": summaries[0].exposed_comm_ms,
        # where a step's time goes (medians over the steps after the first; a pair: the mean of its two runs)
        "compute_ms_per_1k_tokens": statistics.mean(x["compute_ms_per_1k_tokens"] for x in parts),
        "wait_share": statistics.mean(x["wait_share"] for x in parts),
        "no_wait_tokens_per_s": sum(x["no_wait_tokens_per_s"] for x in parts),
        "wall_s": wall,
    }


def step_parts(records: list[dict]) -> dict[str, float]:
    """A run's step split into compute and waiting, from its train records (the first step left out).

    - ``compute_ms_per_1k_tokens``: the ranks' mean compute (forward and backward up to the last gradient) per 1,000
      of a rank's tokens: how fast each process computes, whatever it then waits for;
    - ``wait_share``: the share of the step the ranks wait, on average, for the slowest one (its compute minus the
      mean; 0 on one process);
    - ``no_wait_tokens_per_s``: tokens/s had no rank waited (the step less that mean wait): what the rest of the
      step (communication, optimizer, logging) allows.

    Two ranks' mean is the mean of the slowest and the fastest (``compute_max_ms``, ``compute_min_ms``); the
    benchmark runs 2 ranks or 1.
    """
    world = next(int(r["world_size"]) for r in records if r.get("type") == "config")
    if world > 2:
        raise ValueError(f"step_parts reads 1 or 2 ranks (max and min give the mean), got world size {world}")
    trains = [r for r in records if r.get("type") == "train"]
    steps = trains[1:] or trains
    compute, wait, no_wait = [], [], []
    for r in steps:
        mean_ms = (r["compute_max_ms"] + r["compute_min_ms"]) / 2
        waited_s = (r["compute_max_ms"] - mean_ms) / 1e3
        compute.append(mean_ms / (r["tokens"] / world) * 1e3)
        wait.append(waited_s / r["step_time_s"])
        no_wait.append(r["tokens"] / (r["step_time_s"] - waited_s))
    return {
        "compute_ms_per_1k_tokens": statistics.median(compute),
        "wait_share": statistics.median(wait),
        "no_wait_tokens_per_s": statistics.median(no_wait),
    }


def plan_ceiling(source: str | None, max_steps: int, workdir: Path) -> float:
    """DDP / pair at best on this data, from the balanced plan alone: the median, over the run's steps after the
    first, of the ranks' mean padded tokens over the most loaded rank's (the plan's cost model, micro-batch size
    times longest sample). A DDP step lasts as long as its slowest rank; the pair's processes each train all of a
    step's micro-batches, so their share per rank is the mean. 1.0 when every sample has the same length."""
    from ddp_ft.config import parse_settings
    from ddp_ft.data import EpochLoader
    from ddp_ft.data.balance import rank_costs
    from ddp_ft.distributed import DistInfo
    from ddp_ft.setup import prepare_run

    argv = ["--preset", "tiny", "--output-dir", str(workdir)] + (["--source", source] if source else [])
    settings = parse_settings(argv)
    t = settings.train
    train_set = prepare_run(settings, DistInfo()).train_set
    loader = EpochLoader(train_set, None, t.micro_batch, 0, 2, seed=t.seed, effective_batch=t.effective_batch)
    length_of = dict(enumerate(loader.lengths))
    ratios = []
    for _, plan in zip(range(max_steps), loader.plans(0), strict=False):
        costs = rank_costs(plan, length_of)
        ratios.append(statistics.mean(costs) / max(costs))
    return statistics.median(ratios[1:] or ratios)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="alternations of the configurations (>= 3 for a median)")
    p.add_argument("--data", nargs="+", choices=["tiny", "mixed"], default=["tiny", "mixed"], help="data sets")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="a subset of the runs")
    p.add_argument("--max-steps", type=int, default=16, help="optimizer steps per run (the tiny preset's 16)")
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_e2e.json"), help="JSON; the PNG goes beside")
    p.add_argument("--plan-ceiling", action="store_true", help="only print each data set's plan ceiling (no runs)")
    args = p.parse_args()

    runs: dict[str, dict[str, list[dict]]] = {d: {c: [] for c in args.configs} for d in args.data}
    with tempfile.TemporaryDirectory(prefix="bench_e2e-") as tmp:
        source = {"tiny": None, "mixed": write_mixed_length_meetings(Path(tmp, "mixed.jsonl"), n=160)}
        ceiling = {d: plan_ceiling(source[d], args.max_steps, Path(tmp, f"plan-{d}")) for d in args.data}
        for data, value in ceiling.items():
            print(f"{data:5} plan ceiling (DDP / pair at best, from padded tokens per rank): {value:.3f}", flush=True)
        if args.plan_ceiling:
            return
        for repeat in range(args.repeats):
            for data in args.data:
                shift = repeat % len(args.configs)
                for config in args.configs[shift:] + args.configs[:shift]:
                    out = Path(tmp, f"{data}-{config}-{repeat}")
                    out.mkdir()
                    result = run_config(config, out, source[data], args.max_steps)
                    runs[data][config].append(result)
                    print(
                        f"repeat {repeat + 1}/{args.repeats} {data:5} {config:11} {result['tokens_per_s']:8,.0f} "
                        f"tokens/s ({result['wall_s']:.0f} s)",
                        flush=True,
                    )

    summary = {}
    for data, by_config in runs.items():
        summary[data] = {c: {"tokens_per_s": _spread([r["tokens_per_s"] for r in rs])} for c, rs in by_config.items()}
        summary[data]["plan_ceiling"] = ceiling[data]
        for config, rs in by_config.items():
            keys = ["compute_ms_per_1k_tokens", "wait_share"]
            keys += ["imbalance", "wait_for_slowest_ms", "exposed_comm_ms"] if config.startswith("ddp") else []
            for key in keys:
                values = [r[key] for r in rs if r.get(key) is not None]
                summary[data][config][key] = statistics.median(values) if values else None
        for entry in ENTRIES:
            if f"ddp-{entry}" in by_config and f"pair-{entry}" in by_config:
                pairs = list(zip(by_config[f"ddp-{entry}"], by_config[f"pair-{entry}"], strict=True))
                summary[data][f"ddp_over_pair_{entry}"] = _spread(
                    [d["tokens_per_s"] / q["tokens_per_s"] for d, q in pairs]
                )
                # the same ratio had no rank waited for the slower one: what communication and the rest allow
                summary[data][f"no_wait_ddp_over_pair_{entry}"] = _spread(
                    [d["no_wait_tokens_per_s"] / q["tokens_per_s"] for d, q in pairs]
                )
    result = {
        "command": " ".join(["python", *sys.argv]),
        "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, one thread per process",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "summary": summary,
        "runs": runs,
    }
    print(format_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    png = plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {png}")


def format_table(result: dict) -> str:
    lines = [
        f"{result['command']}  ({result['hardware']})",
        "",
        "| data | run | tokens/s median (min..max) | DDP / pair median (min..max) | compute ms per 1k tokens "
        "| ranks' wait, share of step | DDP / pair had no rank waited | imbalance |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for data, by_config in result["summary"].items():
        for config in CONFIGS:
            if config not in by_config:
                continue
            s, entry = by_config[config], config.split("-")[1]
            t = s["tokens_per_s"]
            ratio = by_config.get(f"ddp_over_pair_{entry}") if config.startswith("ddp") else None
            no_wait = by_config.get(f"no_wait_ddp_over_pair_{entry}") if config.startswith("ddp") else None
            imbalance = f"{s['imbalance']:.3f}" if s.get("imbalance") is not None else ""
            compute = f"{s['compute_ms_per_1k_tokens']:.0f}" if s.get("compute_ms_per_1k_tokens") is not None else ""
            wait = f"{s['wait_share']:.1%}" if s.get("wait_share") is not None else ""
            lines.append(
                f"| {data} | {config} | {t['median']:,.0f} ({t['min']:,.0f}..{t['max']:,.0f}) | {_ratio(ratio)} | "
                f"{compute} | {wait} | {_ratio(no_wait)} | {imbalance} |"
            )
    ceilings = [
        f"{data} {by_config['plan_ceiling']:.3f}"
        for data, by_config in result["summary"].items()
        if by_config.get("plan_ceiling") is not None
    ]
    if ceilings:
        lines += [
            "",
            "plan ceiling (DDP / pair at best, from the padded tokens of the slowest rank): " + ", ".join(ceilings),
        ]
    return "\n".join(lines)


def _ratio(spread: dict | None) -> str:
    return f"{spread['median']:.3f} ({spread['min']:.3f}..{spread['max']:.3f})" if spread else ""


def plot(result: dict, path: Path) -> Path:
    """Bars of median tokens/s per run and data set, the min..max of the repeats as error bars."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    datasets = list(result["summary"])
    configs = [c for c in CONFIGS if any(c in result["summary"][d] for d in datasets)]
    width = 0.8 / len(configs)
    colors = {"pair-loop": "tab:gray", "ddp-loop": "tab:blue", "pair-recipe": "silver", "ddp-recipe": "tab:orange"}
    for i, config in enumerate(configs):
        stats = [result["summary"][d].get(config, {}).get("tokens_per_s") for d in datasets]
        medians = [s["median"] if s else 0.0 for s in stats]
        errors = [[m - s["min"] if s else 0 for m, s in zip(medians, stats, strict=True)]]
        errors.append([s["max"] - m if s else 0 for m, s in zip(medians, stats, strict=True)])
        xs = [d + (i - (len(configs) - 1) / 2) * width for d in range(len(datasets))]
        bars = ax.bar(xs, medians, width, yerr=errors, capsize=3, color=colors[config], label=config)
        labels = []
        for d in datasets:
            ratio = result["summary"][d].get(f"ddp_over_pair_{config.split('-')[1]}")
            labels.append(f"{ratio['median']:.0%}" if ratio and config.startswith("ddp") else "")
        ax.bar_label(bars, labels=labels, padding=3)
    ax.set_xticks(range(len(datasets)), [f"data: {d}" for d in datasets])
    ax.set(ylabel="tokens/s (median over repeats)", title="2-rank DDP against two independent processes (the limit)")
    ax.legend(ncols=2)
    ax.margins(y=0.15)
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    main()
