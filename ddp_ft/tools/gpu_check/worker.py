"""One spawned process of a phase: join the group the orchestrator's store hosts, run the checks, and on rank 0
merge every rank's rows (:func:`merge_ranks`) and write them for the orchestrator to read.
"""

from __future__ import annotations

import json
import os
import traceback
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ...distributed import destroy_distributed
from ..bench import compute_setup, exit_without_finalization
from .checks import run_checks
from .settings import GpuCheckSettings


def run_worker(rank: int, world_size: int, settings: GpuCheckSettings, port: int, out_dir: str) -> None:
    """One spawned process: join the group the orchestrator's store hosts, run the checks, rank 0 writes them."""
    env = {
        "RANK": rank,
        "LOCAL_RANK": rank,
        "WORLD_SIZE": world_size,
        "LOCAL_WORLD_SIZE": world_size,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "TORCHELASTIC_USE_AGENT_STORE": True,
    }
    os.environ.update({k: str(v) for k, v in env.items()})
    if Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host
    try:
        setup = compute_setup(settings.device, settings.compute_dtype, settings.timeout_s, settings.backend)
        if setup.info.device.type == "cpu":
            torch.set_num_threads(1)  # one thread per process: the CPU analogue of one GPU per process
        if world_size == 1:  # init_distributed makes no group for one process; both DDPs need one
            device_id = {"device_id": setup.info.device} if setup.backend == "nccl" else {}
            dist.init_process_group(
                setup.backend,
                store=dist.HashStore(),
                rank=0,
                world_size=1,
                timeout=timedelta(seconds=settings.timeout_s),
                **device_id,
            )
        checks = run_checks(settings, setup)
        every_rank: list = [None] * world_size
        dist.all_gather_object(every_rank, [asdict(c) for c in checks])
        if rank == 0:
            result = {
                "world_size": world_size,
                "setup": setup.describe(),
                "device": setup.info.device.type,
                "backend": setup.backend,
                "compute_dtype": setup.precision.name,
                "checks": merge_ranks(every_rank),
            }
            Path(out_dir, "result.json").write_text(json.dumps(result))
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        destroy_distributed()
    exit_without_finalization()  # done and written


def merge_ranks(every_rank: list[list[dict]]) -> list[dict]:
    """One row per check: passed on every rank; a failing rank's detail, else rank 0's; rank 0's values."""
    merged = []
    for rows in zip(*every_rank, strict=True):
        failing = [(r, row) for r, row in enumerate(rows) if not row["passed"]]
        detail = "; ".join(f"rank {r}: {row['detail']}" for r, row in failing) if failing else rows[0]["detail"]
        merged.append({**rows[0], "passed": not failing, "detail": detail})
    return merged
