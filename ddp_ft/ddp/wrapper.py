"""BucketedDDP: data-parallel training with fixed gradient buckets whose all-reduces overlap backward."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .autotune import AUTO, BucketAutotuner, BucketChoice, check_comm_hook
from .buckets import ParamSpec, compute_bucket_assignment
from .comm_hooks import CommHook
from .join import JoinableDDP
from .placement import device_identity, model_device
from .reducer import Reducer
from .state_dict import add_module_prefix, report_keys_unprefixed, strip_module_prefix
from .stats import CommStats
from .timeline import BackwardTimeline
from .verify import verify_across_ranks
from .watch import StepWatch

logger = logging.getLogger(__name__)


class BucketedDDP(nn.Module, JoinableDDP):
    """Data parallelism with fixed gradient buckets whose all-reduces overlap the rest of backward.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel`` where the knobs mean the same thing,
    written for parameter-efficient fine-tuning: only trainable parameters are bucketed, broadcast and
    reduced; a frozen (e.g. 4-bit) base is left alone and only checksummed.

    Guarantees:
        * Layout. Trainable parameters are split into buckets in reverse registration order (the order
          backward produces gradients), by dtype and device: a pure function of the parameter list
          (:func:`compute_bucket_assignment`), fixed for the life of the wrapper (with ``bucket_cap_mb="auto"``, once
          the trial has switched every rank to the same choice at the same synced backward). At construction every
          rank compares names, shapes, dtypes, order and bucket boundaries with rank 0, and SHA-256 digests
          of the frozen parameters in order, with the quant state of bitsandbytes 4-bit weights
          (:func:`~ddp_ft.ddp.checksum.frozen_digest`; about 3 s per rank for Qwen3-4B NF4); any difference
          raises on every rank naming the first differing parameter, instead of a hang or a silent
          mis-reduction (:mod:`~ddp_ft.ddp.verify`).
        * Start state. Trainable parameters and buffers are broadcast from rank 0. Afterwards a buffer is
          re-broadcast only if it changed since the last broadcast (see ``broadcast_buffers``), so a constant
          buffer such as a rotary ``inv_freq`` costs no meeting point per step.
        * Memory. Each bucket is one flat buffer. With ``gradient_as_bucket_view`` every ``param.grad``
          is a view into it, so there is no copy in or out; after ``zero_grad(set_to_none=True)`` the
          next forward re-attaches zeroed views (:mod:`~ddp_ft.ddp.grad_buffers`).
        * Equality. When ``loss.backward()`` returns, every gradient is the average over ranks, as with
          torch DDP: no ``finish()`` call is needed, so HF Trainer and Accelerate work unchanged.
        * Lifecycle. The gradient hooks hold the wrapper's reducer only weakly: a dropped wrapper is freed with its
          reducer and its hooks removed, so the module can train alone or be wrapped again; :meth:`remove_hooks`
          does it at once.

    One synced backward, in phases (phases 2 to 4 are the :class:`~ddp_ft.ddp.reducer.Reducer`'s):
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

    Uneven inputs: inside :meth:`join` (torch's ``Join`` protocol; Accelerate's ``join_uneven_inputs``) a rank out of
    batches shadows the others' bucket all-reduces with zeros, and the ranks end with the same model, as with torch
    DDP (:mod:`~ddp_ft.ddp.join`).

    Args:
        module (nn.Module): the model; its trainable parameters are the ones with ``requires_grad``.
        bucket_cap_mb (float | str): bucket size cap in MiB, or ``"auto"``: time a few layouts over the first synced
            backward passes and keep the fastest, the same on every rank (:mod:`~ddp_ft.ddp.autotune`,
            :attr:`bucket_choice`). Default: 25.
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
            (torch DDP's may), so evaluation on uneven shards cannot hang. Only the buffers whose version
            counter (``tensor._version``, bumped by every in-place write) moved since the last broadcast are
            sent, with the other buffers of their submodule, and none at all if none moved: the values are
            torch DDP's, without its per-step meeting point for buffers that never change. The submodule rule
            is there because some kernels write buffers without bumping their version (``batch_norm``
            updates ``running_mean``/``running_var`` in place unseen; ``num_batches_tracked``, bumped by
            ``add_``, reveals it). The decision is local, so it assumes what it needs to be
            the same on every rank: the same code mutates the same buffers on every rank (BatchNorm running
            stats updated by the same forward, a counter bumped by the same step); a buffer written on one
            rank only would make the ranks call different collectives. As a guard, each broadcast is preceded
            by a broadcast of the number of buffers it sends, and a rank whose count differs from rank 0's
            raises naming the buffers instead of mis-reducing (a rank that sends none while another sends
            some still waits until the process group's timeout). Writes through ``.data`` or ``set_()`` are not seen, as
            they do not bump the version. Default: True.
        process_group (ProcessGroup | None): group to reduce over. Default: the default group.

    Raises:
        RuntimeError: if no process group is initialised; the parameters are on several devices or not on this
            process's GPU (``device_map="auto"``), or two ranks share a GPU under NCCL
            (:mod:`~ddp_ft.ddp.placement`); the layout or frozen weights differ across ranks.
        ValueError: if the module has no trainable parameters, a cap is not positive, or ``bucket_cap_mb`` is a
            string other than ``"auto"``.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float | str = 25.0,
        first_bucket_cap_mb: float = 1.0,
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self._init_join()  # torch's Join protocol: model.join(), Join([model]) (ddp_ft.ddp.join)
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
        if isinstance(bucket_cap_mb, str) and bucket_cap_mb != AUTO:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r}: give a number of MiB or {AUTO!r}.")
        self._autotuner = BucketAutotuner(specs, first_bucket_cap_mb, process_group) if bucket_cap_mb == AUTO else None
        if self._autotuner is not None:
            layout = self._autotuner.initial_layout  # every candidate is a pure function of the verified specs
        else:
            layout = compute_bucket_assignment(specs, bucket_cap_mb, first_bucket_cap_mb)
        device = model_device(module)  # one whole replica on this rank's device, or an error naming the fix
        verify_across_ranks(module, specs, layout, self.world_size, process_group, device_identity(device))
        # Fixed at construction, as torch DDP's modules_buffers.
        self._module_buffers = list(module.named_buffers())
        self._broadcast_from([*self._params, *(b for _, b in self._module_buffers)])
        self._buffer_versions = [b._version for _, b in self._module_buffers]

        # The per-backward half (readiness, ordered launch, finalizer, abort, unused parameters): see reducer.py.
        self._reducer = Reducer(
            self._names, self._params, layout, process_group, gradient_as_bucket_view, find_unused_parameters
        )
        if self._autotuner is not None:
            self._autotuner.attach(self._reducer)
        self._hook_registered = False
        # The user's loop, checked at each optimizer step over these parameters (no_sync misuse, wasted syncs).
        self._watch = StepWatch(self)
        # Buffers are broadcast by the first forward after a synced one (see broadcast_buffers). Broadcasting
        # before the synced micro-step instead adds a second meeting point per step, after the ranks have
        # drifted apart over the no_sync micro-steps.
        self._buffers_need_sync = True
        self._register_state_dict_hook(strip_module_prefix)
        self._load_prefix = ""  # the prefix of the load in progress (add_module_prefix), for its key report
        self.register_load_state_dict_pre_hook(add_module_prefix)
        self.register_load_state_dict_post_hook(report_keys_unprefixed)
        if self.rank == 0:
            sizes = [f"{nbytes / 2**20:.2f}" for nbytes in self.bucket_nbytes]
            logger.info(
                "BucketedDDP: %d trainable tensors (%d elements) in %d buckets [MiB: %s], world size %d",
                len(self._params),
                sum(p.numel() for p in self._params),
                len(layout),
                ", ".join(sizes),
                self.world_size,
            )

    # ------------------------------------------------------------------ public API

    def forward(self, *inputs, **kwargs):
        if self.hooks_removed:
            raise RuntimeError(
                "BucketedDDP: this wrapper's hooks were removed (remove_hooks()); wrap the module again."
            )
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self._watch.on_forward(inputs, kwargs)
            joining = self._join_config.enable  # in a torch Join over uneven inputs: its round first (join.py)
            divisor = self._join_forward(self._buffers_need_sync) if joining else None
            self._reducer.prepare_for_backward(sync=self.require_backward_grad_sync, divisor=divisor)
            if self._buffers_need_sync and self.broadcast_buffers and not joining:
                self._broadcast_buffers()
            self._buffers_need_sync = self.require_backward_grad_sync
        output = self.module(*inputs, **kwargs)
        if grad_enabled and self.require_backward_grad_sync:
            self._reducer.hook_backward_start(output)
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

    @contextmanager
    def trigger_sync_in_backward(self) -> Iterator[None]:
        """Make the backward run in this context sync, also when its forward ran inside :meth:`no_sync`.

        For several forwards under ``no_sync`` whose backwards run afterwards (Accelerate's
        ``trigger_sync_in_backward``; torch DDP's reducer is re-armed the same way): the iteration is armed as a
        synced one, so the next backward averages everything accumulated since the last synced backward, and a
        forward inside the context syncs too. Buffers are broadcast again at the next forward, as after any
        synced backward.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = True
        # Under join the joined ranks learn of this synced backward as of a forward's (a round without buffers).
        divisor = self._join_forward(buffers_due=False) if self._join_config.enable else None
        self._reducer.prepare_for_backward(sync=True, divisor=divisor)
        self._buffers_need_sync = True
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
        self._reducer.remove_hooks()
        self._watch.remove()

    @property
    def hooks_removed(self) -> bool:
        """True once :meth:`remove_hooks` ran (the wrapper can no longer train)."""
        return not self._reducer.hooks_alive

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
            ValueError: for PowerSGD with ``bucket_cap_mb="auto"`` (its state is kept per bucket index).
        """
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
        if self._hook_registered:
            raise RuntimeError("register_comm_hook can only be called once (a comm hook is already registered).")
        if self._reducer.any_backward:
            raise RuntimeError("register_comm_hook must be called before the first backward.")
        if self._autotuner is not None:
            check_comm_hook(state, hook)
        self._reducer.set_comm_hook(state, hook)
        self._hook_registered = True

    @property
    def bucket_choice(self) -> BucketChoice | None:
        """With ``bucket_cap_mb="auto"``, the candidates, their timings and the kept caps once decided; else None."""
        return None if self._autotuner is None else self._autotuner.choice

    @property
    def bucket_sizes(self) -> list[int]:
        """Elements per bucket, in launch order (the layout in use, which ``bucket_cap_mb="auto"`` changes)."""
        return [b.numel for b in self._reducer.layout]

    @property
    def bucket_param_names(self) -> list[list[str]]:
        """Names of the parameters in each bucket, in launch order and buffer order: which bucket (and so which
        all-reduce) a parameter's gradient travels in, e.g. to log or check the launch order against backward."""
        return [[self._names[i] for i in b.param_indices] for b in self._reducer.layout]

    @property
    def bucket_nbytes(self) -> list[int]:
        """Bytes of each bucket's flat buffer, in launch order (what the default hook sends per bucket)."""
        return [b.buffer.nbytes for b in self._reducer.buckets]

    @property
    def bucket_buffers(self) -> list[torch.Tensor]:
        """Each bucket's flat gradient buffer, in launch order, for inspection: with ``gradient_as_bucket_view``
        every trainable ``param.grad`` is a view into one of them. Writing to them writes the gradients. With
        ``bucket_cap_mb="auto"`` they are new tensors after each change of layout (see :attr:`bucket_choice`)."""
        return [b.buffer for b in self._reducer.buckets]

    def last_comm_stats(self) -> CommStats:
        """Communication of the most recent backward (zero calls if it ran under ``no_sync``)."""
        return self._reducer.stats.last()

    @property
    def last_gradient_ready_at(self) -> float | None:
        """``time.perf_counter()`` when the latest synced backward had its last gradient ready, before the final
        wait (host time: on CUDA, when the host queued the last gradient's kernels), or None before the first.

        Forward and backward up to here is this rank's compute; the rest of the step is communication and
        waiting for the slower rank (``ddp_ft.training.loop`` gathers it per step).
        """
        return getattr(self._reducer, "last_ready_at", None)

    def last_backward_timeline(self) -> BackwardTimeline | None:
        """When each bucket was ready in the latest synced backward, from its start (``ddp-ft forecast`` reads
        it), or None before the first. On CUDA, events read now: call it after the step's own wait."""
        return self._reducer.clock.read()

    def pop_comm_stats(self) -> CommStats:
        """Communication since the previous call (e.g. one optimizer step, accumulation included); resets."""
        return self._reducer.stats.pop()

    @property
    def pending_comm_waits(self) -> int:
        """End-of-backward wait measurements held for the next :meth:`pop_comm_stats`, bounded by
        :data:`~ddp_ft.ddp.stats.MAX_PENDING_WAITS` however long nobody pops (older ones are folded)."""
        return self._reducer.stats.held_waits

    # ------------------------------------------------------------------ construction helpers

    def _broadcast_from(self, tensors: list[torch.Tensor], src: int | None = None) -> None:
        """Broadcast ``tensors`` in place from global rank ``src`` (None: the group's rank 0), flat per dtype."""
        if self.world_size == 1:
            return
        if src is None:
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
        """Broadcast from rank 0 the buffers written since the last broadcast (none: no collective)."""
        moved = {
            _owner(name)
            for (name, b), seen in zip(self._module_buffers, self._buffer_versions, strict=True)
            if b._version != seen
        }
        changed = [(name, b) for name, b in self._module_buffers if _owner(name) in moved]
        if not changed or self.world_size == 1:
            return
        count = torch.tensor([len(changed)], dtype=torch.int64, device=changed[0][1].device)
        self._broadcast_from([count])
        if int(count) != len(changed):
            raise RuntimeError(
                f"BucketedDDP: rank {self.rank} changed {len(changed)} buffer(s) since the last broadcast "
                f"({[name for name, _ in changed]}), rank 0 changed {int(count)}: buffers must be written by the "
                "same code on every rank (see broadcast_buffers)."
            )
        self._broadcast_from([b for _, b in changed])
        self._buffer_versions = [b._version for _, b in self._module_buffers]


def _owner(buffer_name: str) -> str:
    """The submodule a buffer belongs to: its buffers are sent together when any of them was written."""
    return buffer_name.rpartition(".")[0]
