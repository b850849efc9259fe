"""One bucket at run time: its flat gradient buffer, each parameter's gradient as a view into it, and readiness.

The memory half of BucketedDDP (its ``Memory`` guarantee): one flat buffer per bucket, ``param.grad`` a view into it
with ``gradient_as_bucket_view`` (re-attached and zeroed in one op per bucket after ``zero_grad(set_to_none=True)``),
and the reduced result put back where the hook returned another tensor or the gradients are not views.
"""

from __future__ import annotations

import torch
from torch import nn

from .comm_hooks import GradBucket


class BucketBuffer:
    """Runtime state of one bucket: its flat buffer, the gradient views into it, and readiness.

    Args:
        index (int): launch-order index.
        buffer (torch.Tensor): the flat buffer, zeroed.
        indices (list[int]): the bucket's parameters' indices in the trainable list, in buffer order.
        params (list[nn.Parameter]): those parameters.
        offsets (list[int]): each parameter's element offset in ``buffer``.
        last (bool): whether this bucket is launched last.
    """

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        indices: list[int],
        params: list[nn.Parameter],
        offsets: list[int],
        last: bool,
    ) -> None:
        self.index = index
        self.buffer = buffer
        self.indices = indices
        self.params = params
        self.views = [buffer[o : o + p.numel()].view_as(p) for p, o in zip(params, offsets, strict=True)]
        self.view_ptrs = [v.data_ptr() for v in self.views]
        self.grad_bucket = GradBucket(index, buffer, params, self.views, last)
        self.pending = len(params)
        self.future: torch.futures.Future | None = None

    def attach_grad_views(self, replaced_none: list[bool] | None) -> None:
        """Make every ``param.grad`` its view, zeroed where the gradient was None (marked in ``replaced_none``,
        by trainable index, if given); the whole buffer is zeroed in one op when every gradient was None."""
        with torch.no_grad():
            grads = [p.grad for p in self.params]
            if all(g is None for g in grads):
                self.buffer.zero_()
                for p, view in zip(self.params, self.views, strict=True):
                    p.grad = view
                if replaced_none is not None:
                    for i in self.indices:
                        replaced_none[i] = True
                return
            for i, p, grad, view, ptr in zip(self.indices, self.params, grads, self.views, self.view_ptrs, strict=True):
                if grad is None:
                    view.zero_()
                    p.grad = view
                    if replaced_none is not None:
                        replaced_none[i] = True
                elif grad.data_ptr() != ptr:
                    view.copy_(grad)
                    p.grad = view

    def wait_reduced(self, rank: int) -> None:
        """Wait for this bucket's launched reduction and put its result in the buffer, if the hook returned another
        tensor (a compressed copy is decompressed by the copy)."""
        try:
            result = self.future.wait()
        except RuntimeError as error:
            raise RuntimeError(
                f"BucketedDDP rank {rank}: the all-reduce of bucket {self.index} failed: another rank failed, was "
                f"killed, or is stuck (a stuck rank is given up on after the process group's timeout, "
                f"--ddp-timeout). {error}"
            ) from error
        if isinstance(result, list | tuple):  # a collective's own future holds its output tensors
            result = result[0]
        if isinstance(result, torch.Tensor) and result.data_ptr() != self.buffer.data_ptr():
            self.buffer.copy_(result.view_as(self.buffer))

    def copy_to_grads(self, unused_everywhere: set[int]) -> None:
        """Without gradient views: write the averaged gradients into ``param.grad``. A parameter no rank used
        (by trainable index, in ``unused_everywhere``) that had no gradient keeps grad None."""
        with torch.no_grad():
            for i, p, view in zip(self.indices, self.params, self.views, strict=True):
                if p.grad is None:
                    if i not in unused_everywhere:
                        p.grad = view.clone()
                else:
                    p.grad.copy_(view)
