"""The rungs of the DDP ladder: one data-parallel wrapper per idea, each a step up from the one before.

Every rung has the same surface, so one loop drives them all::

    for micro in range(accumulation):
        with model.no_sync() if micro < accumulation - 1 else nullcontext():
            loss = model(batch).loss
            loss.backward()
        model.finish()          # after every backward: where the naive rungs communicate or wait
    optimizer.step()

1. :class:`AllReduceAfterBackward`: every backward, each gradient all-reduced on its own, blocking. Ignores
   ``no_sync``, so gradient accumulation pays the communication on every micro-step.
2. :class:`AccumulateThenAllReduce`: the same, on the last micro-step only (``no_sync`` honoured).
3. :class:`BlockingHooks`: each gradient all-reduced, blocking, from its own hook as soon as backward produces it.
4. :class:`AsyncHooks`: the same launched asynchronously; :meth:`~Rung.finish` waits for all of them.
5. :class:`HookOrderBuckets`: gradients packed into buckets in hook-firing order, each full bucket launched
   asynchronously. If two ranks fire in different orders, buckets pair different parameters and the average is
   silently wrong (``tests/tools/test_ladder.py``). Rungs 3 and 4 pair by firing order too.
6. :class:`TorchDDP`: ``torch.nn.parallel.DistributedDataParallel``.
7. :class:`Bucketed`: :class:`ddp_ft.ddp.BucketedDDP`: buckets fixed in reverse registration order and checked
   across ranks, launched in index order from the gradient hooks, overlapping backward.

Rungs 1 to 5 are plain Python over ``torch.distributed``, written to be read. Every collective is recorded on the
rung's :class:`~.timeline.Timeline`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ...ddp import BucketedDDP
from ...ddp.buckets import MB
from ...ddp.comm_hooks import allreduce_hook
from .timeline import Timeline


def all_reduce_mean(tensor: torch.Tensor, timeline: Timeline, blocking: bool) -> torch.futures.Future:
    """Average ``tensor`` across ranks in place and record it; return the future."""
    if dist.get_backend() == "nccl":
        work = dist.all_reduce(tensor, op=dist.ReduceOp.AVG, async_op=True)
    else:
        tensor.div_(dist.get_world_size())
        work = dist.all_reduce(tensor, async_op=True)
    return _timed(work.get_future(), timeline, tensor.nbytes, blocking)


def _timed(future: torch.futures.Future, timeline: Timeline, nbytes: int, blocking: bool) -> torch.futures.Future:
    started = timeline.launched(nbytes)

    def done(fut: torch.futures.Future):
        timeline.completed(started)
        value = fut.value()
        return value[0] if isinstance(value, list) else value

    timed = future.then(done)
    if blocking:
        wait(timed, timeline)
    return timed


def wait(future: torch.futures.Future, timeline: Timeline) -> None:
    """Wait for ``future`` on the training thread, recording the wait as blocked time."""
    begin = time.perf_counter()
    future.wait()
    timeline.blocked(begin)


class Rung(nn.Module):
    """The surface every rung shares: ``forward``, ``no_sync()``, ``finish()`` after each backward.

    Parameters and buffers start from rank 0's values (a broadcast at construction), as in torch DDP.
    """

    title = ""

    def __init__(self, module: nn.Module, timeline: Timeline) -> None:
        super().__init__()
        self.module = module
        self.timeline = timeline
        self.require_backward_grad_sync = True
        self.syncing = True  # whether the latest forward's backward communicates
        self.params = [p for p in module.parameters() if p.requires_grad]
        if dist.get_world_size() > 1:
            with torch.no_grad():
                for tensor in [*self.params, *module.buffers()]:
                    dist.broadcast(tensor, src=0)

    def forward(self, *args, **kwargs):
        self.syncing = self.require_backward_grad_sync
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def finish(self) -> None:
        """Called after every backward. Rungs that communicate after backward do it here."""


class AllReduceAfterBackward(Rung):
    title = "per-parameter all-reduce after backward"

    def finish(self) -> None:
        for p in self.params:  # every micro-step: no_sync is not honoured
            all_reduce_mean(p.grad, self.timeline, blocking=True)


class AccumulateThenAllReduce(Rung):
    title = "+ gradient accumulation (sync on the last micro-step only)"

    def finish(self) -> None:
        if self.syncing:
            for p in self.params:
                all_reduce_mean(p.grad, self.timeline, blocking=True)


class BlockingHooks(Rung):
    title = "per-parameter hooks, blocking"

    def __init__(self, module: nn.Module, timeline: Timeline) -> None:
        super().__init__(module, timeline)
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]

    def _ready(self, param: nn.Parameter) -> None:
        if self.syncing:
            all_reduce_mean(param.grad, self.timeline, blocking=True)


class AsyncHooks(BlockingHooks):
    title = "per-parameter hooks, async"

    def __init__(self, module: nn.Module, timeline: Timeline) -> None:
        super().__init__(module, timeline)
        self.pending: list[torch.futures.Future] = []

    def _ready(self, param: nn.Parameter) -> None:
        if self.syncing:
            self.pending.append(all_reduce_mean(param.grad, self.timeline, blocking=False))

    def finish(self) -> None:
        for future in self.pending:
            wait(future, self.timeline)
        self.pending = []


class HookOrderBuckets(BlockingHooks):
    """Buckets packed in hook-firing order, each launched when full; :meth:`finish` sends the last one."""

    title = "buckets filled in hook-firing order, async"

    def __init__(
        self, module: nn.Module, timeline: Timeline, bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0
    ) -> None:
        super().__init__(module, timeline)
        self.caps = (first_bucket_cap_mb * MB, bucket_cap_mb * MB)
        self.open: list[nn.Parameter] = []
        self.launched: list[tuple[torch.futures.Future, list[nn.Parameter]]] = []

    def _ready(self, param: nn.Parameter) -> None:
        if not self.syncing:
            return
        self.open.append(param)
        cap = self.caps[0] if not self.launched else self.caps[1]
        if sum(p.grad.nbytes for p in self.open) >= cap:
            self._launch()

    def _launch(self) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in self.open])
        self.launched.append((all_reduce_mean(flat, self.timeline, blocking=False), self.open))
        self.open = []

    def finish(self) -> None:
        if not self.syncing:
            return
        if self.open:
            self._launch()
        for future, params in self.launched:
            wait(future, self.timeline)
            flat, offset = future.value(), 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.launched = []


def timed_allreduce_hook(timeline: Timeline, bucket):
    """A comm hook for both DDPs: the default average, recorded on ``timeline``.

    It has no return annotation, since torch DDP refuses a string one.
    """
    buffer = bucket.buffer()
    future = allreduce_hook(None, bucket)
    return _timed(future, timeline, buffer.nbytes, blocking=False)


class _WrappedDDP(Rung):
    """A DDP class as a rung; :meth:`finish` records the exposed wait inside ``backward()``."""

    def __init__(self, ddp: nn.Module, timeline: Timeline) -> None:
        nn.Module.__init__(self)
        self.module, self.timeline, self.syncing = ddp, timeline, True
        self.params = [p for p in ddp.parameters() if p.requires_grad]
        ddp.register_comm_hook(timeline, timed_allreduce_hook)
        self.last_gradient = 0.0
        self.handles = [p.register_post_accumulate_grad_hook(self._stamp) for p in self.params]

    def _stamp(self, param: nn.Parameter) -> None:
        self.last_gradient = time.perf_counter()

    def forward(self, *args, **kwargs):
        self.syncing = self.module.require_backward_grad_sync
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.module.no_sync():
            yield

    def finish(self) -> None:
        if self.syncing:
            self.timeline.blocked(self.last_gradient)


class TorchDDP(_WrappedDDP):
    title = "torch DDP"

    def __init__(
        self, module: nn.Module, timeline: Timeline, bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0
    ) -> None:
        device_ids = [module.device.index] if getattr(module, "device", torch.device("cpu")).type == "cuda" else None
        # torch DDP's first bucket is 1 MiB unless bucket_cap_mb is given. Passing the cap only when it is not the
        # default keeps the two DDPs' layouts alike.
        caps = {} if (bucket_cap_mb, first_bucket_cap_mb) == (25.0, 1.0) else {"bucket_cap_mb": bucket_cap_mb}
        super().__init__(DistributedDataParallel(module, device_ids=device_ids, **caps), timeline)


class Bucketed(_WrappedDDP):
    title = "BucketedDDP (ddp_ft)"

    def __init__(
        self, module: nn.Module, timeline: Timeline, bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0
    ) -> None:
        super().__init__(
            BucketedDDP(module, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb), timeline
        )


RUNGS: dict[str, type[Rung]] = {
    "after_backward": AllReduceAfterBackward,
    "accumulate": AccumulateThenAllReduce,
    "hooks_blocking": BlockingHooks,
    "hooks_async": AsyncHooks,
    "hook_order_buckets": HookOrderBuckets,
    "torch_ddp": TorchDDP,
    "bucketed_ddp": Bucketed,
}
"""The rungs in ladder order, by the name the command line and the JSON use."""

BUCKETED_RUNGS = ("hook_order_buckets", "torch_ddp", "bucketed_ddp")
"""The rungs that take ``bucket_cap_mb`` and ``first_bucket_cap_mb``."""


def build_rung(name: str, module: nn.Module, timeline: Timeline, **caps: float) -> Rung:
    """Rung ``name`` around ``module``; ``caps`` (bucket_cap_mb, first_bucket_cap_mb) go to the bucketed ones."""
    cls = RUNGS[name]
    return cls(module, timeline, **caps) if name in BUCKETED_RUNGS else cls(module, timeline)


def accumulate(model: Rung, micro_batches: Sequence, loss_of: Callable[[Rung, object], torch.Tensor]) -> float:
    """One optimizer step's gradients, all but the last micro-batch under ``no_sync``; returns the loss."""
    total = 0.0
    for i, batch in enumerate(micro_batches):
        with model.no_sync() if i < len(micro_batches) - 1 else nullcontext():
            loss = loss_of(model, batch) / len(micro_batches)
            loss.backward()
        model.finish()
        total += loss.item()
    return total
