"""BucketedDDP: data-parallel training with fixed gradient buckets whose all-reduces overlap backward."""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.autograd import Variable
from torch.utils import _pytree as pytree

from .buckets import ParamSpec, compute_bucket_assignment
from .comm_hooks import CommHook, GradBucket, allreduce_hook, wire_dtype
from .stats import CommRecorder, CommStats, start_timer, stop_timer
from .verify import verify_across_ranks

logger = logging.getLogger(__name__)

_REENTRANT_HINT = (
    "If the model uses gradient checkpointing, enable it non-reentrant: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})."
)


class _Bucket:
    """Runtime state of one bucket: its flat buffer, the gradient views into it, and readiness."""

    def __init__(
        self, index: int, buffer: torch.Tensor, indices: list[int], params: list[nn.Parameter], offsets: list[int],
        last: bool,
    ):  # fmt: skip
        self.buffer = buffer
        self.indices = indices
        self.params = params
        self.views = [buffer[o : o + p.numel()].view_as(p) for p, o in zip(params, offsets, strict=True)]
        self.view_ptrs = [v.data_ptr() for v in self.views]
        self.grad_bucket = GradBucket(index, buffer, params, self.views, last)
        self.pending = len(params)
        self.future: torch.futures.Future | None = None


class BucketedDDP(nn.Module):
    """Data parallelism with fixed gradient buckets whose all-reduces overlap the rest of backward.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel`` where the knobs mean the same thing,
    written for parameter-efficient fine-tuning: only trainable parameters are bucketed, broadcast and
    reduced; a frozen (e.g. 4-bit) base is left alone and only checksummed.

    Guarantees:
        * Layout. Trainable parameters are split into buckets in reverse registration order (the order
          backward produces gradients), by dtype and device: a pure function of the parameter list
          (:func:`compute_bucket_assignment`), fixed for the life of the wrapper. At construction every
          rank compares names, shapes, dtypes, order and bucket boundaries with rank 0, and SHA-256 digests
          of the frozen parameters in order, with the quant state of bitsandbytes 4-bit weights
          (:func:`~ddp_ft.ddp.checksum.frozen_digest`; about 3 s per rank for Qwen3-4B NF4); any difference
          raises on every rank naming the first differing parameter, instead of a hang or a silent
          mis-reduction (:mod:`~ddp_ft.ddp.verify`).
        * Start state. Trainable parameters and buffers are broadcast from rank 0.
        * Memory. Each bucket is one flat buffer. With ``gradient_as_bucket_view`` every ``param.grad``
          is a view into it, so there is no copy in or out; after ``zero_grad(set_to_none=True)`` the
          next forward re-attaches zeroed views.
        * Equality. When ``loss.backward()`` returns, every gradient is the average over ranks, as with
          torch DDP: no ``finish()`` call is needed, so HF Trainer and Accelerate work unchanged.
        * Lifecycle. The gradient hooks hold the wrapper only weakly: a dropped wrapper is freed and its hooks
          removed, so the module can train alone or be wrapped again; :meth:`remove_hooks` does it at once.

    One synced backward, in phases:
        1. ``forward`` arms the iteration and puts a gradient hook on its outputs (leaving them untouched,
           so callers may still modify them in place, as the HF Trainer does with the loss).
        2. Backward reaches an output: the finalizer is queued on the autograd engine, in the outermost
           backward pass, so it runs when the whole backward is done, also when reentrant checkpointing
           runs nested backward passes whose own end would be too early.
        3. Each trainable parameter's post-accumulate-grad hook marks it ready. When a bucket's last
           parameter is ready, it and every ready bucket after it are launched, strictly in index order
           on every rank, as async all-reduces through the comm hook, while backward keeps computing.
        4. The engine runs the finalizer after the last node: it launches what the unused-parameter
           policy allows, waits for all futures (this wait is the exposed communication), and copies
           results back where the hook returned a new tensor or grads are not bucket views.

    A backward pass that accumulates into no parameter, such as ``torch.autograd.grad(loss, inputs,
    create_graph=True)`` for a gradient penalty, does not end the iteration: the backward that follows
    (``(loss + penalty).backward()``) reduces, as in torch DDP, whose hooks run only on AccumulateGrad.

    Inside :meth:`no_sync` nothing is communicated: gradients accumulate locally (into the bucket
    buffers when they are views) and the next synced backward reduces everything accumulated. As in
    torch DDP, whether a backward syncs is decided by the forward that produced its graph.

    Args:
        module (nn.Module): the model; its trainable parameters are the ones with ``requires_grad``.
        bucket_cap_mb (float): bucket size cap in MiB. Default: 25.
        first_bucket_cap_mb (float): cap of the first bucket, kept small so communication starts early in
            backward. Default: 1.
        gradient_as_bucket_view (bool): make ``param.grad`` a view into the bucket buffer. Default: True.
        find_unused_parameters (bool): if False, a trainable parameter without a gradient in a synced
            backward is an error naming it. If True, as in torch DDP: the ranks all-reduce which parameters
            got a gradient since the last synced backward (one small extra all-reduce per synced backward,
            not counted in the stats); a parameter used on some rank is averaged (this rank contributing what
            it accumulated under ``no_sync``, or zero); one used on no rank keeps ``grad=None`` (so the
            optimizer skips it) or, if it had a gradient before, that gradient. Default: False.
        broadcast_buffers (bool): broadcast the module's buffers from rank 0 at the first forward after a
            synced one (and the first forward), i.e. once per optimizer step at its first micro-step, where the
            ranks have just met in the all-reduce: torch DDP's schedule. A no-grad forward never communicates
            (torch DDP's may), so evaluation on uneven shards cannot hang. Default: True.
        process_group (ProcessGroup | None): group to reduce over. Default: the default group.

    Raises:
        RuntimeError: if no process group is initialised, or the layout or frozen weights differ across
            ranks.
        ValueError: if the module has no trainable parameters or a cap is not positive.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "BucketedDDP needs an initialised process group: call ddp_ft.distributed.init_distributed() "
                "(or torch.distributed.init_process_group) under torchrun / accelerate launch first."
            )
        self.module = module
        self.process_group = process_group
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("BucketedDDP: the module has no trainable parameters (none has requires_grad=True).")
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        specs = [ParamSpec.of(name, p) for name, p in named]
        self._layout = compute_bucket_assignment(specs, bucket_cap_mb, first_bucket_cap_mb)
        verify_across_ranks(module, specs, self._layout, self.world_size, process_group)
        self._module_buffers = list(module.buffers())  # fixed at construction, as torch DDP's modules_buffers
        self._broadcast_from_rank0([*self._params, *self._module_buffers])

        self._buckets: list[_Bucket] = []
        self._slot: list[tuple[int, int]] = [(-1, -1)] * len(self._params)  # param index -> (bucket, position)
        for b in self._layout:
            params = [self._params[i] for i in b.param_indices]
            buffer = torch.zeros(b.numel, dtype=b.dtype, device=b.device)
            last = b.index == len(self._layout) - 1
            self._buckets.append(_Bucket(b.index, buffer, list(b.param_indices), params, list(b.offsets), last))
            for pos, i in enumerate(b.param_indices):
                self._slot[i] = (b.index, pos)
        # find_unused_parameters: which parameters got a gradient since the last synced backward (under no_sync
        # too), and which had none when a forward attached a zeroed bucket view. A parameter no rank used gets
        # its None back after the reduction, as torch DDP leaves it untouched.
        self._used_since_sync = [False] * len(self._params)
        self._view_replaced_none = [False] * len(self._params)
        if gradient_as_bucket_view:
            self._attach_grad_views()
        # Each parameter's AccumulateGrad node, kept alive (as torch DDP's reducer does) to ask the autograd engine
        # whether a backward pass reaching the outputs accumulates into parameters (torch.autograd.grad does not).
        self._grad_accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in reversed(self._params)]

        self._comm_hook: CommHook = allreduce_hook
        self._comm_state: object = process_group
        self._hook_registered = False
        self._wire_bytes = self._bytes_on_wire()
        self._device = self._buckets[0].buffer.device
        # The window ends when the finalizer's wait returns, which on CUDA is not when the GPU finished.
        self._measure_window = self._device.type == "cpu"
        self._stats = CommRecorder()  # the latest backward's and since the last pop_comm_stats()

        # Per-iteration state, reset by forward (see _prepare_for_backward).
        self._armed = False
        self._sync = False
        self._finalizer_queued = False
        self._pass_accumulates = True
        self._ready = [False] * len(self._params)
        self._next_launch = 0
        self._any_backward = False
        self._window_start = 0.0
        # Buffers are broadcast by the first forward after a synced one (see broadcast_buffers). Broadcasting
        # before the synced micro-step instead adds a second meeting point per step, after the ranks have
        # drifted apart over the no_sync micro-steps.
        self._buffers_need_sync = True

        # The hooks reach the wrapper through a weak reference, so the module (which holds them) does not keep a
        # dropped wrapper alive; the finalizer removes them when it goes (or at remove_hooks()).
        owner = weakref.ref(self)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(functools.partial(_grad_ready_hook, owner, i))
            for i, p in enumerate(self._params)
        ]
        self._release_hooks = weakref.finalize(self, _remove_handles, self._hook_handles)
        self._register_state_dict_hook(_strip_module_prefix)
        self.register_load_state_dict_pre_hook(_add_module_prefix)
        if self.rank == 0:
            sizes = [f"{b.numel * self._buckets[b.index].buffer.element_size() / 2**20:.2f}" for b in self._layout]
            logger.info(
                "BucketedDDP: %d trainable tensors (%d elements) in %d buckets [MiB: %s], world size %d",
                len(self._params), sum(p.numel() for p in self._params), len(self._layout), ", ".join(sizes),
                self.world_size,
            )  # fmt: skip

    # ------------------------------------------------------------------ public API

    def forward(self, *inputs, **kwargs):
        if self.hooks_removed:
            raise RuntimeError(
                "BucketedDDP: this wrapper's hooks were removed (remove_hooks()); wrap the module again."
            )
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self._prepare_for_backward(sync=self.require_backward_grad_sync)
            if self._buffers_need_sync and self.broadcast_buffers:
                self._broadcast_buffers()
            self._buffers_need_sync = self.require_backward_grad_sync
        output = self.module(*inputs, **kwargs)
        if grad_enabled and self.require_backward_grad_sync:
            self._hook_backward_start(output)
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient communication for backward passes of forwards run inside this context.

        Gradients accumulate locally; the first synced backward after it averages everything accumulated.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def remove_hooks(self) -> None:
        """Detach the wrapper from the module: remove its gradient hooks, so the module trains alone again or
        can be wrapped anew. Idempotent. Dropping the wrapper does the same when it is garbage-collected; call
        this to be sure it happens now. Communication already launched is finished first. The wrapper cannot
        run forward afterwards.
        """
        if self._armed and self._sync and self._next_launch > 0:
            self._wait_launched()
        self._armed = False
        self._release_hooks()

    @property
    def hooks_removed(self) -> bool:
        """True once :meth:`remove_hooks` ran (the wrapper can no longer train)."""
        return not self._release_hooks.alive

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Replace the default averaging all-reduce with ``hook(state, bucket) -> Future[Tensor]``.

        The future's value must be the averaged flat gradient of ``bucket.buffer()`` (the same tensor,
        or another of its size, which is then copied back). Register once, before the first backward.

        Args:
            state (object): passed to the hook; for the built-in and torch's hooks, the process group or None.
            hook (Callable): see :mod:`ddp_ft.ddp.comm_hooks` for ``allreduce_hook``, ``bf16_compress_hook``
                and ``fp16_compress_hook``; torch's ``default_hooks`` work too.

        Raises:
            RuntimeError: if a hook is already registered or a backward already ran.
        """
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
        if self._hook_registered:
            raise RuntimeError("register_comm_hook can only be called once (a comm hook is already registered).")
        if self._any_backward:
            raise RuntimeError("register_comm_hook must be called before the first backward.")
        self._comm_hook, self._comm_state, self._hook_registered = hook, state, True
        self._wire_bytes = self._bytes_on_wire()

    def _bytes_on_wire(self) -> list[int]:
        """Bytes each bucket hands to the collective under the current hook: fixed once the hook is."""
        return [b.buffer.numel() * wire_dtype(self._comm_hook, b.buffer.dtype).itemsize for b in self._buckets]

    @property
    def bucket_sizes(self) -> list[int]:
        """Elements per bucket, in launch order."""
        return [b.numel for b in self._layout]

    @property
    def bucket_param_names(self) -> list[list[str]]:
        """Names of the parameters in each bucket, in launch order and buffer order."""
        return [[self._names[i] for i in b.param_indices] for b in self._layout]

    def last_comm_stats(self) -> CommStats:
        """Communication of the most recent backward (zero calls if it ran under ``no_sync``)."""
        return self._stats.last()

    def pop_comm_stats(self) -> CommStats:
        """Communication since the previous call (e.g. one optimizer step, accumulation included); resets."""
        return self._stats.pop()

    @property
    def pending_comm_waits(self) -> int:
        """End-of-backward wait measurements held for the next :meth:`pop_comm_stats`, bounded by
        :data:`~ddp_ft.ddp.stats.MAX_PENDING_WAITS` however long nobody pops (older ones are folded)."""
        return self._stats.held_waits

    # ------------------------------------------------------------------ construction helpers

    def _broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        if self.world_size == 1:
            return
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        with torch.no_grad():
            for group in groups.values():
                flat = _flatten_dense_tensors([t.detach() for t in group])
                dist.broadcast(flat, src=src, group=self.process_group)
                for t, synced in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                    t.copy_(synced)

    def _broadcast_buffers(self) -> None:
        if self._module_buffers:
            self._broadcast_from_rank0(self._module_buffers)

    def _attach_grad_views(self) -> None:
        """Make every ``param.grad`` its bucket view, zeroed where the gradient was None.

        Runs every forward: after ``zero_grad(set_to_none=True)`` a whole bucket is zeroed in one op.
        """
        track = self.find_unused_parameters
        with torch.no_grad():
            for bucket in self._buckets:
                grads = [p.grad for p in bucket.params]
                if all(g is None for g in grads):
                    bucket.buffer.zero_()
                    for p, view in zip(bucket.params, bucket.views, strict=True):
                        p.grad = view
                    if track:
                        for i in bucket.indices:
                            self._view_replaced_none[i] = True
                    continue
                for i, p, grad, view, ptr in zip(
                    bucket.indices, bucket.params, grads, bucket.views, bucket.view_ptrs, strict=True
                ):
                    if grad is None:
                        view.zero_()
                        p.grad = view
                        if track:
                            self._view_replaced_none[i] = True
                    elif grad.data_ptr() != ptr:
                        view.copy_(grad)
                        p.grad = view

    # ------------------------------------------------------------------ one iteration

    def _prepare_for_backward(self, sync: bool) -> None:
        if self._armed and self._sync and self._next_launch > 0:
            # The previous synced backward stopped half-way (an exception elsewhere in it): drain its collectives.
            self._wait_launched()
        self._armed = True
        self._sync = sync
        self._finalizer_queued = False
        self._pass_accumulates = True
        self._ready = [False] * len(self._params)
        self._next_launch = 0
        for bucket in self._buckets:
            bucket.pending = len(bucket.params)
            bucket.future = None
        self._stats.start_backward(synced=sync)
        if self.gradient_as_bucket_view:
            self._attach_grad_views()

    def _hook_backward_start(self, output) -> None:
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
            Variable._execution_engine.queue_callback(self._finalize_backward)

    def _on_grad_ready(self, index: int, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: runs once ``param.grad`` holds this backward's gradient."""
        if self._armed and not self._sync:  # accumulation micro-step: nothing to do (the common case first)
            if self.find_unused_parameters:
                self._used_since_sync[index] = True
            return
        self._any_backward = True
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
        bucket = self._buckets[bucket_index]
        grad = param.grad
        if grad.data_ptr() != bucket.view_ptrs[position]:
            view = bucket.views[position]
            with torch.no_grad():
                view.copy_(grad)
            if self.gradient_as_bucket_view:
                param.grad = view
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch every consecutive ready bucket from the next unlaunched one: index order on all ranks."""
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            bucket = self._buckets[self._next_launch]
            if self._next_launch == 0:
                self._window_start = time.perf_counter()
            # No Python callback (Future.then) on the communication thread: its destructor needs the GIL and,
            # if it runs there while the interpreter exits, aborts the process ("terminate called without an
            # active exception"). The window is stamped in the finalizer instead.
            bucket.grad_bucket.reset_buffer()  # a hook may have replaced it last time (set_buffer)
            bucket.future = self._comm_hook(self._comm_state, bucket.grad_bucket)
            sent = bucket.grad_bucket.buffer()  # the hook may have replaced it with a compressed copy (set_buffer)
            nbytes = self._wire_bytes[self._next_launch] if sent is bucket.buffer else sent.nbytes
            self._stats.add_allreduce(nbytes)
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
        token = start_timer(self._device)
        used_map = None
        if self.find_unused_parameters:
            used = [r or u for r, u in zip(self._ready, self._used_since_sync, strict=True)]
        if self._next_launch < len(self._buckets):
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
        for index, bucket in enumerate(self._buckets):
            try:
                result = bucket.future.wait()
            except RuntimeError as error:
                raise RuntimeError(
                    f"BucketedDDP rank {self.rank}: the all-reduce of bucket {index} failed: another rank failed, was "
                    f"killed, or is stuck (a stuck rank is given up on after the process group's timeout, "
                    f"--ddp-timeout). {error}"
                ) from error
            if isinstance(result, list | tuple):  # a collective's own future holds its output tensors
                result = result[0]
            if isinstance(result, torch.Tensor) and result.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(result.view_as(bucket.buffer))
        self._stats.add_wait(stop_timer(self._device, token))
        if self._measure_window:
            # From the first launch to the end of the wait: the last completion when any communication was
            # exposed; when none was, the window also holds the compute after it and the overlap is ~100% anyway.
            self._stats.add_window((time.perf_counter() - self._window_start) * 1e3)
        unused_everywhere: set[int] = set()
        if used_map is not None:
            used_work.wait()
            unused_everywhere = {i for i, n in enumerate(used_map.tolist()) if n == 0}
            self._used_since_sync = [False] * len(self._params)
        if not self.gradient_as_bucket_view:
            with torch.no_grad():
                for bucket in self._buckets:
                    for i, p, view in zip(bucket.indices, bucket.params, bucket.views, strict=True):
                        if p.grad is None:
                            if i not in unused_everywhere:  # a parameter no rank used keeps grad None
                                p.grad = view.clone()
                        else:
                            p.grad.copy_(view)
        else:
            for i in unused_everywhere:
                if self._view_replaced_none[i]:  # a parameter no rank used gets back the None it had
                    self._params[i].grad = None
        if self.find_unused_parameters:
            self._view_replaced_none = [False] * len(self._params)
        self._armed = False

    def _no_gradient_yet(self) -> bool:
        return self._next_launch == 0 and all(b.pending == len(b.params) for b in self._buckets)

    def _reduce_unused(self) -> None:
        """find_unused_parameters=True: contribute what unused parameters hold locally (zero if nothing)."""
        with torch.no_grad():
            for index, ready in enumerate(self._ready):
                if ready:
                    continue
                bucket_index, position = self._slot[index]
                bucket = self._buckets[bucket_index]
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
        for bucket in self._buckets[: self._next_launch]:
            if bucket.future is not None:
                bucket.future.wait()
                bucket.future = None
        self._next_launch = 0


def _grad_ready_hook(owner: weakref.ref, index: int, param: nn.Parameter) -> None:
    wrapper = owner()
    if wrapper is not None:
        wrapper._on_grad_ready(index, param)


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def _strip_module_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """The wrapper's state_dict is the wrapped module's: no ``module.`` prefix in saved keys."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _add_module_prefix(wrapper: BucketedDDP, state_dict: dict, prefix: str, *args) -> None:
    """Accept the wrapped module's keys, which :func:`_strip_module_prefix` writes, and torch DDP's prefixed ones.

    A key is taken as prefixed only if it is not one of the wrapped module's own keys, so a model whose own child
    is called ``module`` (keys ``module.*``) loads as itself.
    """
    inner = prefix + "module."
    own = set(wrapper.module.state_dict(keep_vars=True))
    for key in [k for k in state_dict if k.startswith(prefix)]:
        name = key[len(prefix) :]
        if name in own or not (name.startswith("module.") and name[len("module.") :] in own):
            state_dict[inner + name] = state_dict.pop(key)
