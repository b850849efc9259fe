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
from .four_bit import keep_4bit_training_layout
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
    """Data parallelism with fixed gradient buckets whose all-reduces overlap backward.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel``, written for parameter-efficient fine-tuning.
    Only trainable parameters are bucketed, broadcast and reduced. A frozen base is only checksummed.

    Guarantees:
        * Layout. Buckets follow reverse registration order, fixed for the wrapper's life.
          Every rank checks its layout and frozen weights against rank 0 (:mod:`~ddp_ft.ddp.verify`).
        * Start state. Trainable parameters and buffers are broadcast from rank 0.
        * Memory. With ``gradient_as_bucket_view`` each ``param.grad`` views its bucket's flat buffer.
        * Equality. When ``loss.backward()`` returns, gradients are averaged over ranks, as in torch DDP.
        * Lifecycle. Hooks hold the reducer weakly, so a dropped wrapper removes them.

    The tests behind each guarantee: docs/guarantees.md.

    One synced backward:
        1. ``forward`` arms the iteration and hooks its outputs without changing them.
        2. Backward reaching an output queues the finalizer on the outermost backward pass.
        3. A bucket launches when its last parameter is ready, strictly in index order.
        4. The finalizer waits for all buckets and copies results back where needed.

    A backward that accumulates into no parameter, such as ``torch.autograd.grad``, does not end the iteration.
    As in torch DDP, the forward that built a graph decides whether its backward syncs.
    Inside :meth:`join`, a rank out of batches shadows the others' all-reduces with zeros.

    Args:
        module (nn.Module): the model; parameters with ``requires_grad`` are trained.
        bucket_cap_mb (float | str): bucket cap in MiB, or ``"auto"`` to time layouts and keep the fastest. Default: 25.
        first_bucket_cap_mb (float): cap of the first bucket, small so communication starts early. Default: 1.
        gradient_as_bucket_view (bool): make ``param.grad`` a view into the bucket buffer. Default: True.
        find_unused_parameters (bool): allow parameters without a gradient, as in torch DDP. Default: False.
        broadcast_buffers (bool): broadcast buffers that changed from rank 0, once per optimizer step. Default: True.
        process_group (ProcessGroup | None): group to reduce over. Default: the default group.

    Raises:
        RuntimeError: without a process group, for misplaced parameters, or if ranks differ.
        ValueError: if nothing is trainable, a cap is not positive, or ``bucket_cap_mb`` is another string.

    Example:
        >>> model = BucketedDDP(model, bucket_cap_mb="auto")
        >>> model(**batch).loss.backward()
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
        self._init_join()  # torch's Join protocol (join.py)
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
            layout = self._autotuner.initial_layout  # candidates are pure functions of the verified specs
        else:
            layout = compute_bucket_assignment(specs, bucket_cap_mb, first_bucket_cap_mb)
        device = model_device(module)  # one whole replica on this rank's device
        keep_4bit_training_layout(module)  # before the checksums: an evaluation may have repacked the weights
        verify_across_ranks(module, specs, layout, self.world_size, process_group, device_identity(device))
        # Fixed at construction, as torch DDP's modules_buffers.
        self._module_buffers = list(module.named_buffers())
        self._broadcast_from([*self._params, *(b for _, b in self._module_buffers)])
        self._buffer_versions = [b._version for _, b in self._module_buffers]

        # Per-backward work: see reducer.py.
        self._reducer = Reducer(
            self._names, self._params, layout, process_group, gradient_as_bucket_view, find_unused_parameters
        )
        if self._autotuner is not None:
            self._autotuner.attach(self._reducer)
        self._hook_registered = False
        # Checks the user's loop at each optimizer step.
        self._watch = StepWatch(self)
        # Broadcast at the first forward after a synced one, where the ranks have just met.
        self._buffers_need_sync = True
        self._register_state_dict_hook(strip_module_prefix)
        self._load_prefix = ""  # the prefix of the load in progress, for its key report
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
            joining = self._join_config.enable  # under torch Join, its round comes first (join.py)
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

        Example:
            >>> with model.no_sync():
            ...     model(**batch).loss.backward()
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @contextmanager
    def trigger_sync_in_backward(self) -> Iterator[None]:
        """Make the next backward sync, even if its forward ran inside :meth:`no_sync`.

        Accelerate's ``trigger_sync_in_backward``; torch DDP re-arms its reducer the same way.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = True
        # Joined ranks see this as a forward without buffers.
        divisor = self._join_forward(buffers_due=False) if self._join_config.enable else None
        self._reducer.prepare_for_backward(sync=True, divisor=divisor)
        self._buffers_need_sync = True
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def remove_hooks(self) -> None:
        """Remove the gradient hooks, so the module trains alone or can be wrapped again.

        Idempotent, and done on garbage collection too. Launched communication finishes first.
        """
        self._reducer.remove_hooks()
        self._watch.remove()

    @property
    def hooks_removed(self) -> bool:
        """True once :meth:`remove_hooks` ran."""
        return not self._reducer.hooks_alive

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Replace the default averaging all-reduce with ``hook(state, bucket) -> Future[Tensor]``.

        The future must hold the averaged ``bucket.buffer()``, or a tensor of its size to copy back.

        Args:
            state (object): passed to the hook; for built-in and torch hooks, the process group or None.
            hook (Callable): a hook from :mod:`ddp_ft.ddp.comm_hooks` or torch's ``default_hooks``.

        Raises:
            TypeError: if ``hook`` is not callable.
            RuntimeError: if a hook is already registered or a backward already ran.
            ValueError: for PowerSGD with ``bucket_cap_mb="auto"``.

        Example:
            >>> model.register_comm_hook(None, bf16_compress_hook)
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
        """The autotuner's candidates, timings and choice with ``bucket_cap_mb="auto"``; else None."""
        return None if self._autotuner is None else self._autotuner.choice

    @property
    def bucket_sizes(self) -> list[int]:
        """Elements per bucket, in launch order."""
        return [b.numel for b in self._reducer.layout]

    @property
    def bucket_param_names(self) -> list[list[str]]:
        """Names of the parameters in each bucket, in launch order."""
        return [[self._names[i] for i in b.param_indices] for b in self._reducer.layout]

    @property
    def bucket_nbytes(self) -> list[int]:
        """Bytes of each bucket's flat buffer, in launch order."""
        return [b.buffer.nbytes for b in self._reducer.buckets]

    @property
    def bucket_buffers(self) -> list[torch.Tensor]:
        """Each bucket's flat gradient buffer, in launch order; ``"auto"`` replaces them on a layout change."""
        return [b.buffer for b in self._reducer.buckets]

    def last_comm_stats(self) -> CommStats:
        """Communication of the most recent backward (zero calls if it ran under ``no_sync``)."""
        return self._reducer.stats.last()

    @property
    def last_gradient_ready_at(self) -> float | None:
        """Host time when the latest synced backward's last gradient was ready, or None before the first.

        Before it is this rank's compute; after it, communication and waiting for slower ranks.
        """
        return getattr(self._reducer, "last_ready_at", None)

    def last_backward_timeline(self) -> BackwardTimeline | None:
        """When each bucket was ready in the latest synced backward, or None before the first.

        On CUDA it reads events, so call it after the step's own wait.
        """
        return self._reducer.clock.read()

    def pop_comm_stats(self) -> CommStats:
        """Communication since the previous call, e.g. one optimizer step; resets."""
        return self._reducer.stats.pop()

    @property
    def pending_comm_waits(self) -> int:
        """End-of-backward waits held for the next :meth:`pop_comm_stats`, bounded by ``MAX_PENDING_WAITS``."""
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
        """Broadcast from rank 0 the buffers whose ``_version`` moved since the last broadcast.

        Writes through ``.data`` or ``set_()`` do not bump it and are missed.
        """
        moved = {
            _owner(name)
            for (name, b), seen in zip(self._module_buffers, self._buffer_versions, strict=True)
            if b._version != seen
        }
        changed = [(name, b) for name, b in self._module_buffers if _owner(name) in moved]
        if not changed or self.world_size == 1:
            return
        # Every rank must write the same buffers; a count mismatch raises instead of mis-reducing.
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
    """The submodule owning a buffer; ``batch_norm`` writes running stats without bumping their version."""
    return buffer_name.rpartition(".")[0]
