"""The benchmark's modes: their state together, one mode's timed steps, and every mode's profile."""

from __future__ import annotations

import argparse
from typing import NamedTuple

import torch
import torch.distributed as dist

from ...distributed import DistInfo
from ..bench import ComputeSetup
from .steps import Batching, device_busy, train_steps


class Modes(NamedTuple):
    """Every mode's model, optimizer and loss scaler, and this rank's batches (the same for every mode)."""

    args: argparse.Namespace
    setup: ComputeSetup
    models: dict
    optimizers: dict
    scalers: dict
    batches: list[list[dict]]
    batching: Batching


def measure(run: Modes, mode: str, steps: int) -> dict:
    """``steps`` timed optimizer steps of ``mode`` (``single`` on rank 0 only); every value the slowest rank's."""
    args, info = run.args, run.setup.info
    device = info.device
    runs = mode != "single" or info.is_main_process
    job = info if mode == "bucketed_ddp" else DistInfo(device=device)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    seconds, losses = ([0.0] * steps, [])
    if runs:
        model, optimizer, scaler = run.models[mode], run.optimizers[mode], run.scalers[mode]
        seconds, losses = train_steps(model, optimizer, scaler, run.batches, job, run.setup.precision, steps)
    memory = [0, 0, 0]
    if device.type == "cuda":
        memory = [resident, torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)]
    slowest = torch.tensor(seconds + [float(m) if runs else 0.0 for m in memory], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    seconds, memory = slowest[:steps].tolist(), slowest[steps:].tolist()
    ranks = 1 if mode == "single" else info.world_size
    tokens = ranks * run.batching.accumulation * run.batching.micro_batch * args.seq_len * steps
    return {
        "seconds": seconds,
        "tokens_per_s": tokens / sum(seconds) if steps else 0.0,  # --warmup 0
        "resident_bytes": memory[0],
        "peak_allocated_bytes": memory[1],
        "peak_reserved_bytes": memory[2],
        "losses": losses,
    }


def profile(run: Modes, modes: list[str]) -> dict[str, dict]:
    """Each mode's device-busy share over ``--profile-steps`` profiled steps (none when 0)."""
    info, profiles = run.setup.info, {}
    for mode in modes if run.args.profile_steps > 0 else []:
        dist.barrier()
        if mode != "single" or info.is_main_process:
            job = info if mode == "bucketed_ddp" else DistInfo(device=info.device)
            model, optimizer, scaler = run.models[mode], run.optimizers[mode], run.scalers[mode]
            profiles[mode] = device_busy(
                model, optimizer, scaler, run.batches, job, run.setup.precision, run.args.profile_steps
            )
    return profiles
