"""The end-to-end benchmark's configurations and how one is run and read.

A configuration is one launch (``ddp``: 2 ranks) or two single processes started together (``pair``) of an entry
point (``loop``: ``scripts/train.py``; ``recipe``: ``recipes/qwen_ami.py`` under ``accelerate launch``; ``dpo``:
``ddp_ft.tools.bench_e2e.dpo``, preference pairs of the same meetings, under ``accelerate launch``) with its own
flags. Every run is the tiny preset (effective batch 8, micro-batch 2), one thread per process, no wandb, no
checkpoint; data ``tiny`` is the preset's own meetings (every sample fills 256 tokens), ``mixed`` meetings of 60 to
256 tokens.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ...report.comparison import load_run

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
BASE = "@base"  # suffix of a configuration run from the --baseline checkout


@dataclass(frozen=True)
class Config:
    """One configuration: ``kind`` ``pair`` or ``ddp``, ``entry`` ``loop`` or ``recipe``, the entry's own flags,
    and whether it is a stock peer (no ddp_ft class in its training path)."""

    name: str
    kind: str
    entry: str
    flags: tuple[str, ...] = ()
    stock: bool = False
    about: str = ""


_STRIDED = ("--no-balance-ranks",)
CONFIGS = {
    c.name: c
    for c in (
        Config("pair-loop", "pair", "loop", about="two scripts/train.py at once (the limit)"),
        Config("ddp-loop", "ddp", "loop", about="torchrun scripts/train.py, BucketedDDP"),
        Config("pair-recipe", "pair", "recipe", about="two single-process recipes at once (the limit)"),
        Config("ddp-recipe", "ddp", "recipe", about="BucketedTrainer, the balanced plan (ddp_ft's default)"),
        Config("ddp-recipe-strided", "ddp", "recipe", _STRIDED, about="BucketedTrainer in the stock Trainer's order"),
        Config(
            "stock-recipe",
            "ddp",
            "recipe",
            ("--trainer", "stock-hf", *_STRIDED),
            stock=True,
            about="transformers' Trainer, torch DDP, find_unused_parameters as the Trainer sets it (True)",
        ),
        Config(
            "stock-recipe-unused-off",
            "ddp",
            "recipe",
            ("--trainer", "stock-hf", "--stock-find-unused", "false", *_STRIDED),
            stock=True,
            about="transformers' Trainer, torch DDP, find_unused_parameters=False",
        ),
        Config("ddp-trl", "ddp", "recipe", ("--trainer", "trl"), about="BucketedSFTTrainer, the balanced plan"),
        Config(
            "stock-trl",
            "ddp",
            "recipe",
            ("--trainer", "stock-trl", *_STRIDED),
            stock=True,
            about="TRL's SFTTrainer, torch DDP, find_unused_parameters as the Trainer sets it (True)",
        ),
        Config("ddp-dpo", "ddp", "dpo", about="BucketedDPOTrainer, the balanced plan on chosen plus rejected widths"),
        Config("ddp-dpo-strided", "ddp", "dpo", _STRIDED, about="BucketedDPOTrainer in the stock DPOTrainer's order"),
        Config(
            "stock-dpo",
            "ddp",
            "dpo",
            ("--trainer", "stock", *_STRIDED),
            stock=True,
            about="TRL's DPOTrainer, torch DDP, find_unused_parameters as the Trainer sets it (True)",
        ),
    )
}
DEFAULT_CONFIGS = ("pair-recipe", "ddp-recipe", "ddp-recipe-strided", "stock-recipe", "stock-recipe-unused-off")
DEFAULT_CONFIGS += ("ddp-trl", "stock-trl", "ddp-dpo", "ddp-dpo-strided", "stock-dpo")


def config_of(name: str) -> Config:
    """The configuration of ``name``, ``@base`` suffix removed."""
    return CONFIGS[name.removesuffix(BASE)]


def command(name: str, out: Path, source: str | None, max_steps: int, root: Path = ROOT) -> list[list[str]]:
    """The command lines of one configuration (two for a pair, started together), from the checkout ``root``."""
    config = config_of(name)
    flags = ["--preset", "tiny", "--report-to", "none", "--max-steps", str(max_steps), "--save-every", "0"]
    flags += ["--source", source] if source else []
    flags += list(config.flags)
    script = str(root / ("scripts/train.py" if config.entry == "loop" else "recipes/qwen_ami.py"))
    if config.entry == "dpo":
        script, flags = "-m", ["ddp_ft.tools.bench_e2e.dpo", *flags]
    if config.kind == "pair":
        launch = [sys.executable]
        if config.entry == "recipe":
            launch = [str(BIN / "accelerate"), "launch", "--config_file", str(root / "accelerate_configs/single.yaml")]
        return [[*launch, script, *flags, "--output-dir", str(out / f"alone{i}")] for i in range(2)]
    if config.entry == "loop":
        launch = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2"]
    else:
        launch = [str(BIN / "accelerate"), "launch", "--config_file", str(root / "accelerate_configs/2cpu_gloo.yaml")]
    return [[*launch, script, *flags, "--output-dir", str(out / "ddp")]]


def run_config(name: str, out: Path, source: str | None, max_steps: int, baseline: Path | None = None) -> dict:
    """Run one configuration; its tokens/s (a pair: the sum), per-run medians, balance, losses and wall seconds. A
    ``...@base`` configuration runs from the ``baseline`` checkout (its code first on the path)."""
    root = baseline if name.endswith(BASE) else ROOT
    if root is None:
        raise ValueError(f"{name} runs from the baseline checkout: pass baseline")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p),
    }
    started = time.perf_counter()
    logs = [open(out / f"{name}-{i}.log", "w") for i in range(2)]  # noqa: SIM115  (closed below)
    try:
        processes = [
            subprocess.Popen(c, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT)
            for c, log in zip(command(name, out, source, max_steps, root), logs, strict=False)
        ]
        codes = [p.wait(timeout=900) for p in processes]
    finally:
        for log in logs:
            log.close()
    wall = time.perf_counter() - started
    if any(codes):
        tail = (out / f"{name}-0.log").read_text()[-3000:]
        raise RuntimeError(f"{name} failed (exit codes {codes}); log {out}:\n{tail}")
    ddp = config_of(name).kind == "ddp"
    return read_runs([out / "ddp"] if ddp else [out / "alone0", out / "alone1"], ddp) | {"wall_s": wall}


def read_runs(folders: list[Path], ddp: bool) -> dict:
    """One configuration's result from its run folders (one for DDP, two for a pair)."""
    loaded = [load_run(f) for f in folders]
    summaries = [summary for summary, _ in loaded]
    parts = [step_parts(records) for _, records in loaded]
    walls = [wall_tokens_per_s(records) for _, records in loaded]
    trains = [r for r in loaded[0][1] if r.get("type") == "train"]
    evals = [r["eval_loss"] for r in loaded[0][1] if r.get("type") == "eval" and r.get("eval_loss") is not None]
    return {
        "tokens_per_s": sum(s.tokens_per_s for s in summaries),
        "tokens_per_s_each": [s.tokens_per_s for s in summaries],
        "wall_tokens_per_s": sum(walls) if None not in walls else None,
        "step_time_s": statistics.median(s.step_time_s for s in summaries),
        "imbalance": summaries[0].imbalance if ddp else None,
        "wait_for_slowest_ms": summaries[0].wait_for_slowest_ms if ddp else None,
        "exposed_comm_ms": summaries[0].exposed_comm_ms,
        # where a step's time goes (medians over the steps after the first; a pair: the mean of its two runs)
        "compute_ms_per_1k_tokens": _mean_or_none(x["compute_ms_per_1k_tokens"] for x in parts),
        "wait_share": _mean_or_none(x["wait_share"] for x in parts),
        "no_wait_tokens_per_s": _sum_or_none(x["no_wait_tokens_per_s"] for x in parts),
        # the training itself (the first run of a pair): per-step loss and the final evaluation
        "losses": [r["loss"] for r in trains],
        "eval_loss": evals[-1] if evals else None,
    }


