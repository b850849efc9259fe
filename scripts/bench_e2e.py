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
samples cannot always be split evenly over the ranks, and with micro-batches of 2 or more no split pads the slowest
rank to fewer tokens than the balanced plan (``tests/test_balance.py`` checks it against every split of random
steps). DDP / pair over the ceiling is then what communication, lockstep and the rest of the step cost.

Runs of the same code pool (``--pool FILE ...``, no runs): every repeat's DDP / pair per data set and entry point,
with how many repeats reach the target. On a shared host one run's median moves by more than the target's margin.

A change measured against the code before it (``--baseline DIR``, a checkout of that code, e.g. ``git worktree add
/tmp/base HEAD~1``): each DDP configuration also runs from ``DIR`` (``ddp-loop@base``, ``ddp-recipe@base``) in the
same rotation, with this environment's packages, and the table adds this checkout's DDP over the baseline's, paired
within each repeat. On a shared machine whose speed drifts by more than the change, that paired ratio is the only
fair comparison.
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
BASE = "@base"  # suffix of a configuration run from the --baseline checkout


def _parts(config: str) -> tuple[str, str, bool]:
    """``ddp-recipe@base`` -> ("ddp", "recipe", True)."""
    kind, entry = config.removesuffix(BASE).split("-")
    return kind, entry, config.endswith(BASE)


def _command(config: str, out: Path, source: str | None, max_steps: int, root: Path = ROOT) -> list[list[str]]:
    """The command lines of one configuration (two for a pair, started together), from the checkout ``root``."""
    kind, entry, _ = _parts(config)
    flags = ["--preset", "tiny", "--report-to", "none", "--max-steps", str(max_steps)]
    flags += ["--source", source] if source else []
    script = str(root / ("scripts/train.py" if entry == "loop" else "recipes/qwen_ami.py"))
    if kind == "pair":
        if entry == "loop":
            return [[sys.executable, script, *flags, "--output-dir", str(out / f"alone{i}")] for i in range(2)]
        launch = [str(BIN / "accelerate"), "launch", "--config_file", str(root / "accelerate_configs/single.yaml")]
        return [[*launch, script, *flags, "--output-dir", str(out / f"alone{i}")] for i in range(2)]
    if entry == "loop":
        launch = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2"]
    else:
        launch = [str(BIN / "accelerate"), "launch", "--config_file", str(root / "accelerate_configs/2cpu_gloo.yaml")]
    return [[*launch, script, *flags, "--output-dir", str(out / "ddp")]]


