"""The per-backward half of BucketedDDP, as torch's C++ Reducer is to its Python DDP wrapper.

It tracks readiness, launches buckets in index order, finalizes, aborts and handles unused parameters.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils import _pytree as pytree

from .buckets import BucketSpec
from .comm_hooks import CommHook, allreduce_divided_hook, allreduce_hook, wire_dtype
from .grad_buffers import BucketBuffer
from .stats import CommRecorder, Measurement, start_timer, stop_timer
from .timeline import BackwardClock

_REENTRANT_HINT = (
    "If the model uses gradient checkpointing, enable it non-reentrant: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}); reentrant "
    "checkpointing of a frozen base also needs model.enable_input_require_grads(), or the adapters of the "
    "checkpointed layers get no gradient."
)


class Reducer:
    """Averages trainable gradients across ranks in fixed buckets, launching each as soon as it is ready.

    Gradient hooks reach it through a weak reference, so the module does not keep it alive.

    Args:
        names (list[str]): the trainable parameters' names, for error messages.
        params (list[nn.Parameter]): the trainable parameters, in registration order.
        layout (list[BucketSpec]): their buckets.
        process_group (ProcessGroup | None): group to reduce over.
        gradient_as_bucket_view (bool): keep ``param.grad`` a view into its bucket.
        find_unused_parameters (bool): reduce parameters without a gradient instead of raising.
    """

    def __init__(
        self,
        names: list[str],
        params: list[nn.Parameter],
        layout: list[BucketSpec],
        process_group: dist.ProcessGroup | None,
        gradient_as_bucket_view: bool,
        find_unused_parameters: bool,
    ) -> None:
        self._names = names
        self._params = params
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self._build_buckets(layout)
        # Which parameters got a gradient since the last sync, and which had None before a zeroed view.
        self._used_since_sync = [False] * len(params)
        self._view_replaced_none = [False] * len(params)
        if gradient_as_bucket_view:
            self._attach_grad_views()
        # AccumulateGrad nodes, kept alive as torch DDP does, to ask the engine whether a pass accumulates.
        self._grad_accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in reversed(params)]

        self._comm_hook: CommHook = allreduce_hook
        self._comm_state: object = process_group
        self._wire_bytes = self._bytes_on_wire()
        self._device = self.buckets[0].buffer.device
        # On CUDA the final wait returns before the GPU finishes, so measure on CPU only.
        self._measure_window = self._device.type == "cpu"
        self.stats = CommRecorder()  # the latest backward's and since the last pop
        self.clock = BackwardClock(self._device)  # bucket ready times of the latest synced backward

        # Counters read once per optimizer step by the StepWatch.
        self.synced_done = 0  # synced backward passes finished
        self.unsynced_forwards = 0  # forwards with grad enabled under no_sync
        self.saw_unused = False  # some parameter got no gradient on some rank
        self._world_size = dist.get_world_size(process_group)
        # Set by bucket_cap_mb="auto" during its trial; called after each synced backward.
        self.on_synced_backward: Callable[[Reducer, Measurement], None] | None = None
        self._backward_timer: object = None

        # Per-iteration state, reset by prepare_for_backward.
        self._armed = False
        self._sync = False
        self._divisor: int | None = None  # a join's divisor (None: the comm hook's own)
        self._finalizer_queued = False
        self._pass_accumulates = True
        self._ready = [False] * len(params)
        self._next_launch = 0
        self.any_backward = False
        self._window_start = 0.0

        owner = weakref.ref(self)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(functools.partial(_grad_ready_hook, owner, i))
            for i, p in enumerate(params)
        ]
        self._release_hooks = weakref.finalize(self, _remove_handles, self._hook_handles)

    def _build_buckets(self, layout: list[BucketSpec]) -> None:
        """Build zeroed flat buffers for ``layout`` and each parameter's slot in them."""
        self.layout = layout
        self.buckets: list[BucketBuffer] = []
        self._slot: list[tuple[int, int]] = [(-1, -1)] * len(self._params)  # param index -> (bucket, position)
        for b in layout:
            members = [self._params[i] for i in b.param_indices]
            buffer = torch.zeros(b.numel, dtype=b.dtype, device=b.device)
            last = b.index == len(layout) - 1
            self.buckets.append(BucketBuffer(b.index, buffer, list(b.param_indices), members, list(b.offsets), last))
            for pos, i in enumerate(b.param_indices):
                self._slot[i] = (b.index, pos)

    def relayout(self, layout: list[BucketSpec]) -> None:
        """Move to another layout between iterations, copying non-None gradients into their new views."""
        if self._armed:
            raise RuntimeError("BucketedDDP: the bucket layout can change between iterations only, not in one.")
        self._build_buckets(layout)
        if self.gradient_as_bucket_view:
            with torch.no_grad():
                for bucket in self.buckets:
                    for p, view in zip(bucket.params, bucket.views, strict=True):
                        if p.grad is not None:
                            view.copy_(p.grad)
                            p.grad = view
        self._wire_bytes = self._bytes_on_wire()

    @property
    def hooks_alive(self) -> bool:
        """False once the gradient hooks are removed."""
        return self._release_hooks.alive

    def remove_hooks(self) -> None:
        """Finish communication already launched, disarm, and remove the gradient hooks. Idempotent."""
        if self._armed and self._sync and self._next_launch > 0:
            self._wait_launched()
        self._armed = False
        self._release_hooks()

    def set_comm_hook(self, state: object, hook: CommHook) -> None:
        """Launch each bucket through ``hook(state, bucket)`` from now on."""
        self._comm_hook, self._comm_state = hook, state
        self._wire_bytes = self._bytes_on_wire()

    def launch_hook(self, divisor: int | None) -> tuple[CommHook, object]:
        """The hook and state to launch with; a join's ``divisor`` selects the dividing default hook."""
        if divisor is None:
            return self._comm_hook, self._comm_state
        return allreduce_divided_hook, (self.process_group, divisor)

    def _bytes_on_wire(self) -> list[int]:
        """Bytes each bucket sends under the current hook."""
        return [b.buffer.numel() * wire_dtype(self._comm_hook, b.buffer.dtype).itemsize for b in self.buckets]

    def _attach_grad_views(self) -> None:
        """Make every ``param.grad`` its bucket view, zeroing a whole bucket in one op after ``set_to_none``."""
        replaced_none = self._view_replaced_none if self.find_unused_parameters else None
        for bucket in self.buckets:
            bucket.attach_grad_views(replaced_none)

    def prepare_for_backward(self, sync: bool, divisor: int | None = None) -> None:
        """Arm one iteration; ``divisor`` replaces the world size in the default averaging under join."""
        if self._armed and self._sync and self._next_launch > 0:
            # The previous synced backward raised half-way: drain its collectives.
            self._wait_launched()
        self._armed = True
        self._sync = sync
        self._divisor = divisor
        self.unsynced_forwards += not sync
        self._finalizer_queued = False
        self._pass_accumulates = True
        self._ready = [False] * len(self._params)
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.future = None
        self.stats.start_backward(synced=sync)
        if sync:
            self.clock.forward_start()
        if self.gradient_as_bucket_view:
            self._attach_grad_views()

    def hook_backward_start(self, output) -> None:
        """Queue the finalizer when the outermost backward reaches an output; outputs stay unmodified."""
        for leaf in pytree.tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if self._armed and self._sync and not self._finalizer_queued:
            self._queue_finalizer(accumulates=self._engine_accumulates_a_parameter())

    def _engine_accumulates_a_parameter(self) -> bool:
        """Whether this pass will run a parameter's AccumulateGrad.

        False for ``torch.autograd.grad``, and when reentrant checkpoints hide every parameter; the finalizer tells
        them apart.
        """
        try:
            return any(map(torch._C._will_engine_execute_node, self._grad_accumulators))
        except RuntimeError:  # torch.autograd.grad with a parameter among its inputs
            return False

    def _queue_finalizer(self, accumulates: bool = True) -> None:
        if self._armed and self._sync and not self._finalizer_queued:
            self._finalizer_queued = True
            self._pass_accumulates = accumulates
            self.clock.start(self._wire_bytes)
            if self.on_synced_backward is not None:
                self._backward_timer = start_timer(self._device)
            Variable._execution_engine.queue_callback(self._finalize_backward)

    def _on_grad_ready(self, index: int, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: ``param.grad`` holds this backward's gradient."""
        if self._armed and not self._sync:  # accumulation micro-step, the common case
            if self.find_unused_parameters:
                self._used_since_sync[index] = True
            return
        self.any_backward = True
        if not self._armed:
            raise RuntimeError(
                f"BucketedDDP: parameter {self._names[index]!r} got a gradient from a backward that did not "
                "follow a forward through the wrapper: call the BucketedDDP model (not .module), once per "
                "backward; for gradient accumulation run the micro-steps inside no_sync()."
            )
        if self._ready[index]:
            self._abort_iteration()
            raise RuntimeError(
                f"BucketedDDP: parameter {self._names[index]!r} received its gradient twice in one backward, "
                "after its bucket may already have been reduced; reducing it would double-count or miss part "
                "of the gradient. A parameter reused across reentrant checkpointed segments, or two backward "
                f"passes through one forward, do this. {_REENTRANT_HINT}"
            )
        if not self._finalizer_queued:  # backward did not start at the wrapper's outputs
            self._queue_finalizer()
        self._ready[index] = True
        bucket_index, position = self._slot[index]
        bucket = self.buckets[bucket_index]
        grad = param.grad
        if grad.data_ptr() != bucket.view_ptrs[position]:
            view = bucket.views[position]
            with torch.no_grad():
                view.copy_(grad)
            if self.gradient_as_bucket_view:
                param.grad = view
        bucket.pending -= 1
        if bucket.pending == 0:
            self.clock.bucket_ready(bucket_index)
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch consecutive ready buckets from the next unlaunched one: index order on every rank."""
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            bucket = self.buckets[self._next_launch]
            if self._next_launch == 0:
                self._window_start = time.perf_counter()
            # No Future.then callback: its destructor on the comm thread can abort the exiting interpreter.
            bucket.grad_bucket.reset_buffer()  # a hook may have replaced it last time
            hook, state = self.launch_hook(self._divisor)
            bucket.future = hook(state, bucket.grad_bucket)
            sent = bucket.grad_bucket.buffer()  # maybe a compressed copy (set_buffer)
            nbytes = self._wire_bytes[self._next_launch] if sent is bucket.buffer else sent.nbytes
            self.stats.add_allreduce(nbytes)
            self._next_launch += 1

    def _finalize_backward(self) -> None:
        """Queued on the autograd engine: runs once the whole backward is done."""
        if not (self._armed and self._sync):
            return
        if not self._pass_accumulates and self._no_gradient_yet():
            # A pass that accumulated nothing, e.g. torch.autograd.grad, as torch DDP: wait for the next.
            self._finalizer_queued = False
            return
        self.last_ready_at = time.perf_counter()  # this rank's compute is done
        self.clock.end()
        token = start_timer(self._device)
        used_map = None
        if self.find_unused_parameters:
            used = [r or u for r, u in zip(self._ready, self._used_since_sync, strict=True)]
        if self._next_launch < len(self.buckets):
            if not self.find_unused_parameters:
                unready = [self._names[i] for i, ready in enumerate(self._ready) if not ready]
                self._abort_iteration()
                shown = ", ".join(repr(n) for n in unready[:5]) + (" ..." if len(unready) > 5 else "")
                raise RuntimeError(
                    f"BucketedDDP: {len(unready)} trainable parameter(s) received no gradient in this backward: "
                    f"{shown}. Freeze parameters that are not used (requires_grad=False) or pass "
                    f"find_unused_parameters=True (used on no rank: grad stays None). {_REENTRANT_HINT}"
                )
            self._reduce_unused()
        if self.find_unused_parameters:  # after every bucket, so collectives pair up in order
            used_map = torch.tensor(used, dtype=torch.int32, device=self._device)
            used_work = dist.all_reduce(used_map, group=self.process_group, async_op=True)
        for bucket in self.buckets:
            bucket.wait_reduced(self.rank)
        self.stats.add_wait(stop_timer(self._device, token))
        if self._measure_window:
            # First launch to end of wait; with nothing exposed it also holds compute.
            self.stats.add_window((time.perf_counter() - self._window_start) * 1e3)
        unused_everywhere: set[int] = set()
        if used_map is not None:
            used_work.wait()
            counts = used_map.tolist()
            unused_everywhere = {i for i, n in enumerate(counts) if n == 0}
            self.saw_unused = self.saw_unused or any(n < self._world_size for n in counts)
            self._used_since_sync = [False] * len(self._params)
        if not self.gradient_as_bucket_view:
            for bucket in self.buckets:
                bucket.copy_to_grads(unused_everywhere)  # used on no rank: grad stays None
        else:
            for i in unused_everywhere:
                if self._view_replaced_none[i]:  # used on no rank: back to None
                    self._params[i].grad = None
        if self.find_unused_parameters:
            self._view_replaced_none = [False] * len(self._params)
        self._armed = False
        self.synced_done += 1
        if self.on_synced_backward is not None:
            self.on_synced_backward(self, stop_timer(self._device, self._backward_timer))

    def _no_gradient_yet(self) -> bool:
        return self._next_launch == 0 and all(b.pending == len(b.params) for b in self.buckets)

    def _reduce_unused(self) -> None:
        """Contribute what unused parameters hold locally, or zero."""
        with torch.no_grad():
            for index, ready in enumerate(self._ready):
                if ready:
                    continue
                bucket_index, position = self._slot[index]
                bucket = self.buckets[bucket_index]
                view, grad = bucket.views[position], self._params[index].grad
                if grad is None:
                    view.zero_()
                elif grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
                self._ready[index] = True
                bucket.pending -= 1
        self._launch_ready_buckets()

    def _abort_iteration(self) -> None:
        """Finish the launched collectives, the same on every rank, and disarm before raising."""
        self._wait_launched()
        self._armed = False

    def _wait_launched(self) -> None:
        for bucket in self.buckets[: self._next_launch]:
            if bucket.future is not None:
                bucket.future.wait()
                bucket.future = None
        self._next_launch = 0


def _grad_ready_hook(owner: weakref.ref, index: int, param: nn.Parameter) -> None:
    reducer = owner()
    if reducer is not None:
        reducer._on_grad_ready(index, param)


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
