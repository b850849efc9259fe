"""Check that each rank holds one whole replica on its own device before BucketedDDP wraps it.

``device_map="auto"`` splits or offloads the model, which hangs or trains garbage under DDP.
Ranks that all default to ``cuda:0`` would compete for one GPU.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from torch import nn

_FIX = (
    "Load one whole replica per process on its own device: device_map={'': local_rank} "
    "(Accelerate: {'': accelerator.local_process_index}; ddp_ft.distributed.init_distributed() picks the device), "
    "never device_map='auto' or 'balanced' under DDP."
)


def model_device(module: nn.Module) -> torch.device:
    """The one device holding every parameter of ``module``.

    Raises:
        RuntimeError: if parameters span devices, are offloaded, or sit on another rank's GPU.
        ValueError: if it has no parameters.
    """
    where: dict[str, str] = {}
    for name, param in module.named_parameters():
        where.setdefault(str(param.device), name)
    if len(where) > 1:
        shown = ", ".join(f"{device} (e.g. {name!r})" for device, name in sorted(where.items()))
        raise RuntimeError(f"BucketedDDP: the model is spread over {len(where)} devices: {shown}. {_FIX}")
    if not where:
        raise ValueError("BucketedDDP: the module has no parameters.")
    device = torch.device(next(iter(where)))
    if device.type == "cuda" and torch.cuda.is_available():
        current = torch.cuda.current_device()
        if device.index is not None and device.index != current:
            raise RuntimeError(
                f"BucketedDDP: the model is on {device} but this process's device is cuda:{current} (the one its "
                f"streams and events use). Call torch.cuda.set_device(local_rank) before building the model. {_FIX}"
            )
    return device


def device_identity(device: torch.device) -> tuple[str, str] | None:
    """``(host, GPU)`` of a CUDA device, to compare across ranks; None on CPU, which ranks may share.

    The GPU is the physical one: ranks that each see only their own GPU (SLURM's ``--gpus-per-task=1``) all call
    it ``cuda:0``. Its UUID names it where torch reads one, else its entry in ``CUDA_VISIBLE_DEVICES``.
    """
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return socket.gethostname(), _physical_gpu(index)


def every_rank_identity(device: torch.device) -> list[tuple[str, str] | None]:
    """Every rank's :func:`device_identity`, by rank; this process's alone without a process group."""
    mine = device_identity(device)
    if not dist.is_initialized():
        return [mine]
    identities: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(identities, mine)
    return identities


def _physical_gpu(index: int) -> str:
    try:
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except (AssertionError, RuntimeError):  # torch without CUDA
        uuid = None
    if uuid:
        return f"GPU-{uuid}"
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return f"GPU {visible[index]}" if index < len(visible) else f"cuda:{index}"


def shared_device(identities: list[tuple[str, str] | None]) -> tuple[int, int, str] | None:
    """The first two ranks sharing a GPU of one host, as ``(rank, rank, device)``, or None.

    Args:
        identities (list[tuple[str, str] | None]): every rank's :func:`device_identity`, by rank.
    """
    first: dict[tuple[str, str], int] = {}
    for rank, identity in enumerate(identities):
        if identity is None:
            continue
        if identity in first:
            return first[identity], rank, f"{identity[1]} of {identity[0]}"
        first[identity] = rank
    return None
