"""One bucket at run time: its flat gradient buffer, the gradient views into it, and readiness."""

from __future__ import annotations

import torch
from torch import nn

from .comm_hooks import GradBucket


class BucketBuffer:
    """Runtime state of one bucket.

    Args:
        index (int): launch-order index.
        buffer (torch.Tensor): the zeroed flat buffer.
        indices (list[int]): trainable indices of its parameters, in buffer order.
        params (list[nn.Parameter]): those parameters.
        offsets (list[int]): each parameter's element offset.
        last (bool): whether it launches last.
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
        """Make every ``param.grad`` its view, zeroing and marking in ``replaced_none`` those that were None."""
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
        """Wait for the reduction and copy a returned tensor, e.g. a compressed one, into the buffer."""
        try:
            result = self.future.wait()
        except RuntimeError as error:
            raise RuntimeError(
                f"BucketedDDP rank {rank}: the all-reduce of bucket {self.index} failed: another rank failed, was "
                f"killed, or is stuck (a stuck rank is given up on after the process group's timeout, "
                f"--ddp-timeout). {error}"
            ) from error
        if isinstance(result, list | tuple):  # a collective's own future holds a list
            result = result[0]
        if isinstance(result, torch.Tensor) and result.data_ptr() != self.buffer.data_ptr():
            self.buffer.copy_(result.view_as(self.buffer))

    def copy_to_grads(self, unused_everywhere: set[int]) -> None:
        """Write averaged gradients into ``param.grad``; a None unused on every rank stays None."""
        with torch.no_grad():
            for i, p, view in zip(self.indices, self.params, self.views, strict=True):
                if p.grad is None:
                    if i not in unused_everywhere:
                        p.grad = view.clone()
                else:
                    p.grad.copy_(view)
