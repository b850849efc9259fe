"""The benchmark's optimizer steps: the batches they train on, timed, and under the profiler."""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import NamedTuple

import torch

from ...ddp import BucketedDDP
from ...distributed import DistInfo
from ...training.model.memory import Qwen3Shape
from ...training.model.precision import Precision
from ...training.steps import forward_backward, step_counts
from ..bench import synchronize


class Batching(NamedTuple):
    """The micro-batch and accumulation a run trains with: the flags', or ``--micro-batch auto``'s choice."""

    micro_batch: int
    accumulation: int


def random_batches(batching: Batching, seq_len: int, shape: Qwen3Shape, info: DistInfo) -> list[list[dict]]:
    """Four optimizer steps of random sequences (``accumulation`` micro-batches each), seeded by the rank."""
    g = torch.Generator().manual_seed(info.rank)
    batches = []
    for _ in range(4):
        group = []
        for _ in range(batching.accumulation):
            ids = torch.randint(0, shape.vocab_size, (batching.micro_batch, seq_len), generator=g).to(info.device)
            group.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
        batches.append(group)
    return batches


def train_steps(
    model, optimizer, scaler, batches, info: DistInfo, precision: Precision, steps: int
) -> tuple[list[float], list[float]]:
    """``steps`` optimizer steps as ``ddp_ft.training.loop`` takes them (forward_backward, unscale, clip, AdamW); the
    seconds and the loss of each (read after the last step: no host sync in the timed steps). ``info`` is the job's for
    BucketedDDP, a world of one for the unwrapped modes (no collectives)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    alone = isinstance(model, BucketedDDP) and not info.is_distributed  # forward_backward skips no_sync here
    seconds, losses = [], []
    for step in range(steps):
        group = batches[step % len(batches)]
        synchronize(info.device)
        start = time.perf_counter()
        if alone and len(group) > 1:
            counts = step_counts(group, info)
            loss = 0.0
            for i, batch in enumerate(group):
                with model.no_sync() if i < len(group) - 1 else nullcontext():
                    loss = loss + forward_backward(model, [batch], info, counts, precision, scaler)[0]
        else:
            loss = forward_backward(model, group, info, precision=precision, scaler=scaler)[0]
        losses.append(loss)
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        synchronize(info.device)
        seconds.append(time.perf_counter() - start)
    return seconds, [float(x) for x in torch.stack(losses).tolist()] if losses else []


def device_busy(model, optimizer, scaler, batches, info: DistInfo, precision: Precision, steps: int) -> dict:
    """``steps`` more optimizer steps under ``torch.profiler``: how much of the wall time the device spent in kernels.

    A busy fraction far below 1 means the host (Python, autograd, kernel launches) sets the pace, not the GPU: longer
    sequences or larger micro-batches then raise tokens/s almost for free, and no wrapper can hide it. Kernel time is
    summed as ``torch.profiler``'s own table sums "Self CUDA" (device events, user annotations excluded); kernels on
    other streams that overlap (NCCL) count in full. The profiler slows the host, so the fraction is a lower bound of
    an unprofiled step's. On the CPU there is no device: host time only.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = info.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        seconds, _ = train_steps(model, optimizer, scaler, batches, info, precision, steps)
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    wall_ms = 1e3 * sum(seconds)
    kernel_ms = sum(e.self_device_time_total for e in device_events) / 1e3
    return {
        "steps": steps,
        "wall_ms_per_step": wall_ms / steps,
        "device_kernel_ms_per_step": kernel_ms / steps if cuda else None,
        "device_busy_fraction": kernel_ms / wall_ms if cuda else None,
        "device_ops_per_step": len(device_events) / steps if cuda else None,
    }
