"""Process-group lifecycle and rank facts, paired: ``init_distributed() -> DistInfo`` / ``destroy_distributed()``."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the job.

    Args:
        rank (int): global rank, 0..world_size-1; decides rank-0 duties and data shards.
        local_rank (int): rank on this node; decides the device.
        world_size (int): number of processes in the job.
        local_world_size (int): number of processes on this node.
        device (torch.device): this process' device (``cuda:<local_rank>`` or ``cpu``).
        backend (str | None): process-group backend, None for a single process.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> DistInfo:
    """Join the process group that torchrun / accelerate launch describe in the environment.

    A single process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``) gets no process group. With CUDA each
    process takes ``cuda:<LOCAL_RANK>`` and NCCL; without it, the CPU and gloo.

    Args:
        backend (str | None): override the backend ("nccl" or "gloo"). Default: chosen by device.
        timeout_s (float): collective timeout; a dead rank fails the others after this long. Default: 600.

    Returns:
        DistInfo: this process' rank facts.
    """
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are visible: "
                "launch at most one process per GPU (--nproc_per_node)."
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size == 1:
        return DistInfo(0, 0, 1, 1, device, None)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    info = DistInfo(rank, local_rank, world_size, local_world_size, device, backend)
    logger.debug("initialised %s", info)
    return info


def destroy_distributed() -> None:
    """Tear the process group down if there is one; safe to call from ``finally`` on every rank."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def setup_logging(info: DistInfo, level: int = logging.INFO) -> None:
    """Log at ``level`` on rank 0 and only warnings elsewhere, each line tagged with the rank."""
    logging.basicConfig(
        level=level if info.is_main_process else logging.WARNING,
        format=f"[rank{info.rank}] %(asctime)s %(name)s %(levelname)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    if not info.is_main_process:  # progress bars are rank 0's
        try:
            import datasets
            import transformers

            datasets.disable_progress_bars()
            transformers.utils.logging.disable_progress_bar()
        except ImportError:
            pass
