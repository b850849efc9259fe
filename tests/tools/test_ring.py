"""The ring all-reduce against the backend's all-reduce, its bytes on the wire, and the ring as a comm hook of
BucketedDDP and torch DDP against torch DDP's default: one launch of real gloo processes per world size."""

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp_ft.ddp import BucketedDDP
from ddp_ft.tools.ladder.ring import RingAllreduce, ring_all_reduce, ring_allreduce_hook

from ..helpers.dist_harness import run_distributed
from ..helpers.models import Net, local_slice, make_batch

pytestmark = pytest.mark.distributed

# numel divisible by every world size tested (12), not divisible (13, 1001), below it (1, 2), empty; and shapes
SHAPES = [(12,), (13,), (1,), (2,), (0,), (7, 11), (3, 4, 5)]


def expected_bytes(numel: int, itemsize: int, rank: int, world: int) -> int:
    """What rank ``rank`` must send: every chunk but ``rank + 1`` in the reduce-scatter (it ends up owning that one),
    every chunk but ``rank + 2`` in the all-gather (its predecessor owns it and sends it round)."""
    sizes = [c.numel() for c in torch.empty(numel).tensor_split(world)]
    return itemsize * (2 * numel - sizes[(rank + 1) % world] - sizes[(rank + 2) % world])


def _contribution(shape, dtype, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * seed + rank)
    if dtype is torch.int64:
        return torch.randint(-1000, 1000, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def _check_against_backend(rank: int, world: int) -> None:
    for seed, shape in enumerate(SHAPES):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            mine = _contribution(shape, dtype, rank, seed)
            ring, backend = mine.clone(), mine.clone()
            sent = ring_all_reduce(ring)
            dist.all_reduce(backend)
            where = f"shape {shape}, {dtype}, rank {rank} of {world}"
            assert sent == expected_bytes(mine.numel(), mine.element_size(), rank, world), where
            if mine.numel() % world == 0:
                assert sent == 2 * (world - 1) * mine.nbytes // world, where
            if dtype is torch.int64 or (dtype is torch.float32 and world == 2):
                # integers add exactly in any order, and a + b is b + a: bitwise
                assert torch.equal(ring, backend), where
                continue
            # Each of the N-1 additions rounds by at most half an ulp of its partial sum (at most S, the sum of the
            # magnitudes): within (N-1) eps/2 S of the exact sum, so two summation orders differ by at most
            # (N-1) eps S; eps is 2**-7 for bf16 (8 significant bits), 2**-23 for float32. A dropped or doubled
            # contribution is off by a whole term, far outside it.
            eps = torch.finfo(dtype).eps
            terms = [_contribution(shape, dtype, r, seed).double() for r in range(world)]
            bound = (world - 1) * eps * sum(t.abs() for t in terms)
            assert ((ring.double() - backend.double()).abs() <= bound).all(), where
            assert ((ring.double() - sum(terms)).abs() <= bound / 2).all(), where

    # a non-contiguous tensor is reduced through a contiguous copy and written back into it
    ring = _contribution((7, 11), torch.int64, rank, 99).t().clone()
    backend = ring.clone()
    assert not ring.is_contiguous()
    ring_all_reduce(ring)
    dist.all_reduce(backend)
    assert torch.equal(ring, backend)


def _check_shutdown(rank: int, world: int) -> None:
    state = RingAllreduce()
    buffer = torch.full((5,), float(rank))
    assert state.submit(buffer).wait() is buffer
    torch.testing.assert_close(buffer, torch.full((5,), (world - 1) / 2))  # the average of 0..N-1
    state.shutdown()
    state.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        state.submit(buffer)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def _train_and_collect(model: nn.Module, rank: int, world: int) -> list[list[torch.Tensor]]:
    """Two optimizer steps of two micro-batches (the first under no_sync); the gradients after each synced
    backward. No optimizer: the weights stay put, so every step compares the reductions alone."""
    seen = []
    for step in range(2):
        for micro in range(2):
            x, y = make_batch(2 * step + micro, global_batch=4 * world)
            part = local_slice(rank, world, global_batch=4 * world)
            with model.no_sync() if micro == 0 else nullcontext():
                nn.functional.mse_loss(model(x[part]), y[part]).backward()
        seen.append(_grads(model))
        model.zero_grad(set_to_none=True)
    return seen


def _check_as_comm_hook(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    net = Net()
    reference = _train_and_collect(TorchDDP(copy.deepcopy(net)), rank, world)
    tiny = 2048 / 2**20  # a few hundred parameters per bucket: several buckets in flight on the worker at once
    ours = BucketedDDP(copy.deepcopy(net), bucket_cap_mb=tiny, first_bucket_cap_mb=tiny)
    theirs = TorchDDP(copy.deepcopy(net), bucket_cap_mb=tiny)
    with RingAllreduce() as ours_state, RingAllreduce() as theirs_state:
        ours.register_comm_hook(ours_state, ring_allreduce_hook)
        theirs.register_comm_hook(theirs_state, ring_allreduce_hook)
        got = {
            "bucketed_ddp": _train_and_collect(ours, rank, world),
            "torch_ddp": _train_and_collect(theirs, rank, world),
        }
    for name, grads in got.items():
        for step, (mine, want) in enumerate(zip(grads, reference, strict=True)):
            torch.testing.assert_close(mine, want, msg=lambda m, name=name, step=step: f"{name} step {step}: {m}")
    synced = 2  # optimizer steps; no ring under no_sync
    return {
        "buckets": len(ours.bucket_sizes),
        "calls": ours_state.calls,
        "bytes_sent": ours_state.bytes_sent,
        "expected_bytes": synced * sum(expected_bytes(n, 4, rank, world) for n in ours.bucket_sizes),
    }


def _ring_everything(rank: int, world: int) -> dict:
    _check_against_backend(rank, world)
    _check_shutdown(rank, world)
    return _check_as_comm_hook(rank, world)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_matches_backend_and_torch_ddp_buckets(world_size):
    for result in run_distributed(_ring_everything, world_size=world_size):
        assert result["buckets"] >= 3
        assert result["calls"] == 2 * result["buckets"]  # one ring per bucket per synced backward, none in no_sync
        assert result["bytes_sent"] == result["expected_bytes"]