def run_config(config: str, out: Path, source: str | None, max_steps: int, baseline: Path | None = None) -> dict:
    """Run one configuration; its tokens/s (a pair: the sum), per-run medians, balance and wall seconds. A
    ``...@base`` configuration runs from the ``baseline`` checkout (its code first on the path)."""
    root = baseline if _parts(config)[2] else ROOT
    if root is None:
        raise ValueError(f"{config} runs from the baseline checkout: pass baseline")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p),
    }
    started = time.perf_counter()
    logs = [open(out / f"{config}-{i}.log", "w") for i in range(2)]  # noqa: SIM115  (closed below)
    try:
        processes = [
            subprocess.Popen(c, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT)
            for c, log in zip(_command(config, out, source, max_steps, root), logs, strict=False)
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


TARGET = 0.95  # issue 13: 2-rank DDP at >= 0.95 of the independent pair


def pool(results: list[dict]) -> dict[str, dict[str, dict]]:
    """Every repeat's DDP / pair of several runs of this benchmark, per data set and entry point (``ddp-loop``,
    ``ddp-recipe``; not the ``@base`` runs): ``{data: {entry: {"runs", "repeats", "ratio", "at_target",
    "over_ceiling"}}}``. One run's median moves with the host by more than the 5% the target leaves; the pooled
    repeats of runs on the same code say where it sits. ``over_ceiling`` only from runs that recorded the plan ceiling.

    Raises:
        ValueError: runs of different lengths (``--max-steps``), which are not the same measurement.
    """
    steps = {r["settings"]["max_steps"] for r in results}
    if len(steps) > 1:
        raise ValueError(f"runs of different --max-steps ({sorted(steps)}) are not the same measurement: pool one")
    pooled: dict[str, dict[str, dict]] = {}
    for result in results:
        for data, by_key in result["summary"].items():
            ceiling = by_key.get("plan_ceiling")
            for entry in ENTRIES:
                ratios = by_key.get(f"ddp_over_pair_{entry}", {}).get("all", [])
                if not ratios:
                    continue
                slot = pooled.setdefault(data, {}).setdefault(entry, {"runs": 0, "all": [], "over_ceiling": []})
                slot["runs"] += 1
                slot["all"] += ratios
                slot["over_ceiling"] += [r / ceiling for r in ratios] if ceiling else []
    for by_entry in pooled.values():
        for slot in by_entry.values():
            ratios, over = slot.pop("all"), slot["over_ceiling"]
            slot.update(
                repeats=len(ratios),
                ratio=_spread(ratios),
                at_target=sum(r >= TARGET for r in ratios),
                over_ceiling=_spread(over) if over else None,
                over_ceiling_repeats=len(over),
            )
    return pooled


def format_pool(pooled: dict[str, dict[str, dict]], files: list[str]) -> str:
    lines = [
        f"DDP / pair, every repeat of {len(files)} runs: " + ", ".join(files),
        "",
        f"| data | run | runs | repeats | DDP / pair median (min..max) | repeats at >= {TARGET} "
        "| over the plan ceiling (repeats with one) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for data, by_entry in pooled.items():
        for entry, s in by_entry.items():
            lines.append(
                f"| {data} | ddp-{entry} | {s['runs']} | {s['repeats']} | {_ratio(s['ratio'])} | "
                f"{s['at_target']} of {s['repeats']} | {_ratio(s['over_ceiling'])} ({s['over_ceiling_repeats']}) |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="alternations of the configurations (>= 3 for a median)")
    p.add_argument("--data", nargs="+", choices=["tiny", "mixed"], default=["tiny", "mixed"], help="data sets")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="a subset of the runs")
    p.add_argument("--max-steps", type=int, default=16, help="optimizer steps per run (the tiny preset's 16)")
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_e2e.json"), help="JSON; the PNG goes beside")
    p.add_argument("--plan-ceiling", action="store_true", help="only print each data set's plan ceiling (no runs)")
    p.add_argument("--baseline", type=Path, help="a checkout of other code: its DDP runs alternate with this one's")
    p.add_argument("--pool", type=Path, nargs="+", help="only pool the repeats of these earlier runs' JSON (no runs)")
    args = p.parse_args()
    if args.pool:
        if args.baseline is not None or args.plan_ceiling:
            p.error("--pool only reads earlier runs: leave out --baseline and --plan-ceiling")
        _refuse_unused(p, args, "--pool", ["repeats", "data", "configs", "max_steps", "out"])
        try:
            pooled = pool([json.loads(path.read_text()) for path in args.pool])
        except (OSError, ValueError, KeyError) as exc:
            p.error(f"--pool: {exc}")
        print(format_pool(pooled, [path.name for path in args.pool]))
        return
    if args.plan_ceiling:
        _refuse_unused(p, args, "--plan-ceiling", ["repeats", "configs", "out"])
    configs = list(args.configs)
    if args.baseline is not None:
        args.baseline = args.baseline.resolve()
        if not (args.baseline / "scripts" / "train.py").is_file() or args.baseline == ROOT:
            p.error(f"--baseline {args.baseline}: not another ddp_ft checkout (e.g. git worktree add /tmp/base HEAD~1)")
        if args.plan_ceiling or not any(c.startswith("ddp") for c in args.configs):
            p.error(
                "--baseline runs the baseline's DDP configurations: give --configs at least one of ddp-loop, "
                "ddp-recipe, and leave out --plan-ceiling (it runs nothing)"
            )
        configs += [c + BASE for c in args.configs if c.startswith("ddp")]

    runs: dict[str, dict[str, list[dict]]] = {d: {c: [] for c in configs} for d in args.data}
    with tempfile.TemporaryDirectory(prefix="bench_e2e-") as tmp:
        source = {"tiny": None, "mixed": write_mixed_length_meetings(Path(tmp, "mixed.jsonl"), n=160)}
        ceiling = {d: plan_ceiling(source[d], args.max_steps, Path(tmp, f"plan-{d}")) for d in args.data}
        for data, value in ceiling.items():
            print(f"{data:5} plan ceiling (DDP / pair at best, from padded tokens per rank): {value:.3f}", flush=True)
        if args.plan_ceiling:
            return
        for repeat in range(args.repeats):
            for data in args.data:
                shift = repeat % len(configs)
                for config in configs[shift:] + configs[:shift]:
                    out = Path(tmp, f"{data}-{config}-{repeat}")
                    out.mkdir()
                    result = run_config(config, out, source[data], args.max_steps, args.baseline)
                    runs[data][config].append(result)
                    print(
                        f"repeat {repeat + 1}/{args.repeats} {data:5} {config:16} {result['tokens_per_s']:8,.0f} "
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
            for suffix in ("", BASE):
                ddp, pair = by_config.get(f"ddp-{entry}{suffix}"), by_config.get(f"pair-{entry}")
                if ddp is None or pair is None:
                    continue
                pairs = list(zip(ddp, pair, strict=True))
                ratios = [d["tokens_per_s"] / q["tokens_per_s"] for d, q in pairs]
                summary[data][f"ddp_over_pair_{entry}{suffix}"] = _spread(ratios)
                # the same ratio over what the data allows: what the code and the machine take beyond the plan
                summary[data][f"ddp_over_ceiling_{entry}{suffix}"] = _spread([r / ceiling[data] for r in ratios])
                # the same ratio had no rank waited for the slower one: what communication and the rest allow
                summary[data][f"no_wait_ddp_over_pair_{entry}{suffix}"] = _spread(
                    [d["no_wait_tokens_per_s"] / q["tokens_per_s"] for d, q in pairs]
                )
            if f"ddp-{entry}{BASE}" in by_config:
                pairs = list(zip(by_config[f"ddp-{entry}"], by_config[f"ddp-{entry}{BASE}"], strict=True))
                summary[data][f"ddp_over_baseline_{entry}"] = _spread(
                    [new["tokens_per_s"] / old["tokens_per_s"] for new, old in pairs]
                )
    result = {
        "command": " ".join(["python", *sys.argv]),
        "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, one thread per process",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "commit": _commit(ROOT),
        "baseline_commit": _commit(args.baseline) if args.baseline else None,
        "summary": summary,
        "runs": runs,
    }
    print(format_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    png = plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {png}")


def _refuse_unused(p: argparse.ArgumentParser, args: argparse.Namespace, mode: str, names: list[str]) -> None:
    """Stop with an error naming the flags among ``names`` given a value other than their default: ``mode`` runs no
    benchmark and would not use them."""
    given = ["--" + n.replace("_", "-") for n in names if getattr(args, n) != p.get_default(n)]
    if given:
        p.error(f"{mode} runs no benchmark, so it would not use {', '.join(given)}: leave them out")


def _commit(root: Path) -> str | None:
    """The checkout's commit (``git rev-parse HEAD``), with ``-dirty`` when it has uncommitted changes; None outside
    git."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def _ordered(configs) -> list[str]:
    """Configurations in table order: CONFIGS, each DDP one followed by its baseline run."""
    order = [c for base in CONFIGS for c in (base, base + BASE)]
    return [c for c in order if c in configs]


def format_table(result: dict) -> str:
    lines = [
        f"{result['command']}  ({result['hardware']})",
        "",
        "| data | run | tokens/s median (min..max) | DDP / pair median (min..max) | compute ms per 1k tokens "
        "| ranks' wait, share of step | DDP / pair had no rank waited | imbalance |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for data, by_config in result["summary"].items():
        for config in _ordered(by_config):
            s, (kind, entry, base) = by_config[config], _parts(config)
            t = s["tokens_per_s"]
            suffix = BASE if base else ""
            ratio = by_config.get(f"ddp_over_pair_{entry}{suffix}") if kind == "ddp" else None
            no_wait = by_config.get(f"no_wait_ddp_over_pair_{entry}{suffix}") if kind == "ddp" else None
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
    of_ceiling = _per_entry(result, "ddp_over_ceiling")
    if of_ceiling:
        lines += ["DDP / pair over the plan ceiling (what the code and the machine cost): " + "; ".join(of_ceiling)]
    against = _per_entry(result, "ddp_over_baseline")
    if against:
        where = result.get("baseline_commit") or result.get("settings", {}).get("baseline")
        lines += ["", f"this checkout's DDP / the baseline's ({where}), paired per repeat: " + "; ".join(against)]
    return "\n".join(lines)


def _per_entry(result: dict, key: str) -> list[str]:
    """``"<data> ddp-<entry> <ratio>"`` for every data set and entry point whose summary has ``<key>_<entry>``."""
    return [
        f"{data} ddp-{entry} {_ratio(by_config[f'{key}_{entry}'])}"
        for data, by_config in result["summary"].items()
        for entry in ENTRIES
        if f"{key}_{entry}" in by_config
    ]


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
    configs = _ordered({c for d in datasets for c in result["summary"][d]})
    width = 0.8 / len(configs)
    colors = {"pair-loop": "tab:gray", "ddp-loop": "tab:blue", "pair-recipe": "silver", "ddp-recipe": "tab:orange"}
    colors |= {"ddp-loop" + BASE: "lightsteelblue", "ddp-recipe" + BASE: "navajowhite"}
    for i, config in enumerate(configs):
        stats = [result["summary"][d].get(config, {}).get("tokens_per_s") for d in datasets]
        medians = [s["median"] if s else 0.0 for s in stats]
        errors = [[m - s["min"] if s else 0 for m, s in zip(medians, stats, strict=True)]]
        errors.append([s["max"] - m if s else 0 for m, s in zip(medians, stats, strict=True)])
        xs = [d + (i - (len(configs) - 1) / 2) * width for d in range(len(datasets))]
        bars = ax.bar(xs, medians, width, yerr=errors, capsize=3, color=colors[config], label=config)
        labels = []
        for d in datasets:
            kind, entry, base = _parts(config)
            ratio = result["summary"][d].get(f"ddp_over_pair_{entry}{BASE if base else ''}")
            labels.append(f"{ratio['median']:.0%}" if ratio and kind == "ddp" else "")
        ax.bar_label(bars, labels=labels, padding=3)
    ax.set_xticks(range(len(datasets)), [f"data: {d}" for d in datasets])
    ax.set(ylabel="tokens/s (median over repeats)", title="2-rank DDP against two independent processes (the limit)")
    ax.legend(ncols=2)
    ax.margins(y=0.15)
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    main()
