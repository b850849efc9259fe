"""When each bucket's gradients were ready in one backward, the input of ``ddp-ft forecast``.

On CUDA the clock records events read only when asked, so backward never synchronises.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils import _pytree as pytree

from .buckets import ParamSpec, compute_bucket_assignment
from .comm_hooks import CommHook, allreduce_hook, wire_dtype
from .stats import Measurement, elapsed_ms, start_timer, stop_timer


@dataclass(frozen=True)
class BackwardTimeline:
    """One backward, bucket by bucket.

    Args:
        bucket_bytes (tuple[int, ...]): bytes each bucket sends, in launch order.
        ready_ms (tuple[float, ...]): ms from backward's start to each bucket's last gradient.
        backward_ms (float): ms from backward's start to its last gradient.
        forward_ms (float | None): ms of the forward that built its graph, or None if not stamped.
    """

    bucket_bytes: tuple[int, ...]
    ready_ms: tuple[float, ...]
    backward_ms: float
    forward_ms: float | None = None


class BackwardClock:
    """Stamps one iteration's forward, backward start, bucket readiness and end.

    Args:
        device (torch.device): where backward computes.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._forward_start: object = None
        self._forward: Measurement | None = None
        self._start: object = None
        self._bytes: tuple[int, ...] = ()
        self._ready: list[Measurement | None] = []
        self._done: tuple | None = None  # the latest finished backward

    def forward_start(self) -> None:
        """Stamp the start of a forward."""
        self._forward_start = start_timer(self._device)

    def start(self, bucket_bytes: tuple[int, ...] | list[int]) -> None:
        """Stamp the start of a backward over buckets of ``bucket_bytes``."""
        self._forward = None if self._forward_start is None else stop_timer(self._device, self._forward_start)
        self._forward_start = None
        self._start = start_timer(self._device)
        self._bytes = tuple(bucket_bytes)
        self._ready = [None] * len(self._bytes)

    def bucket_ready(self, index: int) -> None:
        """Stamp bucket ``index`` ready; the first call counts."""
        if self._start is not None and self._ready[index] is None:
            self._ready[index] = stop_timer(self._device, self._start)

    def end(self) -> None:
        """Stamp the end; this backward becomes the one :meth:`read` gives."""
        if self._start is not None:
            self._done = (self._bytes, self._ready, stop_timer(self._device, self._start), self._forward)
            self._start = None

    def read(self) -> BackwardTimeline | None:
        """The latest finished backward, or None; unmarked buckets count as ready at the end."""
        if self._done is None:
            return None
        bucket_bytes, ready, end, forward = self._done
        end_ms = elapsed_ms(end)
        ready_ms = tuple(end_ms if r is None else elapsed_ms(r) for r in ready)
        return BackwardTimeline(bucket_bytes, ready_ms, end_ms, None if forward is None else elapsed_ms(forward))


class BackwardRecorder:
    """At world size 1, when each bucket BucketedDDP would build became ready, without communicating.

    Args:
        module (nn.Module): the model; parameters with ``requires_grad`` are trained.
        bucket_cap_mb (float): as BucketedDDP's. Default: 25.
        first_bucket_cap_mb (float): as BucketedDDP's. Default: 1.
        comm_hook (CommHook): the hook that sets bytes on the wire. Default: ``allreduce_hook``.

    Raises:
        ValueError: if nothing is trainable or a cap is not positive.

    Example:
        >>> recorder = BackwardRecorder(model)
        >>> model(**batch).loss.backward()
        >>> recorder.last_backward_timeline()
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        comm_hook: CommHook = allreduce_hook,
    ) -> None:
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("BackwardRecorder: the module has no trainable parameters (none has requires_grad=True).")
        layout = compute_bucket_assignment([ParamSpec.of(n, p) for n, p in named], bucket_cap_mb, first_bucket_cap_mb)
        self.bucket_bytes = tuple(b.numel * wire_dtype(comm_hook, b.dtype).itemsize for b in layout)
        self._bucket_of = [0] * len(named)
        for bucket in layout:
            for i in bucket.param_indices:
                self._bucket_of[i] = bucket.index
        self._sizes = [len(b.param_indices) for b in layout]
        self._pending = list(self._sizes)
        self._armed = self._started = False
        self.clock = BackwardClock(named[0][1].device)
        owner = weakref.ref(self)
        handles = [
            p.register_post_accumulate_grad_hook(functools.partial(_param_ready, owner, i))
            for i, (_, p) in enumerate(named)
        ]
        handles.append(module.register_forward_pre_hook(functools.partial(_forward_begins, owner)))
        handles.append(module.register_forward_hook(functools.partial(_forward_done, owner)))
        self._release = weakref.finalize(self, _remove_handles, handles)

    def last_backward_timeline(self) -> BackwardTimeline | None:
        """The latest backward's buckets, or None before the first."""
        return self.clock.read()

    def remove_hooks(self) -> None:
        """Stop recording. Idempotent."""
        self._release()

    def _on_forward(self, output: object) -> None:
        if not torch.is_grad_enabled():
            return
        self._armed, self._started = True, False
        for leaf in pytree.tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if self._armed and not self._started:
            self._start_backward()

    def _start_backward(self) -> None:
        self._started = True
        self._pending = list(self._sizes)
        self.clock.start(self.bucket_bytes)
        Variable._execution_engine.queue_callback(self._end_backward)

    def _on_param_ready(self, index: int) -> None:
        if not self._armed:  # no forward through the module
            return
        if not self._started:
            self._start_backward()
        bucket = self._bucket_of[index]
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0:
            self.clock.bucket_ready(bucket)

    def _end_backward(self) -> None:
        if self._pending == self._sizes:  # accumulated nothing: not the iteration's backward
            self._started = False
            return
        self.clock.end()
        self._armed = False


def _param_ready(owner: weakref.ref, index: int, param: nn.Parameter) -> None:
    recorder = owner()
    if recorder is not None:
        recorder._on_param_ready(index)


def _forward_begins(owner: weakref.ref, module: nn.Module, args: tuple) -> None:
    recorder = owner()
    if recorder is not None and torch.is_grad_enabled():
        recorder.clock.forward_start()


def _forward_done(owner: weakref.ref, module: nn.Module, args: tuple, output: object) -> None:
    recorder = owner()
    if recorder is not None:
        recorder._on_forward(output)


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
