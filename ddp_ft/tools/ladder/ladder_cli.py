"""The DDP ladder, measured: from a naive all-reduce to BucketedDDP, on two workloads, in one run.

    ddp-ft ladder --nproc 2 --out bench_results/ladder.json
    torchrun --standalone --nproc_per_node=2 -m ddp_ft.tools.ladder.ladder_cli --out bench_results/ladder.json   # the same
    torchrun --standalone --nproc_per_node=2 scripts/ladder.py --out bench_results/ladder.json            # the same

Every rung of ``ddp_ft.tools.ladder.rungs`` wraps a fresh copy of the same model and trains on the same batches with the
same loop (gradient accumulation: all micro-steps but the last under ``no_sync``). After a warm-up the rungs' weights
are compared (they must have trained alike), then they are measured interleaved: ``--repeats`` rounds, each running
every rung for ``--steps`` optimizer steps, the order rotating every round. Per rung it prints the reference
write-up's columns (compute %, non-compute %, idle %, overlap %, all-reduce calls and ms per optimizer step) with
bytes, exposed communication and tokens/s (median and min..max of the repeats), as a markdown table, and writes JSON,
the table (``.md``) and a PNG beside ``--out``. How each column is measured on CPU/gloo and on CUDA/NCCL:
``ddp_ft/tools/ladder/timeline.py`` and ``docs/performance.md``. On a CUDA host with 2+ GPUs it runs with NCCL
unchanged.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

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
    max_parameter_difference,
    run_each_workload,
    token_batches,
)
from .report import ladder_table, plot_ladder, workload_heading, write_results
from .rungs import RUNGS, build_rung
from .timeline import Timeline


def build_parser(parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None) -> argparse.ArgumentParser:
    """Its flags; ``parents`` (built with ``add_help=False``) add a caller's."""
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, parents=list(parents)
    )
    p.add_argument("--rungs", nargs="+", choices=list(RUNGS), default=list(RUNGS), help="which rungs, in ladder order")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="bucket cap of the bucketed rungs (MiB)")
    p.add_argument("--first-bucket-cap-mb", type=float, default=1.0, help="their first bucket's cap (MiB)")
    add_run_arguments(p, Path("bench_results/ladder.json"))
    return p


def parse_args(
    argv: list[str] | None = None, parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None
) -> argparse.Namespace:
    """Parse and check the flags; an error names the flag."""
    p = build_parser(parents, prog)
    args = p.parse_args(argv)
    check_run_arguments(p, args)
    if args.warmup < 2 and "torch_ddp" in args.rungs:
        p.error("--warmup must be at least 2 with the torch_ddp rung (it rebuilds its buckets after its first step)")
    if not (args.bucket_cap_mb > 0 and args.first_bucket_cap_mb > 0):
        p.error("--bucket-cap-mb and --first-bucket-cap-mb must be positive")
    return args


def run_workload(args, setup, workload: str, model_dir: str) -> dict:
    """Build every rung on ``workload``, warm up, check they agree, measure them interleaved; rank 0 gets rows."""
    caps = {"bucket_cap_mb": args.bucket_cap_mb, "first_bucket_cap_mb": args.first_bucket_cap_mb}
    trainees = []
    for name in args.rungs:
        timeline = Timeline()
        model = build_rung(name, load_workload(workload, model_dir, setup), timeline, **caps)
        trainees.append(Trainee.of(name, model, timeline))
    stepper = Stepper(setup, token_batches(setup, args.vocab_size, args.seq_len, args.micro_batch), args.grad_accum)
    for trainee in trainees:
        stepper.cursor = 0  # every rung warms up on the same batches, so their weights can be compared
        for _ in range(args.warmup):
            stepper.step(trainee)
    agreement = max_parameter_difference(trainees, reference=args.rungs[-1])

    def progress(done: int) -> None:
        if setup.info.is_main_process:
            print(f"  {workload}: round {done}/{args.repeats}", file=sys.stderr, flush=True)

    interleave(stepper, trainees, args.repeats, args.steps, progress)
    tokens = setup.info.world_size * args.micro_batch * args.seq_len * args.grad_accum
    rows = gathered_rows(trainees, tokens)
    trainable = sum(p.numel() * p.element_size() for p in trainees[0].model.parameters() if p.requires_grad)
    return {
        "description": WORKLOADS[workload],
        "trainable_mib": trainable / 2**20,
        "max_parameter_difference_after_warmup": agreement,
        "rungs": rows,
    }


def write(args, setup, results: dict) -> None:
    tables = []
    for workload, result in results.items():
        worst = max(result["max_parameter_difference_after_warmup"].values())
        tables.append(
            f"{workload_heading(workload, result)}\n\n{ladder_table(result['rungs'])}\n\nAfter {args.warmup} warm-up "
            f"steps every rung's weights are within {worst:.1e} of {RUNGS[args.rungs[-1]].title}'s."
        )
    write_results(args, setup, results, "DDP ladder", tables, plot_ladder)


def run(argv: list[str] | None = None) -> None:
    """Measure every rung on each workload and write the results (rank 0)."""
    run_each_workload(parse_args(argv), run_workload, write)


def main(argv: list[str] | None = None) -> NoReturn:
    """Run, then leave without interpreter finalization (``exit_without_finalization``)."""
    keep_upstream_notices_to_rank_zero()
    run(argv)
    exit_without_finalization()


if __name__ == "__main__":
    main()
