"""``ddp-ft doctor``: a preflight under the launcher you will train with, before any model loads.

    ddp-ft doctor --nproc 2                                       # launches itself with torchrun
    torchrun --standalone --nproc_per_node 2 -m ddp_ft.commands.doctor
    accelerate launch --config_file accelerate_configs/2cpu_gloo.yaml -m ddp_ft.commands.doctor

Every rank runs every check; rank 0 prints one table (a check fails if it fails on any rank, and that rank's detail
is shown) with the fix of each failure. Exit status 1 on any failure, on every rank. The checks: the world size the
launcher set against the one expected (``--expect-world-size``, set by ``--nproc``) and against what Accelerate sees
(the recipe's Trainer trains on what Accelerate sees); one device per process (two ranks on one GPU compete for it,
which ``--backend gloo`` allows by choice); the backend for the device (NCCL on CUDA, gloo on the CPU) or the one
``--backend`` names; the precision ``--compute-dtype`` resolves to (bf16 needs compute capability 8.0); the installed
torch, transformers, accelerate, peft, bitsandbytes and trl against ddp_ft's bounds; an all-reduce that sums
correctly and its bus bandwidth at a few sizes (``ddp_ft.tools.ladder.bench_comm.measure_all_reduce``, few repeats: a
smoke test, not ``ddp-ft bench-comm``). ``--out DIR`` also writes the checks and the timings to ``DIR/doctor.json``:
the link ``ddp-ft forecast --link measured`` fits.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..ddp.placement import every_rank_identity, shared_device
from ..distributed import DistInfo, destroy_distributed, init_distributed
from ..distributed.devices import BACKEND_CHOICES, DEVICE_CHOICES, device_and_backend
from ..distributed.launch import check_world_seen
from ..report.forecast import PROBE_FILE
from ..tools.ladder.bench_comm import CommRow, format_size, measure_all_reduce, parse_size
from ..training.model.precision import DTYPES, choose_precision
from . import quiet_upstream_notices

PACKAGES = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "trl")  # what ddp_ft subclasses or calls
OPTIONAL = {"trl": 'the [trl] extra (pip install ".[trl]" in the clone), for --trainer trl'}


@dataclass(frozen=True)
class Check:
    """One row of the table.

    Args:
        name (str): what was checked.
        ok (bool): passed.
        detail (str): what was found.
        fix (str): what to do about a failure. Default: ""
    """

    name: str
    ok: bool
    detail: str
    fix: str = ""


def build_parser(parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None) -> argparse.ArgumentParser:
    """The doctor's flags; ``parents`` (built with ``add_help=False``) add a caller's."""
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, parents=list(parents)
    )
    p.add_argument(
        "--expect-world-size",
        type=int,
        default=None,
        help="processes you mean to train on; a launch of another size fails (default: whatever was launched; "
        "ddp-ft doctor --nproc N expects N)",
    )
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto", help="as the training's --device. Default: auto")
    p.add_argument(
        "--backend",
        choices=BACKEND_CHOICES,
        default="auto",
        help="as the training's --backend: auto (NCCL on CUDA, gloo on the CPU), nccl, or gloo (on one visible GPU "
        "the processes share it). Default: auto",
    )
    p.add_argument(
        "--compute-dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="the precision the run will ask for (training's --compute-dtype). Default: auto",
    )
    p.add_argument(
        "--sizes",
        nargs="+",
        type=parse_size,
        default=[64 * 2**10, 2**20, 16 * 2**20],
        help="all-reduce sizes to time, e.g. 64K 1M 16M (the default)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed all-reduces per size and method. Default: 3")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout in seconds. Default: 120")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"also write the checks and the all-reduce timings to OUT/{PROBE_FILE}, the link ddp-ft forecast "
        "--link measured reads",
    )
    return p


def parse_args(
    argv: list[str] | None = None, parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None
) -> argparse.Namespace:
    """Parse and check the flags; an error names the flag."""
    p = build_parser(parents, prog)
    args = p.parse_args(argv)
    if args.expect_world_size is not None and args.expect_world_size < 1:
        p.error("--expect-world-size must be at least 1")
    if args.repeats < 1 or args.timeout <= 0:
        p.error("--repeats must be at least 1 and --timeout positive")
    try:
        device_and_backend(args.device, torch.cuda.is_available(), args.backend)
    except ValueError as error:
        p.error(str(error))
    return args


def check_world_size(world_size: int, expected: int | None) -> Check:
    """The launched world against the one the user means to train on."""
    detail = f"{world_size} process(es) launched (WORLD_SIZE={os.environ.get('WORLD_SIZE', 'unset')})"
    if expected is None or expected == world_size:
        return Check("world size", True, detail)
    return Check(
        "world size",
        False,
        f"{detail}, {expected} expected",
        f"launch {expected}: ddp-ft train --nproc {expected}, torchrun --nproc_per_node {expected} (nnodes x "
        f"nproc_per_node = {expected} on several machines), or accelerate launch with num_processes: {expected}.",
    )


def check_accelerate(world_size: int, seen: int, environ: Mapping[str, str] | None = None) -> Check:
    """The launched world against Accelerate's ``num_processes`` (the Trainer trains on what Accelerate sees)."""
    detail = f"Accelerate sees {seen} process(es)"
    try:
        check_world_seen(seen, "cpu=True to Accelerator (use_cpu=True to TrainingArguments)", environ)
    except RuntimeError as error:
        return Check("accelerate world", False, detail, str(error))
    if seen != world_size:
        return Check(
            "accelerate world",
            False,
            f"{detail}, the launcher started {world_size}",
            "launch every process with one launcher (torchrun or accelerate launch) and unset stale WORLD_SIZE / "
            "ACCELERATE_* variables in the shell.",
        )
    return Check("accelerate world", True, detail)


