"""All-reduce through the backend and through the ring (ddp_ft.tools.ladder.ring), from 4 KiB to 256 MiB.

    ddp-ft bench-comm --nproc 2 --out bench_results/bench_comm.json
    torchrun --standalone --nproc_per_node=2 -m ddp_ft.tools.ladder.bench_comm_cli --out bench_results/bench_comm.json  # same
    torchrun --standalone --nproc_per_node=2 scripts/bench_comm.py --out bench_results/bench_comm.json            # same

Per size and method: the median time with its min..max, algorithm bandwidth (bytes / time) and bus bandwidth
(algbw x 2(N-1)/N), in GB/s as nccl-tests reports them; and per method the smallest size reaching 80% of its peak
busbw, a floor for ``bucket_cap_mb`` (docs/performance.md). The two methods alternate within every repeat; large sizes
get fewer repeats (at most ``--byte-budget`` bytes per method and size, at least 3). ``--device auto`` is each rank's
GPU with NCCL on a CUDA host (timings bracketed by device synchronisations), ``--device cpu`` gloo with one thread
per rank. Writes the table to stdout, the JSON to ``--out`` and the busbw plot next to it (``.png``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import torch

from ...distributed import destroy_distributed, keep_upstream_notices_to_rank_zero
from ...distributed.devices import DEVICE_CHOICES
from ..bench import compute_setup, cpu_name, exit_without_finalization
from .bench_comm import (
    FAVOURED_FRACTION,
    METHODS,
    default_sizes,
    favoured_size,
    format_size,
    markdown_table,
    measure_all_reduce,
    parse_size,
    plot_busbw,
)


def build_parser(parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None) -> argparse.ArgumentParser:
    """Its flags; ``parents`` (built with ``add_help=False``) add a caller's."""
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, parents=list(parents)
    )
    p.add_argument("--sizes", nargs="+", type=parse_size, help="sizes to measure, e.g. 4K 1M 64M (default: x4 steps)")
    p.add_argument("--min-size", type=parse_size, default=4 * 2**10, help="smallest size of the x4 steps (4K)")
    p.add_argument("--max-size", type=parse_size, default=256 * 2**20, help="largest size of the x4 steps (256M)")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats per method and size, fewer for large sizes")
    p.add_argument("--warmup", type=int, default=2, help="untimed repeats per method and size")
    p.add_argument("--byte-budget", type=parse_size, default=2**30, help="bytes reduced per method and size at most")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument(
        "--device",
        choices=DEVICE_CHOICES,
        default="auto",
        help="cuda: each rank's GPU with NCCL; cpu: gloo, CUDA ignored; auto: cuda when available",
    )
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_comm.json"), help="JSON result file")
    return p


def parse_args(
    argv: list[str] | None = None, parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None
) -> argparse.Namespace:
    """Parse and check the flags; an error names the flag."""
    p = build_parser(parents, prog)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be at least 1 and --warmup at least 0")
    if args.threads < 1:
        p.error("--threads must be at least 1")
    return args


def run(argv: list[str] | None = None) -> None:
    """Measure, and on rank 0 print the table and write the JSON and the plot."""
    args = parse_args(argv)
    sizes = args.sizes or default_sizes(args.min_size, args.max_size)
    setup = compute_setup(args.device)
    info = setup.info
    torch.set_num_threads(args.threads)
    try:
        if info.world_size < 2:
            raise SystemExit(
                "run with: ddp-ft bench-comm --nproc 2 (or torchrun --standalone --nproc_per_node=2 -m ddp_ft.tools.ladder.bench_comm_cli)"
            )
        rows = measure_all_reduce(sizes, args.repeats, args.warmup, info.device, byte_budget=args.byte_budget)
        if info.is_main_process:
            report(args, setup, rows)
    finally:
        destroy_distributed()


def report(args: argparse.Namespace, setup, rows) -> None:
    info = setup.info
    if info.device.type == "cuda":
        hardware = f"{info.world_size} x {torch.cuda.get_device_name(info.device)}, {setup.backend}"
    else:
        hardware = f"{cpu_name()}, {info.world_size} ranks x {args.threads} thread(s), {setup.backend}"
    favoured = {m: favoured_size(rows, m) for m in METHODS}
    peak = {m: max(r.busbw_gbps for r in rows if r.method == m) for m in METHODS}
    result = {
        "hardware": hardware,
        "backend": setup.backend,
        "world_size": info.world_size,
        "dtype": "float32",
        "torch": torch.__version__,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "definitions": {
            "time": "seconds of the slowest rank per repeat; median and min..max over repeats",
            "algbw_gbps": "bytes / median time, in 1e9 bytes per second",
            "busbw_gbps": "algbw_gbps * 2(N-1)/N, N = world_size (nccl-tests' all-reduce bus bandwidth)",
            "favoured_bytes": f"smallest size whose busbw reaches {FAVOURED_FRACTION:.0%} of the method's peak",
        },
        "rows": [r.as_dict() for r in rows],
        "peak_busbw_gbps": peak,
        "favoured_bytes": favoured,
    }
    print(f"{setup.describe()}; {hardware}")
    print(markdown_table(rows))
    for m in METHODS:
        print(
            f"{m}: peak busbw {peak[m]:.3f} GB/s; {FAVOURED_FRACTION:.0%} of it from {format_size(favoured[m])} "
            f"(buckets smaller than that pay mostly latency)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    png = plot_busbw(rows, args.out.with_suffix(".png"), f"all-reduce bus bandwidth\n{hardware}")
    print(f"wrote {args.out} and {png}")


def main(argv: list[str] | None = None) -> NoReturn:
    """Run, then leave without interpreter finalization (``exit_without_finalization``)."""
    keep_upstream_notices_to_rank_zero()
    run(argv)
    exit_without_finalization()


if __name__ == "__main__":
    main()
