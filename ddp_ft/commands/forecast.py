"""``ddp-ft forecast``: what BucketedDDP would do on N processes, from a finished one-process run.

The run is ``ddp-ft train``'s or the Trainer's (``ddp-ft recipe``, BucketedTrainer and its subclasses).

    ddp-ft train --preset tiny --output-dir runs/single                # one process: records when buckets are ready
    ddp-ft forecast runs/single --nproc 2 --link nvlink
    ddp-ft doctor --nproc 2 --out runs/probe                           # this machine's link, measured
    ddp-ft forecast runs/single --nproc 2 --link measured --probe runs/probe --out runs/single

Replays each measured step on 2, 4 and 8 processes (and N) of one machine and on 2 machines of N: BucketedDDP's
schedule (buckets launch in order, each once ready and the link is free, on the last micro-step only) over a ring
all-reduce on the link. Prints the table (exposed communication, step time, tokens/s, scaling efficiency), the links'
sources and the assumptions; --out also writes forecast.md and forecast.json, which ``ddp-ft compare`` shows beside a
measured DDP run.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ..report.forecast import (
    LINK_CHOICES,
    MEASURED,
    PRESETS,
    PROBE_FILE,
    Link,
    forecast_run,
    load_probe,
    markdown,
    write_forecast,
)
from ..report.metrics import read_jsonl, timeline
from ..report.records import METRICS_FILE


def build_parser(parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None) -> argparse.ArgumentParser:
    """The forecast's flags; ``parents`` (built with ``add_help=False``) add a caller's."""
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, parents=list(parents)
    )
    p.add_argument("run", metavar="RUN", help="output_dir of a finished one-process run: ddp-ft train or recipe")
    p.add_argument("--nproc", type=int, required=True, metavar="N", help="processes per machine to forecast")
    p.add_argument(
        "--link",
        choices=LINK_CHOICES,
        default="pcie4",
        help="the link between the processes of a machine: a preset, or measured (ddp-ft doctor's probe, --probe). "
        "Default: pcie4",
    )
    p.add_argument(
        "--node-link",
        choices=LINK_CHOICES,
        default="infiniband",
        help="the link between 2 machines. Default: infiniband",
    )
    p.add_argument(
        "--probe",
        type=Path,
        default=None,
        help=f"--link measured: a {PROBE_FILE} of ddp-ft doctor --out DIR, or DIR. Default: RUN/{PROBE_FILE}",
    )
    p.add_argument("--skip-first", type=int, default=1, help="warm-up steps left out of the medians. Default: 1")
    p.add_argument("--out", type=Path, default=None, help="also write forecast.md and forecast.json into this folder")
    return p


def parse_args(
    argv: list[str] | None = None, parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None
) -> argparse.Namespace:
    """Parse and check the flags; an error names the flag."""
    p = build_parser(parents, prog)
    args = p.parse_args(argv)
    if args.nproc < 1:
        p.error(f"--nproc {args.nproc}: give the processes per machine, 1 or more")
    if args.skip_first < 0:
        p.error(f"--skip-first {args.skip_first}: give 0 or more warm-up steps")
    if args.probe is not None and MEASURED not in (args.link, args.node_link):
        p.error("--probe is read by --link measured (or --node-link measured) only")
    return args


def main(argv: list[str] | None = None, prog: str = "ddp-ft forecast") -> None:
    """Parse, forecast, print the table; write the files with ``--out``.

    Raises:
        SystemExit: a run or probe the forecast cannot read, naming what to run instead.
    """
    args = parse_args(argv, prog=prog)
    try:
        links = [_link(name, args) for name in (args.link, args.node_link)]
        path = Path(args.run) / METRICS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: pass the output_dir of a ddp-ft train or recipe run")
        forecast = forecast_run(timeline(read_jsonl(path)), args.nproc, *links, args.skip_first, Path(args.run).name)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"{prog}: {error}") from error
    print(markdown(forecast), end="", flush=True)
    if args.out is not None:
        files = write_forecast(forecast, args.out)
        print(f"wrote {files['md']} and {files['json']}", flush=True)


def _link(name: str, args: argparse.Namespace) -> Link:
    """A preset, or the link fitted from the doctor's probe (``--probe``, else the run's folder)."""
    if name != MEASURED:
        return PRESETS[name]
    return load_probe(args.probe if args.probe is not None else Path(args.run))


if __name__ == "__main__":
    main()