def check_devices(identities: list[tuple[str, str] | None], device: torch.device, backend: str | None = None) -> Check:
    """One device per process: no two ranks on one GPU, unless gloo shares it by choice (``--backend gloo``)."""
    shared = shared_device(identities)
    if shared is not None and backend == "gloo":
        first, second, where = shared
        return Check("devices", True, f"ranks {first} and {second} share {where} over gloo (by choice: --backend gloo)")
    if shared is not None:
        first, second, where = shared
        return Check(
            "devices",
            False,
            f"ranks {first} and {second} both on {where}",
            f"one GPU per process: launch at most torch.cuda.device_count() = {torch.cuda.device_count()} "
            "processes per machine, and do not narrow CUDA_VISIBLE_DEVICES to one GPU for all of them; or "
            "--backend gloo with one GPU visible, to share it on purpose (NCCL refuses).",
        )
    if device.type == "cpu":
        return Check("devices", True, f"cpu, {len(identities)} process(es) sharing the host (by design)")
    return Check("devices", True, f"one GPU per process ({device} on rank 0)")


def check_backend(info: DistInfo, requested: str, backend: str = "auto") -> Check:
    """The backend ``--device`` and ``--backend`` ask for: by default NCCL for CUDA tensors, gloo for CPU ones."""
    device_type, expected = device_and_backend(requested, torch.cuda.is_available(), backend)
    if not dist.is_initialized():
        return Check("backend", True, f"one process, no process group ({device_type})")
    actual = dist.get_backend()
    if actual != expected:
        return Check(
            "backend",
            False,
            f"{actual} on {device_type}, {expected} asked for (--backend {backend})",
            f"use {expected} on {device_type} (ddp_ft.distributed.init_distributed chooses it).",
        )
    return Check("backend", True, f"{actual} on {device_type}")


def check_precision(requested: str, device: torch.device) -> Check:
    """What ``--compute-dtype`` resolves to on this device; bf16 on a GPU older than compute capability 8.0 fails."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    try:
        precision = choose_precision(requested, device.type, capability)
    except ValueError as error:
        return Check("precision", False, f"--compute-dtype {requested} on {device}", str(error))
    scaled = ", loss-scaled" if precision.loss_scaling else ""
    return Check("precision", True, f"{precision.name}{scaled} ({precision.reason})")


def _bounds() -> dict[str, tuple[str, bool]]:
    """ddp_ft's requirement of each of PACKAGES -> (specifier, optional), from the installed metadata."""
    from packaging.requirements import Requirement

    found = {}
    for text in metadata.requires("ddp_ft") or []:
        requirement = Requirement(text)
        if requirement.name in PACKAGES:
            found[requirement.name] = (str(requirement.specifier), requirement.marker is not None)
    return found


def check_versions() -> list[Check]:
    """Each of PACKAGES installed within ddp_ft's bounds (pyproject.toml, as installed)."""
    from packaging.specifiers import SpecifierSet

    try:
        bounds = _bounds()
    except metadata.PackageNotFoundError:
        return [Check("versions", True, "ddp_ft is not installed (run from source): bounds not checked")]
    checks = []
    for name in PACKAGES:
        specifier, optional = bounds.get(name, ("", name in OPTIONAL))
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            if optional:
                checks.append(Check(name, True, f"not installed (optional: {OPTIONAL.get(name, 'an extra')})"))
            else:
                checks.append(Check(name, False, "not installed", f'pip install "{name}{specifier}"'))
            continue
        if SpecifierSet(specifier).contains(version, prereleases=True):
            checks.append(Check(name, True, f"{version} (ddp_ft needs {specifier or 'any'})"))
        else:
            checks.append(Check(name, False, f"{version}, outside {specifier}", f'pip install "{name}{specifier}"'))
    return checks


