"""Communication hooks for BucketedDDP, with torch DDP's shape: ``hook(state, bucket) -> Future[Tensor]``.

:class:`GradBucket` has torch's ``dist.GradBucket`` methods, so torch DDP's hooks work unchanged.
Annotations are objects, not strings, because torch DDP's ``register_comm_hook`` compares them.
"""

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks

CommHook = Callable[[object, "GradBucket"], torch.futures.Future]


class GradBucket:
    """One bucket as a comm hook sees it: a flat gradient buffer and its parameters.

    Args:
        index (int): launch-order index.
        buffer (torch.Tensor): the flat gradient buffer.
        parameters (list[torch.Tensor]): the parameters, in buffer order.
        views (list[torch.Tensor]): each parameter's gradient as a view into ``buffer``.
        is_last (bool): whether this bucket launches last.
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
        """Each parameter's gradient as a view into the current :meth:`buffer`, as in torch's ``GradBucket``."""
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
        """Replace the tensor :meth:`buffer` returns; the result is copied back into the flat buffer."""
        self._buffer = tensor

    def reset_buffer(self) -> None:
        """Point :meth:`buffer` back at the flat gradient buffer."""
        self._buffer = self._flat


def _group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return process_group if process_group is not None else dist.group.WORLD


def _result(bucket: dist.GradBucket, future: torch.futures.Future) -> torch.futures.Future[torch.Tensor]:
    """The hook's future: raw for BucketedDDP, which unpacks after the wait; else unpacked by a callback."""
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
    """Average the bucket across ranks; the default.

    gloo has no AVG, so it divides first, as torch's reducer does, keeping 16-bit sums from overflowing.

    Example:
        >>> model.register_comm_hook(None, allreduce_hook)
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
    """Divide the bucket by ``state[1]``, then sum it over ``state[0]``.

    Join's average over the ranks still training; NCCL's AVG would divide by the group's size.
    """
    process_group, divisor = state
    buffer = bucket.buffer()
    buffer.div_(divisor)
    return _result(bucket, dist.all_reduce(buffer, group=_group(process_group), async_op=True).get_future())


def bf16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average in bfloat16: half the bytes on the wire, 8 bits of mantissa."""
    return _compress_hook(torch.bfloat16, process_group, bucket)


def fp16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average in float16, dividing before the sum against overflow."""
    return _compress_hook(torch.float16, process_group, bucket)


def _compress_hook(
    dtype: torch.dtype, process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Sum ``bucket``'s buffer across ranks, cast to ``dtype`` and divided by the world size first."""
    group = _group(process_group)
    compressed = bucket.buffer().to(dtype).div_(dist.get_world_size(group))
    return _result(bucket, dist.all_reduce(compressed, group=group, async_op=True).get_future())


COMM_HOOKS: dict[str, CommHook] = {
    "allreduce": allreduce_hook,
    "bf16": bf16_compress_hook,
    "fp16": fp16_compress_hook,
}
"""Built-in hooks by the name settings use (``comm_hook: bf16``)."""


# The dtype each known compress hook sends; others send the buffer's dtype.
_WIRE_DTYPES: tuple[tuple[CommHook, torch.dtype], ...] = (
    (bf16_compress_hook, torch.bfloat16),
    (fp16_compress_hook, torch.float16),
    (torch_hooks.bf16_compress_hook, torch.bfloat16),
    (torch_hooks.fp16_compress_hook, torch.float16),
)


def wire_dtype(hook: CommHook, buffer_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``hook`` sends, for byte counting; hooks are matched by identity."""
    return next((dtype for known, dtype in _WIRE_DTYPES if known is hook), buffer_dtype)


def check_powersgd_buckets(
    bucket_sizes: list[int], process_group: dist.ProcessGroup | None, setting: str, one_bucket: str
) -> None:
    """Refuse torch's PowerSGD with several buckets off NCCL, where its all-reduces can go out of order.

    PowerSGD launches later all-reduces from future callbacks, which gloo runs on its own thread.

    Args:
        bucket_sizes (list[int]): elements per bucket.
        process_group (ProcessGroup | None): the wrapper's group.
        setting (str): how the user asked for PowerSGD, named in the error.
        one_bucket (str): the settings that give one bucket, with ``{mb}`` for the cap.

    Raises:
        ValueError: for several buckets on a backend other than NCCL.
    """
    backend = dist.get_backend(_group(process_group))
    if len(bucket_sizes) > 1 and backend != "nccl":
        mb = f"{math.ceil(sum(bucket_sizes) * 4 / 2**20 * 100) / 100:.2f}"  # rounded up to hold them all
        raise ValueError(
            f"{setting} on {backend} with {len(bucket_sizes)} buckets: PowerSGD launches its later all-reduces from "
            "callbacks, which gloo runs on its own thread, so with several buckets their order can differ across "
            f"ranks and the run hangs. Use one bucket ({one_bucket.format(mb=mb)}) or NCCL."
        )
