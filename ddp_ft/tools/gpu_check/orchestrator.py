"""The orchestrating process: which process counts to run (:func:`plan_world_sizes`), one phase of spawned processes
each (:func:`run_phase`), the report (:func:`run_gpu_check`) and its PASS/FAIL table (:func:`format_report`).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ...distributed.devices import check_local_gpus, device_and_backend
from .settings import GpuCheckSettings
from .worker import run_worker


def plan_world_sizes(device_type: str, gpu_count: int, requested: list[int], backend: str = "auto") -> list[int]:
    """The process counts to run: ``requested``, or 1 then 2 where two devices exist (the CPU always has two).

    Under NCCL each process needs its own GPU (NCCL refuses two ranks on one device). Under ``backend="gloo"`` on CUDA
    the processes may share one GPU, but only when exactly one is visible, so that every rank takes ``cuda:0``
    (``ddp_ft.distributed.devices.check_local_gpus``); BucketedDDP then warns that the ranks share it.

    Raises:
        ValueError: more processes than GPUs under NCCL, or under gloo with several GPUs visible, naming the fix.
    """
    sizes = requested or ([1, 2] if device_type == "cpu" or gpu_count >= 2 else [1])
    if device_type == "cuda":
        check_local_gpus(max(sizes), gpu_count, "gloo" if backend == "gloo" else "nccl")
    return sizes


def run_phase(world_size: int, settings: GpuCheckSettings) -> dict:
    """Spawn ``world_size`` processes that run every check; their merged result, or an ``error`` row.

    The processes rendezvous on a TCPStore this process hosts on a port the OS chose, as torchrun's agent does
    (``TORCHELASTIC_USE_AGENT_STORE``): no port to collide on.
    """
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=settings.timeout_s)
    )
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            run_worker,
            args=(world_size, settings, store.port, tmp),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        started = time.monotonic()
        deadline = started + settings.timeout_s
        error = None
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    error = f"did not finish within {settings.timeout_s:.0f} s"
                    break
        except mp.ProcessExitedException as crash:
            error = str(crash)  # a crash without a traceback (a signal); replaced below by a rank's traceback if any
            time.sleep(1.0)  # let a peer that raised write its traceback; the others die of the lost peer
        except mp.ProcessRaisedException:
            pass
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
        raised = sorted(Path(tmp).glob("rank*.err"))
        result_file = Path(tmp, "result.json")
        if error is None and not raised and result_file.exists():
            return {**json.loads(result_file.read_text()), "seconds": time.monotonic() - started}
        if raised:
            error = " | ".join(f"{p.stem}: {p.read_text().strip().splitlines()[-1]}" for p in raised)
        return {
            "world_size": world_size,
            "error": error or "a process exited without a result",
            "traceback": "\n".join(f"--- {p.stem}:\n{p.read_text()}" for p in raised),
        }


def run_gpu_check(settings: GpuCheckSettings) -> dict:
    """Every phase, in order; the report that the table and the JSON show. ``report["passed"]`` is the verdict."""
    device_type, backend = device_and_backend(settings.device, torch.cuda.is_available(), settings.backend)
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if device_type == "cuda" else []
    sizes = plan_world_sizes(device_type, len(gpus), settings.world_sizes, settings.backend)
    started = time.monotonic()
    phases = [run_phase(w, settings) for w in sizes]
    runs = {p["world_size"]: c["values"] for p in phases for c in p.get("checks", []) if c["name"] == "qlora_run"}
    report = {
        "passed": all("error" not in p and all(c["passed"] for c in p["checks"]) for p in phases),
        "device": device_type,
        "backend": backend,
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "settings": asdict(settings),
        "phases": phases,
        "runs": runs,
        "seconds": time.monotonic() - started,
    }
    if 1 in runs and 2 in runs:
        report["scaling_efficiency_2"] = runs[2]["tokens_per_s"] / (2 * runs[1]["tokens_per_s"])
    return report


def format_report(report: dict) -> str:
    """The PASS/FAIL table, the run's numbers, and the verdict."""
    hardware = ", ".join(report["gpus"]) or "CPU"
    lines = [f"gpu_check: torch {report['torch']} (CUDA {report['cuda']}), {hardware}"]
    for phase in report["phases"]:
        if "setup" in phase:
            lines.append(f"  {phase['world_size']} process(es): {phase['setup']}")
    lines += ["", "| processes | check | result | detail |", "|---:|---|---|---|"]
    for phase in report["phases"]:
        rows = phase.get("checks") or [{"name": "(phase)", "passed": False, "detail": phase.get("error", "")}]
        for c in rows:
            detail = c["detail"].replace("|", "/")
            lines.append(f"| {phase['world_size']} | {c['name']} | {'PASS' if c['passed'] else 'FAIL'} | {detail} |")
    if report["runs"]:
        lines += [
            "",
            "| processes | tokens/s | tokens/s per device | step ms | peak memory GB | exposed comm ms/step |"
            " all-reduces/step |",
            "|---:|---:|---:|---:|---|---:|---:|",
        ]
        for world, r in report["runs"].items():
            memory = (
                f"{r['peak_allocated_gb']:.2f} allocated / {r['peak_reserved_gb']:.2f} reserved"
                if "peak_allocated_gb" in r
                else f"{r['peak_rss_gb']:.2f} RSS"
            )
            lines.append(
                f"| {world} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_device']:,.0f} | "
                f"{r['step_time_s'] * 1e3:.1f} | {memory} | {r['exposed_comm_ms_per_step']:.2f} | "
                f"{r['allreduce_calls_per_step']:.0f} |"
            )
    if "scaling_efficiency_2" in report:
        lines.append(
            f"scaling efficiency, 2 processes: {report['scaling_efficiency_2']:.1%} (tiny model: launch- "
            "and communication-bound, not Qwen3-4B's)"
        )
    failed = sum(not c["passed"] for p in report["phases"] for c in p.get("checks", [])) + sum(
        "error" in p for p in report["phases"]
    )
    verdict = "PASS" if report["passed"] else f"FAIL ({failed} failed)"
    lines.append(f"\n{verdict} in {report['seconds']:.0f} s")
    return "\n".join(lines)