def check_all_reduce(info: DistInfo, sizes: list[int], repeats: int) -> tuple[Check, list[CommRow]]:
    """A sum that comes out right, then the bus bandwidth at ``sizes`` (backend and ring).

    Returns:
        tuple[Check, list[CommRow]]: the row of the table, and the timings (none when the check failed or one process
        ran it), each the slowest rank's.
    """
    if info.world_size == 1:
        return Check("all-reduce", True, "one process: nothing to reduce"), []
    try:
        total = torch.full((4,), float(info.rank + 1), device=info.device)
        dist.all_reduce(total)
        expected = info.world_size * (info.world_size + 1) / 2
        if not torch.all(total == expected):
            wrong = Check(
                "all-reduce",
                False,
                f"sum {total[0].item()} instead of {expected}",
                "a broken transport: check the backend's network settings (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, "
                "NCCL_P2P_DISABLE) and run ddp-ft bench-comm.",
            )
            return wrong, []
        rows = measure_all_reduce(sizes, repeats, warmup=1, device=info.device, byte_budget=2**28)
    except Exception as error:  # a timeout or a transport error: the failure, reported as one
        failed = Check("all-reduce", False, f"{type(error).__name__}: {error}", "see the error; then ddp-ft bench-comm")
        return failed, []
    shown = ", ".join(f"{format_size(r.nbytes)} {r.busbw_gbps:.2f}" for r in rows if r.method == "backend")
    return Check("all-reduce", True, f"sums right; backend busbw GB/s: {shown}"), rows


def run_checks(args: argparse.Namespace, info: DistInfo) -> tuple[list[Check], list[CommRow]]:
    """This rank's checks, in table order, and the all-reduce timings."""
    from accelerate import PartialState

    identities = every_rank_identity(info.device)
    seen = PartialState(cpu=info.device.type == "cpu").num_processes
    comm, rows = check_all_reduce(info, args.sizes, args.repeats)
    checks = [
        check_world_size(info.world_size, args.expect_world_size),
        check_accelerate(info.world_size, seen),
        check_devices(identities, info.device, info.backend),
        check_backend(info, args.device, args.backend),
        check_precision(args.compute_dtype, info.device),
        *check_versions(),
        comm,
    ]
    return checks, rows


def merge(by_rank: list[list[Check]]) -> list[Check]:
    """One row per check: rank 0's, or the first failing rank's with its rank named."""
    merged = []
    for rows in zip(*by_rank, strict=True):
        failing = [(rank, row) for rank, row in enumerate(rows) if not row.ok]
        if failing and failing[0][0] != 0:
            rank, row = failing[0]
            merged.append(Check(row.name, False, f"rank {rank}: {row.detail}", row.fix))
        else:
            merged.append(rows[0])
    return merged


def format_table(checks: list[Check]) -> str:
    """The table: check, PASS/FAIL, detail; each failure's fix on the line under it."""
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
    for c in checks:
        lines.append(f"{c.name:<{width}}  {'PASS' if c.ok else 'FAIL':<6}  {c.detail}")
        if not c.ok:
            lines.append(f"{'':<{width}}  fix:    {c.fix}")
    failed = sum(not c.ok for c in checks)
    lines.append(f"{failed} check(s) failed." if failed else "All checks passed.")
    return "\n".join(lines)


def write_probe(out_dir: Path, info: DistInfo, checks: list[Check], rows: list[CommRow]) -> Path:
    """``out_dir/doctor.json``: the checks and the all-reduce timings (``ddp-ft forecast --link measured``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PROBE_FILE
    probe = {
        "world_size": info.world_size,
        "device": info.device.type,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "checks": [asdict(c) for c in checks],
        "all_reduce": [r.as_dict() for r in rows],
    }
    path.write_text(json.dumps(probe, indent=2))
    return path


def main(
    argv: list[str] | None = None, parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None
) -> int:
    """Run the checks on every rank; rank 0 prints the table. Returns 1 on any failure (on every rank), else 0."""
    quiet_upstream_notices()
    args = parse_args(argv, parents, prog)
    info = init_distributed(args.backend, args.timeout, None if args.device == "auto" else args.device)
    try:
        checks, rows = run_checks(args, info)
        by_rank = [checks]
        if dist.is_initialized():
            by_rank = [None] * info.world_size
            dist.all_gather_object(by_rank, checks)
        merged = merge(by_rank)
        if info.is_main_process:
            print(f"ddp-ft doctor: {info.world_size} process(es), {info.device.type}", flush=True)
            print(format_table(merged), flush=True)
            if args.out is not None:
                print(f"wrote {write_probe(args.out, info, merged, rows)}", flush=True)
        return int(not all(c.ok for c in merged))
    finally:
        destroy_distributed()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()  # done: leave without interpreter finalization (ddp_ft.tools.bench.exit_without_finalization)
    sys.stderr.flush()
    os._exit(code)