def _mean_or_none(values) -> float | None:
    values = list(values)
    return None if None in values else statistics.mean(values)


def _sum_or_none(values) -> float | None:
    values = list(values)
    return None if None in values else sum(values)


def step_parts(records: list[dict]) -> dict[str, float | None]:
    """A run's step split into compute and waiting, from its train records (the first step left out).

    - ``compute_ms_per_1k_tokens``: the ranks' mean compute (forward and backward up to the last gradient) per 1,000
      of a rank's tokens: how fast each process computes, whatever it then waits for;
    - ``wait_share``: the share of the step the ranks wait, on average, for the slowest one (its compute minus the
      mean; 0 on one process);
    - ``no_wait_tokens_per_s``: tokens/s had no rank waited (the step less that mean wait): what the rest of the
      step (communication, optimizer, logging) allows.

    Two ranks' mean is the mean of the slowest and the fastest (``compute_max_ms``, ``compute_min_ms``); the
    benchmark runs 2 ranks or 1. A stock trainer measures no compute: all three are None.
    """
    world = next(int(r["world_size"]) for r in records if r.get("type") == "config")
    if world > 2:
        raise ValueError(f"step_parts reads 1 or 2 ranks (max and min give the mean), got world size {world}")
    trains = [r for r in records if r.get("type") == "train"]
    steps = trains[1:] or trains
    if any(r.get("compute_max_ms") is None for r in steps):
        return {"compute_ms_per_1k_tokens": None, "wait_share": None, "no_wait_tokens_per_s": None}
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


def wall_tokens_per_s(records: list[dict]) -> float | None:
    """Tokens of the steps after the first over the wall seconds from the first step's end to the last's
    (``elapsed_s``): everything between steps counts, the Trainer's own collectives before a step, logging and data
    loading included. None without ``elapsed_s`` (an older run) or with under 2 steps."""
    trains = [r for r in records if r.get("type") == "train"]
    if len(trains) < 2 or any(r.get("elapsed_s") is None for r in trains):
        return None
    seconds = trains[-1]["elapsed_s"] - trains[0]["elapsed_s"]
    return sum(r["tokens"] for r in trains[1:]) / seconds if seconds > 0 else None


def plan_ceiling(source: str | None, max_steps: int, workdir: Path) -> float:
    """DDP / pair at best on this data, from the balanced plan alone: the median, over the run's steps after the
    first, of the ranks' mean padded tokens over the most loaded rank's (the plan's cost model, micro-batch size
    times longest sample). A DDP step lasts as long as its slowest rank; the pair's processes each train all of a
    step's micro-batches, so their share per rank is the mean. 1.0 when every sample has the same length."""
    from ...distributed import DistInfo
    from ...training.config import parse_settings
    from ...training.data import EpochLoader
    from ...training.data.balance import rank_costs
    from ...training.setup import prepare_run

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
