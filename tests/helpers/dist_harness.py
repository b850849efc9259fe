"""Run a function on N real processes (gloo, CPU), as torch's and accelerate's multi-process tests do.

Each test gets a fresh rendezvous file (no fixed port), a timeout, and on the first failing rank all
ranks are killed and that rank's traceback is raised in the test.

The processes come from a fork server that imported the heavy libraries once for the session (torch, transformers,
peft, bitsandbytes, accelerate, trl: about 7 s of imports per process on 2 CPU cores, paid once instead of twice per
test). Each process is still a fresh process: it forks from a server that has only imported modules (no thread pool,
no process group, no test state), takes the test's current environment, working directory and ``sys.path``, and
imports the test's own module itself, as a spawned one would.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

ROOT = Path(__file__).resolve().parents[2]
# For the scripts a test starts: this checkout first, then the start-up hook that installs DDP_FT_INJECT_FAULT's faults
# (tests/helpers/fault_site/sitecustomize.py), then whatever PYTHONPATH the suite was started with (a host whose packages come
# from PYTHONPATH, as on the GPU machine where the suite first ran, keeps them).
FAULT_SITE = ROOT / "tests" / "helpers" / "fault_site"
PYTHONPATH = os.pathsep.join(p for p in (str(ROOT), str(FAULT_SITE), os.environ.get("PYTHONPATH", "")) if p)

# Imported once, in the fork server, before it forks the first process. A module missing here is skipped.
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "peft",
    "bitsandbytes",
    "accelerate",
    "trl",
    "datasets",
    "ddp_ft",
]
multiprocessing.set_forkserver_preload(PRELOAD)


def _entry(
    rank: int,
    fn: Callable,
    world_size: int,
    init_file: str,
    out_dir: str,
    args: tuple,
    init_group: bool,
    environ: dict[str, str],
) -> None:
    # The fork server's environment is the one it started with: take the test's, as a spawned process would.
    os.environ.clear()
    os.environ.update(environ)
    # And its stdout/stderr are those of the test that started it: write to files the test replays.
    for stream, name in ((sys.stdout, "out"), (sys.stderr, "err")):
        stream.flush()
        with open(Path(out_dir) / f"rank{rank}.std{name}", "wb") as sink:
            os.dup2(sink.fileno(), stream.fileno())
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    if init_group:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
        )
    try:
        try:
            result = fn(rank, world_size, *args)
        except BaseException:
            (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())  # this rank's own story
            raise
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        if init_group:
            dist.barrier()  # no rank tears gloo down while a peer still has a collective in flight
    finally:
        if init_group:
            dist.destroy_process_group()
    # Done and saved: leave without interpreter finalization. torch's Python comm hooks (PowerSGD, the compress
    # wrappers) leave Future.then callbacks that gloo's thread may release while the interpreter shuts down, which
    # aborts the process ("terminate called without an active exception"); our own hooks run no such callback
    # (tested in tests/ddp/test_communication.py). Flush first: what the rank printed is replayed in the test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable, *args, world_size: int = 2, timeout: float = 240.0, init_group: bool = True) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes with a gloo group.

    ``fn`` must be importable (module level). Returns each rank's return value, in rank order. With
    ``init_group=False`` the processes start without a process group (``fn`` makes and ends its own).

    Raises:
        RuntimeError: naming each rank whose ``fn`` raised, with its traceback.
        torch.multiprocessing.spawn.ProcessException: a rank died without ``fn`` raising.
        TimeoutError: if the ranks do not finish within ``timeout`` seconds (all are killed).
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, init_file, tmp, args, init_group, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} did not finish on {world_size} ranks within {timeout:.0f} s")
        except ProcessException as crash:
            # A rank that dies, or fails in the closing barrier, because a peer raised is not the story: show the
            # ranks whose ``fn`` raised.
            time.sleep(1.0)
            raised = sorted(Path(tmp).glob("rank*.err"))
            if raised:
                report = "\n".join(f"--- {p.stem} raised:\n{p.read_text()}" for p in raised)
                raise RuntimeError(f"{fn.__name__} failed on {len(raised)} rank(s):\n{report}") from crash
            raise
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
            _replay_output(Path(tmp), world_size)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _replay_output(out_dir: Path, world_size: int) -> None:
    """Each rank's stdout and stderr, on the test's own (pytest shows them with a failing test)."""
    for rank in range(world_size):
        for stream, name in ((sys.stdout, "out"), (sys.stderr, "err")):
            path = out_dir / f"rank{rank}.std{name}"
            text = path.read_text(errors="replace") if path.exists() else ""
            if text:
                stream.write(f"--- rank {rank} std{name}:\n{text}")


def gather_tensors(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Every rank's copy of ``tensors`` (one flat list per rank), for cross-rank comparisons."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    shapes = [t.shape for t in tensors]
    result = []
    for f in out:
        parts, offset = [], 0
        for s in shapes:
            n = int(torch.Size(s).numel())
            parts.append(f[offset : offset + n].view(s))
            offset += n
        result.append(parts)
    return result


def processes_running_with(marker: str) -> list[str]:
    """``pid: command line`` of each live process whose command line holds ``marker`` (an output folder): what a
    launcher left running."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found
