"""The per-backward half of BucketedDDP, as torch's C++ Reducer is to its Python DDP wrapper.

The :class:`Reducer` owns the bucket buffers and the phases of one synced backward (see BucketedDDP's class
docstring): forward arms it (:meth:`~Reducer.prepare_for_backward`, :meth:`~Reducer.hook_backward_start`), then it
tracks each parameter's readiness, launches buckets in index order, runs the finalizer queued on the autograd engine,
drains launched collectives before raising (abort), and applies the unused-parameter policy. The wrapper owns the
module, forward, ``no_sync``, buffers, state dict and the public API.
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
    """Averages the gradients of a module's trainable parameters across ranks in fixed buckets, once per synced
    backward, launching each bucket's all-reduce (through the comm hook) as soon as it and its predecessors are ready.

    Its gradient hooks reach it through a weak reference, so the module (which holds them) does not keep it alive;
    they are removed when it is freed, or at :meth:`remove_hooks`.

    Args:
        names (list[str]): the trainable parameters' names, in registration order (for error messages).
        params (list[nn.Parameter]): the trainable parameters, in registration order.
        layout (list[BucketSpec]): their buckets (:func:`~ddp_ft.ddp.buckets.compute_bucket_assignment`).
        process_group (ProcessGroup | None): group to reduce over; the default hook's state.
        gradient_as_bucket_view (bool): keep ``param.grad`` a view into its bucket's buffer.
        find_unused_parameters (bool): reduce parameters without a gradient instead of raising (see BucketedDDP).
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
        # find_unused_parameters: which parameters got a gradient since the last synced backward (under no_sync
        # too), and which had none when a forward attached a zeroed bucket view. A parameter no rank used gets
        # its None back after the reduction, as torch DDP leaves it untouched.
        self._used_since_sync = [False] * len(params)
        self._view_replaced_none = [False] * len(params)
        if gradient_as_bucket_view:
            self._attach_grad_views()
        # Each parameter's AccumulateGrad node, kept alive (as torch DDP's reducer does) to ask the autograd engine
        # whether a backward pass reaching the outputs accumulates into parameters (torch.autograd.grad does not).
        self._grad_accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in reversed(params)]

        self._comm_hook: CommHook = allreduce_hook
        self._comm_state: object = process_group
        self._wire_bytes = self._bytes_on_wire()
        self._device = self.buckets[0].buffer.device
        # The window ends when the finalizer's wait returns, which on CUDA is not when the GPU finished.
        self._measure_window = self._device.type == "cpu"
        self.stats = CommRecorder()  # the latest backward's and since the last pop
        self.clock = BackwardClock(self._device)  # when each bucket was ready in the latest synced backward

        # Counters read once per optimizer step by the StepWatch (ddp_ft.ddp.watch), never on the backward path.
        self.synced_done = 0  # synced backward passes finished
        self.unsynced_forwards = 0  # forwards with grad enabled under no_sync
        self.saw_unused = False  # find_unused_parameters: some parameter got no gradient on some rank
        self._world_size = dist.get_world_size(process_group)
        # bucket_cap_mb="auto" while its trial runs (ddp_ft.ddp.autotune): called at the end of each synced backward
        # with this reducer and the backward's time from reaching the output to the end of the final wait.
        self.on_synced_backward: Callable[[Reducer, Measurement], None] | None = None
        self._backward_timer: object = None

        # Per-iteration state, reset by prepare_for_backward (each forward).
        self._armed = False
        self._sync = False
        self._divisor: int | None = None  # a join's divisor for this iteration (None: the comm hook's own)
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
        """Zeroed flat buffers, views and GradBuckets of ``layout``, and each parameter's slot in them."""
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
        """Move to the buckets of another layout of the same parameters, between iterations (never while one is
        armed). With ``gradient_as_bucket_view`` every gradient that is not None is copied into its new view and
        becomes it, so accumulated gradients and ``zero_grad(set_to_none=False)`` keep their values; a None stays
        None. The parameters' hooks stay; wire bytes are recounted."""
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
        """Launch each bucket through ``hook(state, bucket)`` from now on (BucketedDDP checks when this is allowed)."""
        self._comm_hook, self._comm_state = hook, state
        self._wire_bytes = self._bytes_on_wire()

    def launch_hook(self, divisor: int | None) -> tuple[CommHook, object]:
        """The hook and state each bucket is launched with: the registered ones, or with a join's ``divisor`` the
        default averaging dividing by it (:mod:`~ddp_ft.ddp.join` refuses a divisor with another hook)."""
        if divisor is None:
            return self._comm_hook, self._comm_state
        return allreduce_divided_hook, (self.process_group, divisor)

    def _bytes_on_wire(self) -> list[int]:
        """Bytes each bucket hands to the collective under the current hook: fixed once the hook is."""
        return [b.buffer.numel() * wire_dtype(self._comm_hook, b.buffer.dtype).itemsize for b in self.buckets]

    def _attach_grad_views(self) -> None:
        """Make every ``param.grad`` its bucket view, zeroed where the gradient was None.

        Runs every forward: after ``zero_grad(set_to_none=True)`` a whole bucket is zeroed in one op.
        """
        replaced_none = self._view_replaced_none if self.find_unused_parameters else None
        for bucket in self.buckets:
            bucket.attach_grad_views(replaced_none)

    def prepare_for_backward(self, sync: bool, divisor: int | None = None) -> None:
        """Arm one iteration (each forward with grad enabled): ``sync`` is whether its backward communicates;
        ``divisor``, if given, what the default averaging divides by instead of the world size (a join's ranks
        still training, :mod:`~ddp_ft.ddp.join`)."""
        if self._armed and self._sync and self._next_launch > 0:
            # The previous synced backward stopped half-way (an exception elsewhere in it): drain its collectives.
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
        """Queue the finalizer when the outermost backward reaches any output (outputs are not modified)."""
        for leaf in pytree.tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if self._armed and self._sync and not self._finalizer_queued:
            self._queue_finalizer(accumulates=self._engine_accumulates_a_parameter())

    def _engine_accumulates_a_parameter(self) -> bool:
        """Whether the running backward pass will accumulate into a trainable parameter. False for
        ``torch.autograd.grad`` (it runs no AccumulateGrad node), and also when every parameter is hidden behind
        reentrant checkpoints (their nested passes accumulate); the finalizer tells these apart afterwards."""
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
        """Post-accumulate-grad hook: runs once ``param.grad`` holds this backward's gradient."""
        if self._armed and not self._sync:  # accumulation micro-step: nothing to do (the common case first)
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
        """Launch every consecutive ready bucket from the next unlaunched one: index order on all ranks."""
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            bucket = self.buckets[self._next_launch]
            if self._next_launch == 0:
                self._window_start = time.perf_counter()
            # No Python callback (Future.then) on the communication thread: its destructor needs the GIL and,
            # if it runs there while the interpreter exits, aborts the process ("terminate called without an
            # active exception"). The window is stamped in the finalizer instead.
            bucket.grad_bucket.reset_buffer()  # a hook may have replaced it last time (set_buffer)
            hook, state = self.launch_hook(self._divisor)
            bucket.future = hook(state, bucket.grad_bucket)
            sent = bucket.grad_bucket.buffer()  # the hook may have replaced it with a compressed copy (set_buffer)
            nbytes = self._wire_bytes[self._next_launch] if sent is bucket.buffer else sent.nbytes
            self.stats.add_allreduce(nbytes)
            self._next_launch += 1

    def _finalize_backward(self) -> None:
        """Queued on the autograd engine: runs once the whole backward is done."""
        if not (self._armed and self._sync):
            return
        if not self._pass_accumulates and self._no_gradient_yet():
            # A pass that accumulated into no parameter, e.g. torch.autograd.grad(loss, inputs): not the iteration's
            # backward (torch DDP's hooks run on AccumulateGrad only, which it does not execute). Wait for the next.
            self._finalizer_queued = False
            return
        self.last_ready_at = time.perf_counter()  # this rank's compute is done; what follows is waiting
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
        if self.find_unused_parameters:  # after every bucket, so the collectives pair up in the same order
            used_map = torch.tensor(used, dtype=torch.int32, device=self._device)
            used_work = dist.all_reduce(used_map, group=self.process_group, async_op=True)
        for bucket in self.buckets:
            bucket.wait_reduced(self.rank)
        self.stats.add_wait(stop_timer(self._device, token))
        if self._measure_window:
            # From the first launch to the end of the wait: the last completion when any communication was
            # exposed; when none was, the window also holds the compute after it and the overlap is ~100% anyway.
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
                bucket.copy_to_grads(unused_everywhere)  # a parameter no rank used keeps grad None
        else:
            for i in unused_everywhere:
                if self._view_replaced_none[i]:  # a parameter no rank used gets back the None it had
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
        """find_unused_parameters=True: contribute what unused parameters hold locally (zero if nothing)."""
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
        """Before raising mid-backward: finish the collectives already launched (every rank launched the same
        ones, in the same order) so no rank is left with work in flight, and disarm."""
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
