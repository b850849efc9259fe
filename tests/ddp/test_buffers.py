"""BucketedDDP's buffers after construction: broadcast from rank 0 on torch DDP's schedule, only when written, never
in a no-grad forward, and refused when the ranks wrote different ones. 2 real gloo processes."""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.testing import assert_close

from ddp_ft.ddp import BucketedDDP

from ..helpers.dist_harness import run_distributed
from ..helpers.models import Net, local_slice, make_batch

pytestmark = pytest.mark.distributed


def _buffer_schedule(rank, world_size):
    torch.manual_seed(0)
    reference = Net()
    wrapped = {"ours": BucketedDDP(copy.deepcopy(reference)), "torch": TorchDDP(copy.deepcopy(reference))}
    seen = {}
    for name, model in wrapped.items():
        values = []
        tick = 0
        for accumulation in (3, 1, 2, 1):  # micro-steps per optimizer step, all but the last under no_sync
            for micro in range(accumulation):
                tick += 1
                model.module.scale.fill_(100.0 * tick + rank)  # a rank-local value before every forward
                x, y = make_batch(tick)
                with model.no_sync() if micro < accumulation - 1 else contextlib.nullcontext():
                    torch.nn.functional.mse_loss(model(x), y).backward()
                values.append(model.module.scale[0].item())  # 100*tick: broadcast from rank 0; +rank: local
        seen[name] = values
    assert seen["ours"] == seen["torch"]
    if rank == 1:  # rank 0 sees its own values either way
        # torch broadcasts exactly at the first forward after a synced one (and the first forward ever)
        broadcast_at = [i for i, v in enumerate(seen["torch"]) if v == 100.0 * (i + 1)]
        assert broadcast_at == [0, 3, 4, 6], seen["torch"]

    # A no-grad forward never communicates (evaluation on uneven shards cannot hang), even right after a step.
    ours = wrapped["ours"]
    ours.module.scale.fill_(7.0 + rank)
    with torch.no_grad():
        ours(torch.zeros(2, 16))
    assert ours.module.scale[0].item() == 7.0 + rank


def test_broadcast_as_torch_ddp_never_under_no_grad():
    run_distributed(_buffer_schedule)


def _count_broadcasts():
    """Record every ``dist.broadcast`` from now on; returns the list the calls are appended to."""
    calls = []
    broadcast = dist.broadcast

    def recording_broadcast(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return broadcast(tensor, *args, **kwargs)

    dist.broadcast = recording_broadcast  # looked up at call time by the wrapper
    return calls


def _train_steps(ddp, rank, world_size, steps=3):
    """``steps`` optimizer steps of 2 micro-steps, the first under ``no_sync``."""
    for step in range(steps):
        for micro in range(2):
            x, y = make_batch(2 * step + micro)
            with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                local = local_slice(rank, world_size)
                torch.nn.functional.mse_loss(ddp(x[local]), y[local]).backward()


def _buffer_written_once(rank, world_size):
    torch.manual_seed(0)
    ddp = BucketedDDP(Net())  # Net.scale is never written: a constant buffer, as a rotary inv_freq
    calls = _count_broadcasts()
    _train_steps(ddp, rank, world_size)
    constant = list(calls)
    ddp.module.scale.mul_(2.0)  # written once, on every rank (as a buffer set up after wrapping)
    _train_steps(ddp, rank, world_size)
    return constant, calls[len(constant) :]


def test_buffer_broadcast_once_per_write():
    """After construction a buffer travels only when written: a constant one never (3 steps, no broadcast), one
    written once at the next step's first forward only (its count, then its 32 values), not at every step after."""
    for constant, after_write in run_distributed(_buffer_written_once):
        assert constant == []
        assert after_write == [1, 32], after_write


class _BatchNormNet(torch.nn.Module):
    """Buffers every training forward writes (BatchNorm's running stats and its counter)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(16, 32)
        self.norm = torch.nn.BatchNorm1d(32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.embed(x))))


def _changing_buffers(rank, world_size):
    torch.manual_seed(0)
    reference = _BatchNormNet()
    local = local_slice(rank, world_size)
    seen = {}
    for name, wrap in (("ours", BucketedDDP), ("torch", TorchDDP)):
        model = wrap(copy.deepcopy(reference))
        values, tick = [], 0
        for accumulation in (3, 1, 2, 1):
            for micro in range(accumulation):
                x, y = make_batch(tick)
                tick += 1
                with model.no_sync() if micro < accumulation - 1 else contextlib.nullcontext():
                    torch.nn.functional.mse_loss(model(x[local]), y[local]).backward()
                values.append([b.clone() for b in model.module.buffers()])
        seen[name] = values
    for ours, theirs in zip(seen["ours"], seen["torch"], strict=True):
        assert_close(ours, theirs, rtol=0, atol=0)
    return seen["ours"]


def test_per_forward_buffers_match_torch_under_no_sync():
    per_rank = run_distributed(_changing_buffers)
    # Not trivially equal: the running stats differ across ranks between broadcasts.
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(*per_rank, strict=True))


def _buffers_written_differently(rank, world_size):
    torch.manual_seed(0)
    model = Net()
    model.head.register_buffer("extra", torch.zeros(1))
    ddp = BucketedDDP(model)
    model.scale.mul_(1.0)
    if rank == 0:
        model.head.extra.add_(1.0)  # written on rank 0 only: rank 0 sends 2 buffers, rank 1 would send 1
    if rank == 1:
        with pytest.raises(RuntimeError, match=r"rank 1 changed 1 buffer.*\['scale'\]\), rank 0 changed 2"):
            ddp(torch.zeros(2, 16))
        dist.broadcast(torch.empty(33), src=0)  # the buffers rank 0 goes on to send
    else:
        ddp(torch.zeros(2, 16))


def test_buffers_differing_across_ranks_raise():
    run_distributed(_buffers_written_differently)
