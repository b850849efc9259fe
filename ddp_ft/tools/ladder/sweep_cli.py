"""Bucket sizing, measured: BucketedDDP under many ``bucket_cap_mb`` / ``first_bucket_cap_mb`` settings, one run.

    ddp-ft bucket-sweep --nproc 2 --out bench_results/bucket_sweep.json
    torchrun --standalone --nproc_per_node=2 -m ddp_ft.tools.ladder.sweep_cli --out bench_results/bucket_sweep.json  # same
    torchrun --standalone --nproc_per_node=2 scripts/bucket_sweep.py --out bench_results/bucket_sweep.json    # same

The trade-off: small buckets start communicating early in backward and hide more of it, but each is a separate
collective with its own latency and launch cost; large buckets send fewer, bigger messages that start late. Two
series per workload: one cap for every bucket (``first_bucket_cap_mb`` = ``bucket_cap_mb``), swept from 1/64 of the
gradient bytes to all of them, so the number of buckets goes from one per tensor to one; and the first bucket's cap
alone, the others at torch's 25 MiB. Plus torch DDP's defaults (25 MiB, first 1 MiB), and ``--caps`` / ``--firsts``
for other grids (e.g. ``--caps 1 5 25 100 500`` on a large model, the reference write-up's range), and
``bucket_cap_mb="auto"``, measured once its trial has chosen (its row shows the caps it kept). A setting that
gives the same bucket layout as one before it is measured once. Every setting trains a fresh copy of the same model
on the same batches; they are measured interleaved (``--repeats`` rounds, the order rotating). Per setting: buckets, all-reduce ms, exposed ms, overlap %, step ms and tokens/s (median and
min..max of the repeats), as a markdown table, JSON, and a PNG of buckets against exposed communication and step time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

import torch

from ...ddp import ParamSpec, compute_bucket_assignment
from ...ddp.autotune import AUTO
from ...distributed import keep_upstream_notices_to_rank_zero
from ..bench import exit_without_finalization
from .measure import (
    WORKLOADS,
    Stepper,
    Trainee,
    add_run_arguments,
    check_run_arguments,
    gathered_rows,
    interleave,
    load_workload,
    run_each_workload,
    token_batches,
)
from .report import plot_sweep, sweep_table, workload_heading, write_results
from .rungs import Bucketed
from .timeline import Timeline

DEFAULT = (25.0, 1.0)  # torch DDP's (and BucketedDDP's) bucket_cap_mb, first_bucket_cap_mb
SHARES = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1)  # of the gradient bytes: the default cap grid
FIRST_SHARES = (1 / 64, 1 / 8, 1)
MAX_TRIAL_STEPS = 64  # bucket_cap_mb="auto" decides within 1 + 3 x 5 synced steps


def build_parser(parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None) -> argparse.ArgumentParser:
    """Its flags; ``parents`` (built with ``add_help=False``) add a caller's."""
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, parents=list(parents)
    )
    p.add_argument("--caps", type=float, nargs="+", help="bucket_cap_mb values, first bucket alike (default: shares)")
    p.add_argument("--firsts", type=float, nargs="+", help="first_bucket_cap_mb values with a 25 MiB cap")
    p.add_argument("--no-auto", action="store_true", help='leave out bucket_cap_mb="auto" (measured after its trial)')
    add_run_arguments(p, Path("bench_results/bucket_sweep.json"))
    return p


def parse_args(
    argv: list[str] | None = None, parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None
) -> argparse.Namespace:
    """Parse and check the flags; an error names the flag."""
    p = build_parser(parents, prog)
    args = p.parse_args(argv)
    check_run_arguments(p, args)
    for name in ("caps", "firsts"):
        if any(not v > 0 for v in getattr(args, name) or ()):
            p.error(f"--{name}: every value must be a positive number of MiB")
    return args


def settings_for(args: argparse.Namespace, module: torch.nn.Module) -> list[tuple[str, float, float]]:
    """(series, bucket_cap_mb, first_bucket_cap_mb) to measure: one per distinct bucket layout, the first asked."""
    specs = [ParamSpec.of(name, p) for name, p in module.named_parameters() if p.requires_grad]
    gradient_mib = sum(spec.nbytes for spec in specs) / 2**20
    caps = args.caps or [round_mib(gradient_mib * share) for share in SHARES]
    firsts = args.firsts or [round_mib(gradient_mib * share) for share in FIRST_SHARES]
    found = [("default", *DEFAULT)]
    found += [("cap", cap, cap) for cap in caps]
    found += [("first", DEFAULT[0], first) for first in firsts]
    layouts, unique = set(), []
    for series, cap, first in found:
        layout = tuple(b.param_indices for b in compute_bucket_assignment(specs, cap, first))
        if layout not in layouts:
            layouts.add(layout)
            unique.append((series, cap, first))
    return unique


