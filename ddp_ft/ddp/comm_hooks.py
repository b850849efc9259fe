"""Communication hooks for BucketedDDP, with torch DDP's shape: ``hook(state, bucket) -> Future[Tensor]``.

``state`` is the process group (or None for the default group), ``bucket`` a :class:`GradBucket`
offering the methods torch's ``dist.GradBucket`` offers (``buffer()``, ``index()``, ``is_last()``,
``gradients()``, ``parameters()``, ``set_buffer()``), so hooks written for torch DDP, such as
``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook``, work unchanged. The
future's value is the averaged flat gradient; BucketedDDP copies it into the bucket if it is another
tensor.

The hooks carry torch's own annotations (``bucket: dist.GradBucket``, ``-> torch.futures.Future[torch.Tensor]``) as
objects, not strings (no ``from __future__ import annotations`` here): torch DDP's ``register_comm_hook`` compares
them and refuses anything else, so each of ours registers on torch DDP too. BucketedDDP hands them its own
:class:`GradBucket`, which has the same methods.
"""

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks

CommHook = Callable[[object, "GradBucket"], torch.futures.Future]


class GradBucket:
    """One bucket as a comm hook sees it: a flat gradient buffer and the parameters it holds.

    Args:
        index (int): launch-order index.
        buffer (torch.Tensor): the flat gradient buffer.
        parameters (list[torch.Tensor]): the parameters laid out in the buffer, in buffer order.
        views (list[torch.Tensor]): each parameter's gradient as a view into ``buffer``.
        is_last (bool): whether this is the last bucket launched in a backward.
    """

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        parameters: list[torch.Tensor],
        views: list[torch.Tensor],
        is_last: bool,
    ) -> None:
        self._index = index
        self._flat = self._buffer = buffer
        self._parameters = parameters
        self._views = views
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient as a view into :meth:`buffer`: after :meth:`set_buffer`, into the new tensor,
        as torch's ``GradBucket`` slices its current buffer (PowerSGD inside torch's compress wrappers compresses
        these 16-bit views)."""
        if self._buffer is self._flat:
            return self._views
        base = self._flat.storage_offset()
        return [
            self._buffer[v.storage_offset() - base : v.storage_offset() - base + v.numel()].view(v.shape)
            for v in self._views
        ]

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the tensor :meth:`buffer` returns, as torch's reducer does (torch's compress wrappers hand it a
        16-bit copy and reduce that). The bucket's own flat buffer is untouched; the hook's result is copied into
        it after the wait, converting the dtype."""
        self._buffer = tensor

    def reset_buffer(self) -> None:
        """Point :meth:`buffer` back at the bucket's flat gradient buffer (before each launch)."""
        self._buffer = self._flat


def _group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return process_group if process_group is not None else dist.group.WORLD


