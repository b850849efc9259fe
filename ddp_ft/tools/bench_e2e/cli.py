"""End to end: ddp_ft against what a user would run instead, and 2-rank DDP against its limit.

    python scripts/bench_e2e.py --repeats 5 --out bench_results/bench_e2e.json     # make bench-e2e

Each repeat runs every configuration (``ddp_ft.tools.bench_e2e.runs.CONFIGS``), in an order that rotates every
repeat, on each data set (``tiny``: every sample fills 256 tokens; ``mixed``: meetings of 60 to 256 tokens). Every ratio
is taken within a repeat; the table gives its median and range over the repeats.

- **Against the stock trainers** (the default set): the recipe with ``BucketedTrainer`` (``ddp-recipe``) against the
  same recipe on transformers' own ``Trainer`` with torch DDP, with the Trainer's ``find_unused_parameters`` (True
  for a PeftModel: ``stock-recipe``) and with False (``stock-recipe-unused-off``); ``BucketedSFTTrainer``
  (``ddp-trl``) against TRL's ``SFTTrainer`` (``stock-trl``); ``BucketedDPOTrainer`` (``ddp-dpo``, and in the stock
  order ``ddp-dpo-strided``) against TRL's ``DPOTrainer`` (``stock-dpo``) on preference pairs of the same meetings. Tokens/s step-timed (the median step, as
  ``scripts/compare.py``) and wall (every second from the first step's end to the last's). The chain
  ``stock-recipe`` -> ``stock-recipe-unused-off`` -> ``ddp-recipe-strided`` (BucketedTrainer in the stock order) ->
  ``ddp-recipe`` says which change gives what. The loss check says the runs are the same training.
- **Against the limit** (``--configs pair-loop ddp-loop pair-recipe ddp-recipe``): two independent single
  processes started together are what two devices do with no communication at all; DDP / pair, over the plan ceiling
  (``--plan-ceiling`` alone prints it: DDP / pair at best on the data), and had no rank waited.

``--pool FILE ...`` pools the DDP / pair repeats of earlier runs. ``--baseline DIR`` (a checkout of other code, e.g.
``git worktree add /tmp/base HEAD~1``) also runs each ddp_ft DDP configuration from ``DIR`` in the same rotation and
adds this checkout's DDP over the baseline's, paired within each repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from ...training.data.synthetic import write_mixed_length_meetings
from .runs import BASE, CONFIGS, DEFAULT_CONFIGS, ROOT, plan_ceiling, run_config
from .summary import pool, summarize
from .table import format_pool, format_table, plot

BASELINE_CONFIGS = [name for name, c in CONFIGS.items() if c.kind == "ddp" and not c.stock]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_e2e.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=3, help="alternations of the configurations (>= 3 for a median)")
    p.add_argument("--data", nargs="+", choices=["tiny", "mixed"], default=["tiny", "mixed"], help="data sets")
    p.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        default=list(DEFAULT_CONFIGS),
        help="the runs (default: ddp_ft against the stock trainers, with pair-recipe): "
        + "; ".join(f"{n}: {c.about}" for n, c in CONFIGS.items()),
    )
    p.add_argument("--max-steps", type=int, default=16, help="optimizer steps per run (the tiny preset's 16)")
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_e2e.json"), help="JSON; the PNG goes beside")
    p.add_argument("--plan-ceiling", action="store_true", help="only print each data set's plan ceiling (no runs)")
    p.add_argument("--baseline", type=Path, help="a checkout of other code: its DDP runs alternate with this one's")
    p.add_argument("--pool", type=Path, nargs="+", help="only pool the repeats of these earlier runs' JSON (no runs)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
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
        if args.plan_ceiling or not set(args.configs) & set(BASELINE_CONFIGS):
            p.error(
                f"--baseline runs the baseline's DDP configurations: give --configs at least one of "
                f"{', '.join(BASELINE_CONFIGS)}, and leave out --plan-ceiling (it runs nothing)"
            )
        configs += [c + BASE for c in args.configs if c in BASELINE_CONFIGS]
    result = _measure(args, configs)
    if result is None:
        return
    print(format_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    png = plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {png}")


def _measure(args: argparse.Namespace, configs: list[str]) -> dict | None:
    """Every repeat of every configuration on every data set; None after --plan-ceiling (nothing run)."""
    runs: dict[str, dict[str, list[dict]]] = {d: {c: [] for c in configs} for d in args.data}
    with tempfile.TemporaryDirectory(prefix="bench_e2e-") as tmp:
        source = {"tiny": None, "mixed": write_mixed_length_meetings(Path(tmp, "mixed.jsonl"), n=160)}
        ceiling = {d: plan_ceiling(source[d], args.max_steps, Path(tmp, f"plan-{d}")) for d in args.data}
        for data, value in ceiling.items():
            print(f"{data:5} plan ceiling (DDP / pair at best, from padded tokens per rank): {value:.3f}", flush=True)
        if args.plan_ceiling:
            return None
        for repeat in range(args.repeats):
            for data in args.data:
                shift = repeat % len(configs)
                for config in configs[shift:] + configs[:shift]:
                    out = Path(tmp, f"{data}-{config}-{repeat}")
                    out.mkdir()
                    result = run_config(config, out, source[data], args.max_steps, args.baseline)
                    runs[data][config].append(result)
                    print(
                        f"repeat {repeat + 1}/{args.repeats} {data:5} {config:24} {result['tokens_per_s']:8,.0f} "
                        f"tokens/s ({result['wall_s']:.0f} s)",
                        flush=True,
                    )
    return {
        "command": " ".join(["python", "scripts/bench_e2e.py", *sys.argv[1:]]),
        "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, one thread per process",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "commit": _commit(ROOT),
        "baseline_commit": _commit(args.baseline) if args.baseline else None,
        "summary": summarize(runs, ceiling),
        "runs": runs,
    }


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


if __name__ == "__main__":
    main()
