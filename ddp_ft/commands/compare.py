"""What DDP bought: compare a 1-device run with the same experiment under DDP on N devices (``ddp-ft compare``,
``scripts/compare.py``).

    ddp-ft train --preset tiny --output-dir runs/single
    ddp-ft train --nproc 2 --preset tiny --output-dir runs/ddp
    ddp-ft compare runs/single runs/ddp --out runs/compare [--wandb-project P --wandb-group G]
        [--independent runs/alone0 runs/alone1]   # single-device runs that ran side by side: the limit
        [--forecast runs/single]                  # ddp-ft forecast's prediction beside the DDP run

Prints the markdown table and writes comparison.md, comparison.png and comparison.json into --out.
ddp-ft gives every process of both runs the same threads (1, or OMP_NUM_THREADS), so their speeds compare. Runs
that differ in threads per process or device type get no speedup: the report says "not comparable", naming the
difference and the fix; runs written before ddp_ft recorded them are compared, with a note.
wandb logging runs offline unless WANDB_API_KEY is set (an explicit WANDB_MODE is respected).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from ..report.comparison import log_report_to_wandb, write_report
from . import quiet_upstream_notices


def build_parser(parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None) -> argparse.ArgumentParser:
    """The comparison's flags; ``parents`` (built with ``add_help=False``) add a caller's."""
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, parents=list(parents)
    )
    p.add_argument(
        "baseline_dir", help="output_dir of the 1-device run (holds metrics.jsonl), or wandb:entity/project/id"
    )
    p.add_argument("other_dir", help="output_dir of the DDP run (holds metrics.jsonl), or wandb:entity/project/id")
    p.add_argument("--out", type=Path, required=True, help="folder for comparison.md/.png/.json")
    p.add_argument(
        "--independent",
        nargs="+",
        default=None,
        metavar="DIR",
        help="output_dirs of single-device runs of the same experiment run at the same time, one per device of the "
        "DDP run: what the devices do with no communication at all, shown as the limit",
    )
    p.add_argument(
        "--forecast",
        type=Path,
        default=None,
        help="a forecast.json of ddp-ft forecast (or its folder), shown beside the DDP run. Default: the baseline "
        "folder's forecast.json, if it has one",
    )
    p.add_argument("--skip-first", type=int, default=1, help="warm-up steps left out of the medians")
    p.add_argument("--wandb-project", default=None, help="log the comparison to this wandb project")
    p.add_argument("--wandb-group", default=None, help="wandb group (default: <baseline>-vs-<other> run names)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Parse, write the report, print its table, log it to wandb if asked."""
    quiet_upstream_notices()
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        report = write_report(
            args.baseline_dir,
            args.other_dir,
            args.out,
            skip_first=args.skip_first,
            independent_dirs=args.independent,
            forecast=args.forecast,
        )
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"compare: {error}") from error
    print(report["markdown"], end="")
    if args.wandb_project:
        group = args.wandb_group or f"{report['baseline']['run_name']}-vs-{report['other']['run_name']}"
        log_report_to_wandb(report, report["files"]["png"], project=args.wandb_project, group=group)


if __name__ == "__main__":
    main()