def _result(bucket: dist.GradBucket, future: torch.futures.Future) -> torch.futures.Future[torch.Tensor]:
    """The hook's future for whoever called it. BucketedDDP takes the collective's own future (its value is
    ``[tensor]``) and unpacks and decompresses it after the wait, so no Python runs on the communication thread;
    torch's reducer wants a future of the bucket's tensor, so there a callback unpacks it into ``bucket.buffer()``,
    as torch's own hooks do."""
    if isinstance(bucket, GradBucket):
        return future
    buffer = bucket.buffer()

    def into_buffer(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        return reduced if reduced.data_ptr() == buffer.data_ptr() else buffer.copy_(reduced)

    return future.then(into_buffer)


def allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across ranks (the default).

    NCCL averages natively (``ReduceOp.AVG``). gloo has no AVG: the buffer is divided by the world size, then
    summed, as torch DDP's reducer does; dividing first keeps 16-bit sums from overflowing. Under BucketedDDP no
    Python runs on the communication thread: the future is the collective's own (its value is ``[buffer]``).
    """
    group = _group(process_group)
    buffer = bucket.buffer()
    if dist.get_backend(group) == "nccl":
        return _result(bucket, dist.all_reduce(buffer, op=dist.ReduceOp.AVG, group=group, async_op=True).get_future())
    buffer.div_(dist.get_world_size(group))
    return _result(bucket, dist.all_reduce(buffer, group=group, async_op=True).get_future())


def allreduce_divided_hook(
    state: tuple[dist.ProcessGroup | None, int], bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Divide the bucket by ``state[1]``, then sum it over ``state[0]``: the default averaging of a join whose
    ``divide_by_initial_world_size`` is False, over the ranks still training (the joined ones send zeros), as torch
    DDP's reducer divides by that count before its sum. A sum on NCCL too (its AVG would divide by the group's size).
    """
    process_group, divisor = state
    buffer = bucket.buffer()
    buffer.div_(divisor)
    return _result(bucket, dist.all_reduce(buffer, group=_group(process_group), async_op=True).get_future())


def bf16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average in bfloat16: half the bytes on the wire, bf16 precision (8 bits of mantissa)."""
    return _compress_hook(torch.bfloat16, process_group, bucket)


def fp16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average in float16: half the bytes on the wire; divides before the sum against overflow."""
    return _compress_hook(torch.float16, process_group, bucket)


def _compress_hook(
    dtype: torch.dtype, process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Sum ``bucket``'s buffer, cast to ``dtype`` and divided by the world size, across ranks.

    Under BucketedDDP the future's value is ``[compressed]``, copied back into the buffer (decompressing) after the
    wait, so no Python runs on the communication thread; under torch DDP a callback does that copy.
    """
    group = _group(process_group)
    compressed = bucket.buffer().to(dtype).div_(dist.get_world_size(group))
    return _result(bucket, dist.all_reduce(compressed, group=group, async_op=True).get_future())


COMM_HOOKS: dict[str, CommHook] = {
    "allreduce": allreduce_hook,
    "bf16": bf16_compress_hook,
    "fp16": fp16_compress_hook,
}
"""Built-in hooks by the name settings use (``comm_hook: bf16``)."""


# The dtype each known hook sends (ours and torch's compress hooks); any other hook sends the buffer's dtype.
_WIRE_DTYPES: tuple[tuple[CommHook, torch.dtype], ...] = (
    (bf16_compress_hook, torch.bfloat16),
    (fp16_compress_hook, torch.float16),
    (torch_hooks.bf16_compress_hook, torch.bfloat16),
    (torch_hooks.fp16_compress_hook, torch.float16),
)


def wire_dtype(hook: CommHook, buffer_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``hook`` sends, for byte counting: bf16 or fp16 for the compress hooks (ours and torch's
    ``default_hooks``), else the buffer's dtype. Matched by identity, so any callable is accepted."""
    return next((dtype for known, dtype in _WIRE_DTYPES if known is hook), buffer_dtype)


def check_powersgd_buckets(
    bucket_sizes: list[int], process_group: dist.ProcessGroup | None, setting: str, one_bucket: str
) -> None:
    """Refuse torch's PowerSGD where its all-reduces can go out of order across ranks: several buckets off NCCL.

    PowerSGD launches its later all-reduces (P, then Q) from future callbacks, which gloo runs on its own thread, so
    with several buckets one rank can launch bucket 1's first all-reduce before bucket 0's second while another does
    the opposite. Seen: a 2-bucket tiny run hung at its 4th step; 1 bucket trained to the end.

    Args:
        bucket_sizes (list[int]): elements per bucket (``BucketedDDP.bucket_sizes``).
        process_group (ProcessGroup | None): the wrapper's group.
        setting (str): how the user asked for PowerSGD, named in the error.
        one_bucket (str): the settings that give one bucket, with ``{mb}`` for the cap that holds every gradient.

    Raises:
        ValueError: several buckets on a backend other than NCCL.
    """
    backend = dist.get_backend(_group(process_group))
    if len(bucket_sizes) > 1 and backend != "nccl":
        mb = f"{math.ceil(sum(bucket_sizes) * 4 / 2**20 * 100) / 100:.2f}"  # rounded up: a cap that holds them all
        raise ValueError(
            f"{setting} on {backend} with {len(bucket_sizes)} buckets: PowerSGD launches its later all-reduces from "
            "callbacks, which gloo runs on its own thread, so with several buckets their order can differ across "
            f"ranks and the run hangs. Use one bucket ({one_bucket.format(mb=mb)}) or NCCL."
        )