def describe(trainee: Trainee, setting: tuple[str, float | str, float]) -> dict:
    """A setting's caps and the buckets they made; for ``auto``, the caps it kept and its trial."""
    ddp = trainee.model.module
    series, cap, first_cap = setting
    row = {"series": series, "bucket_cap_mb": cap, "first_bucket_cap_mb": first_cap}
    choice = ddp.bucket_choice
    if choice is not None:
        row |= {"bucket_cap_mb": choice.bucket_cap_mb, "first_bucket_cap_mb": choice.first_bucket_cap_mb}
        row["auto_trial"] = {"candidates": [asdict(c) for c in choice.candidates], "medians_ms": choice.medians_ms}
    sizes = ddp.bucket_nbytes
    return row | {"buckets": len(sizes), "bucket_mib": [round(b / 2**20, 4) for b in sizes]}


def round_mib(value: float) -> float:
    """Three significant digits: settings a user can type back."""
    return float(f"{value:.3g}")


def run_workload(args, setup, workload: str, model_dir: str) -> dict:
    first = load_workload(workload, model_dir, setup)
    gradient_mib = sum(p.numel() * p.element_size() for p in first.parameters() if p.requires_grad) / 2**20
    settings = settings_for(args, first)
    if not args.no_auto:
        settings.append(("auto", AUTO, DEFAULT[1]))
    trainees = []
    for i, (series, cap, first_cap) in enumerate(settings):
        timeline = Timeline()
        module = first if i == 0 else load_workload(workload, model_dir, setup)
        model = Bucketed(module, timeline, bucket_cap_mb=cap, first_bucket_cap_mb=first_cap)
        label = (
            f"{series}: cap {cap} / first {first_cap:g}"
            if series == "auto"
            else f"{series}: cap {cap:g} / first {first_cap:g}"
        )
        trainees.append(Trainee.of(label, model, timeline))
    stepper = Stepper(setup, token_batches(setup, args.vocab_size, args.seq_len, args.micro_batch), args.grad_accum)
    for trainee, (_, cap, _) in zip(trainees, settings, strict=True):
        for _ in range(args.warmup):
            stepper.step(trainee)
        for _ in range(MAX_TRIAL_STEPS if cap == AUTO else 0):  # "auto" is measured after its trial has chosen
            if trainee.model.module.bucket_choice is not None:
                break
            stepper.step(trainee)
    described = {t.name: describe(t, settings[i]) for i, t in enumerate(trainees)}

    def progress(done: int) -> None:
        if setup.info.is_main_process:
            print(f"  {workload}: round {done}/{args.repeats}", file=sys.stderr, flush=True)

    interleave(stepper, trainees, args.repeats, args.steps, progress)
    tokens = setup.info.world_size * args.micro_batch * args.seq_len * args.grad_accum
    rows = gathered_rows(trainees, tokens)
    rows = {label: described[label] | row for label, row in rows.items()}
    default = next(row for row in rows.values() if row["series"] == "default")["tokens_per_s_all_repeats"]
    for row in rows.values():  # each repeat ran every setting back to back: the paired ratio cancels slow drift
        paired = [a / d for a, d in zip(row["tokens_per_s_all_repeats"], default, strict=True)]
        row["vs_default_paired"] = {"median": statistics.median(paired), "range": [min(paired), max(paired)]}
    return {"description": WORKLOADS[workload], "trainable_mib": gradient_mib, "settings": rows}


def write(args, setup, results: dict) -> None:
    tables = [f"{workload_heading(w, r)}\n\n{sweep_table(r['settings'])}" for w, r in results.items()]
    write_results(args, setup, results, "Bucket sweep", tables, plot_sweep)


def run(argv: list[str] | None = None) -> None:
    """Measure every setting on each workload and write the results (rank 0)."""
    run_each_workload(parse_args(argv), run_workload, write)


def main(argv: list[str] | None = None) -> NoReturn:
    """Run, then leave without interpreter finalization (``exit_without_finalization``)."""
    keep_upstream_notices_to_rank_zero()
    run(argv)
    exit_without_finalization()


if __name__ == "__main__":
    main()
