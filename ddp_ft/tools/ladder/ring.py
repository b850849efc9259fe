"""The two-phase ring all-reduce, written out with point-to-point sends, and a comm hook that uses it.

The tensor is cut into N chunks (N ranks, ``torch.tensor_split``: sizes differ by at most one element, and some are
empty when the tensor has fewer than N elements). Ranks form a ring, each sending to ``rank + 1`` and receiving from
``rank - 1``:

1. reduce-scatter, N-1 steps: at step s rank r sends chunk ``r - s`` and adds the chunk ``r - s - 1`` it receives into
   its own copy. After the last step rank r holds chunk ``r + 1`` summed over all ranks.
2. all-gather, N-1 steps: at step s rank r sends chunk ``r + 1 - s`` (reduced) and overwrites chunk ``r - s`` with
   the one it receives. Afterwards every rank holds every reduced chunk.

Each rank sends every chunk but one in each phase: 2(N-1)/N of the tensor, however many ranks there are, which is
what makes the ring bandwidth-optimal (docs/performance.md). Every index is taken modulo N.

:func:`ring_all_reduce` is the algorithm, in place, with the sum; :class:`RingAllreduce` and
:func:`ring_allreduce_hook` make it a comm hook (averaging) for BucketedDDP and torch DDP alike.
"""

# No ``from __future__ import annotations``: torch DDP's register_comm_hook compares the hook's return annotation with
# ``torch.futures.Future[torch.Tensor]`` itself and refuses a string.
import queue
import threading
import weakref

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """Sum ``tensor`` over the ranks of ``group`` in place, by reduce-scatter then all-gather around a ring.

    Every rank of ``group`` must call it with a tensor of the same shape and dtype. The result equals
    ``dist.all_reduce(tensor, group=group)`` up to the order of the additions: bitwise for two ranks (a + b is b + a)
    and for integers, within rounding otherwise.

    Args:
        tensor (torch.Tensor): this rank's contribution; holds the sum on return. Need not be contiguous.
        group (ProcessGroup | None): the ranks to reduce over. Default: None, the default group.

    Returns:
        int: the bytes this rank sent.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return 0
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
    """Send ``out`` to the next rank while receiving ``into`` from the previous one; return the bytes sent.

    Both ops are posted before either is waited on, so two ranks that are each other's next and previous (N = 2) do
    not wait on each other. An empty chunk is skipped on both sides: its sender and receiver compute the same index.
    """
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
    """The state of :func:`ring_allreduce_hook`: a process group of its own, a worker, and what it sent.

    The constructor creates a process group over the ranks of ``process_group`` with its backend, so the rings never
    interleave with collectives on the group the model uses; like ``dist.new_group``, every rank of the default group
    must construct it, in the same order.

    With gloo the rings run on one worker thread, in submission order, so the hook returns at once and communication
    overlaps the rest of the backward; since every rank submits buckets in the same order, every rank runs the same
    ring at the same time. With NCCL the hook runs the ring on the calling thread: the point-to-point ops are
    already asynchronous on the GPU. The worker is a daemon thread; :meth:`shutdown` (or leaving a ``with`` block)
    stops it once queued rings are done, and it is stopped at interpreter exit if still running.

    Args:
        process_group (ProcessGroup | None): whose ranks and backend to use. Default: None, the default group.

    Attributes:
        group (ProcessGroup): the rings' own group.
        bytes_sent (int): bytes this rank sent in all rings so far.
        calls (int): rings run so far (one per bucket per synced backward).
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
    """Comm hook: average the bucket across ranks by :func:`ring_all_reduce` on ``state.group``.

    Register it as ``model.register_comm_hook(RingAllreduce(), ring_allreduce_hook)`` on BucketedDDP or on torch's
    DistributedDataParallel. The buffer is divided by the world size and then summed, as the default hook does on
    gloo. The future's value is the bucket's buffer, reduced in place.
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
    """The worker: run each submitted ring in turn until the stop sentinel (None). Holds no reference to the state
    between jobs, so a state nobody uses can be freed (which stops the worker)."""
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
