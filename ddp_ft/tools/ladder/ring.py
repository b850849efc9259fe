"""The two-phase ring all-reduce, written out with point-to-point sends, and a comm hook that uses it.

The tensor is cut into N chunks, and each rank sends to ``rank + 1``. Indices are taken modulo N.

1. reduce-scatter, N-1 steps: at step s rank r sends chunk ``r - s`` and adds the chunk ``r - s - 1`` it receives.
   Rank r then holds chunk ``r + 1`` summed over all ranks.
2. all-gather, N-1 steps: at step s rank r sends chunk ``r + 1 - s`` and overwrites chunk ``r - s`` with the one
   it receives. Every rank then holds every reduced chunk.

Each rank sends 2(N-1)/N of the tensor, which makes the ring bandwidth-optimal (docs/performance.md).
"""

# No ``from __future__ import annotations``: torch DDP refuses a hook whose return annotation is a string.
import queue
import threading
import weakref

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """Sum ``tensor`` over the ranks of ``group`` in place around a ring.

    Every rank must call it with the same shape and dtype. It matches ``dist.all_reduce`` up to rounding.

    Args:
        tensor (torch.Tensor): this rank's contribution; holds the sum on return.
        group (ProcessGroup | None): the ranks to reduce over. Default: the default group.

    Returns:
        int: the bytes this rank sent.

    Example:
        >>> sent = ring_all_reduce(torch.ones(8))
    """
    world = dist.get_world_size(group)
    if world == 1:
        return 0
    if tensor.is_cuda and dist.get_backend(group) == dist.Backend.GLOO:
        # gloo's send and recv read host memory only (a device pointer fails in writev); its all_reduce copies CUDA
        # tensors through the host itself, so the ring does the same
        host = tensor.cpu()
        sent = ring_all_reduce(host, group)
        tensor.copy_(host)
        return sent
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    rank = dist.get_rank(group)
    next_peer, prev_peer = _global_rank(group, (rank + 1) % world), _global_rank(group, (rank - 1) % world)
    chunks = flat.tensor_split(world)
    received = torch.empty_like(chunks[0])  # the first chunk is the largest
    sent = 0
    for step in range(world - 1):
        out, into = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        sent += _exchange(out, received[: into.numel()], next_peer, prev_peer, group)
        into.add_(received[: into.numel()])
    for step in range(world - 1):
        out, into = chunks[(rank + 1 - step) % world], chunks[(rank - step) % world]
        sent += _exchange(out, into, next_peer, prev_peer, group)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return sent


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """Point-to-point ops name peers by their rank in the default group."""
    return group_rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, group_rank)


def _exchange(
    out: torch.Tensor, into: torch.Tensor, next_peer: int, prev_peer: int, group: dist.ProcessGroup | None
) -> int:
    """Send ``out`` and receive ``into`` at once, so two ranks cannot deadlock."""
    ops = []
    if out.numel():
        ops.append(dist.P2POp(dist.isend, out, next_peer, group))
    if into.numel():
        ops.append(dist.P2POp(dist.irecv, into, prev_peer, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out.nbytes


class RingAllreduce:
    """The state of :func:`ring_allreduce_hook`: its own process group, a worker, and what it sent.

    Every rank must construct it in the same order, as with ``dist.new_group``.
    On gloo a worker thread runs the rings, so communication overlaps backward.
    On NCCL the calling thread runs them, since the GPU ops are asynchronous.

    Args:
        process_group (ProcessGroup | None): whose ranks and backend to use. Default: the default group.

    Attributes:
        group (ProcessGroup): the rings' own group.
        bytes_sent (int): bytes this rank sent so far.
        calls (int): rings run so far.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        parent = process_group if process_group is not None else dist.group.WORLD
        self.backend = dist.get_backend(parent)
        self.group = dist.new_group(ranks=dist.get_process_group_ranks(parent), backend=self.backend)
        self.world_size = dist.get_world_size(self.group)
        self.bytes_sent = 0
        self.calls = 0
        self._queue: queue.SimpleQueue | None = None
        if self.backend != "nccl":
            self._queue = queue.SimpleQueue()
            worker = threading.Thread(target=_serve, args=(self._queue,), name="ddp_ft-ring", daemon=True)
            worker.start()
            self._stop = weakref.finalize(self, _stop_worker, self._queue, worker)

    def submit(self, buffer: torch.Tensor) -> torch.futures.Future:
        """Average ``buffer`` in place by a ring; the future's value is ``buffer``."""
        future: torch.futures.Future = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        if self._queue is None:
            _run(self, buffer, future)
        elif not self._stop.alive:
            raise RuntimeError("RingAllreduce: the worker is shut down; create a new state to reduce again")
        else:
            self._queue.put((weakref.ref(self), buffer, future))
        return future

    def shutdown(self) -> None:
        """Stop the worker after the rings already submitted. Idempotent; no-op on NCCL."""
        if self._queue is not None:
            self._stop()

    def __enter__(self) -> "RingAllreduce":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def ring_allreduce_hook(state: RingAllreduce, bucket) -> torch.futures.Future[torch.Tensor]:
    """Comm hook: average the bucket across ranks by :func:`ring_all_reduce`.

    Args:
        state (RingAllreduce): the hook's state.
        bucket (GradBucket): the bucket to average.

    Returns:
        torch.futures.Future[torch.Tensor]: the bucket's buffer, averaged in place.

    Example:
        >>> model.register_comm_hook(RingAllreduce(), ring_allreduce_hook)
    """
    return state.submit(bucket.buffer())


def _run(state: RingAllreduce, buffer: torch.Tensor, future: torch.futures.Future) -> None:
    try:
        buffer.div_(state.world_size)
        state.bytes_sent += ring_all_reduce(buffer, state.group)
        state.calls += 1
    except Exception as error:  # the waiter re-raises it
        future.set_exception(error)
    else:
        future.set_result(buffer)


def _serve(jobs: queue.SimpleQueue) -> None:
    """Run submitted rings until None; hold no state between jobs so it can be freed."""
    while (job := jobs.get()) is not None:
        state_ref, buffer, future = job
        state = state_ref()
        if state is None:
            future.set_exception(RuntimeError("RingAllreduce: the state was freed before its ring ran"))
        else:
            _run(state, buffer, future)
        del job, state, state_ref, buffer, future


def _stop_worker(jobs: queue.SimpleQueue, worker: threading.Thread) -> None:
    jobs.put(None)
    if worker is not threading.current_thread():
        worker.join()
