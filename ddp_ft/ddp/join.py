"""Uneven inputs for BucketedDDP: torch's Join protocol (``torch.distributed.algorithms.join``), as torch DDP has it.

Inside ``with model.join():`` (or ``Join([model, ...])``, or Accelerate's ``join_uneven_inputs``) a rank that has run
out of batches leaves its loop and waits in the context's exit, where torch's :class:`Join` runs this module's
:class:`JoinHook` once per training forward of the ranks still training, until every rank has left. What each side
does per iteration, in the same order on every rank:

1. ``Join.notify_join_context`` (by the context's first joinable): the ranks still training say so; the joined ones'
   ``Join`` answers with zeros and calls the hook.
2. One small all-reduce of flags: which ranks still train (so how many, and the highest of them), whether their
   backward syncs, whether their buffers are due a broadcast, whether ``bucket_cap_mb="auto"`` is still timing
   layouts. The ranks still training wait for it in forward (one small meeting point per training forward, only
   while joining); torch DDP's forward adds about as many (its sync flag and the buffers' source rank).
3. If buffers are due (see ``broadcast_buffers``): every buffer is broadcast from the highest rank still training, as
   torch DDP does under join (rank 0 may have joined with stale buffers).
4. If the backward syncs: the joined ranks launch every bucket's collective through the same comm hook, in the same
   bucket order, on zero buffers of the same sizes, then, with ``find_unused_parameters``, the used-parameter
   all-reduce with no parameter used. The ranks training divide by the initial world size (torch's default) or, with
   ``divide_by_initial_world_size=False``, by the number of ranks still training.

When every rank has joined, the post-hook broadcasts the trainable parameters (and the buffers, with
``broadcast_buffers``) from the highest rank that joined last, so the ranks end with the same model, as torch DDP's.

What stays the user's, as with torch DDP: a joined rank's optimizer does not step, so its state (momentum, Adam
moments) is its last step's, and collectives outside the model (a metric all-reduce, Accelerate's ``LocalSGD``
parameter averaging, SyncBatchNorm) are not shadowed: they need ``throw_on_early_termination=True``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

from .comm_hooks import GradBucket, allreduce_hook


@dataclass(frozen=True)
class JoinRound:
    """What the ranks agreed on for one iteration of a join (step 2 of the module docstring).

    Attributes:
        training (int): ranks still training.
        source (int): the highest of them (group rank): the source of buffer broadcasts.
        syncs (int): ranks whose backward syncs (0 or ``training``; anything else is refused).
        buffers (bool): the buffers are broadcast this iteration.
        trial (bool): ``bucket_cap_mb="auto"`` is still timing layouts on some rank training.
    """

    training: int
    source: int
    syncs: int
    buffers: bool
    trial: bool


class BucketedJoinHook(JoinHook):
    """The joined rank's side of :mod:`ddp_ft.ddp.join` for one BucketedDDP.

    Args:
        ddp (JoinableDDP): the wrapper.
    """

    def __init__(self, ddp: JoinableDDP) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        """Shadow one training forward and its backward of the ranks still training."""
        self.ddp._join_round(joined=True)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank has joined: take the model of the highest last joiner, and leave join mode."""
        self.ddp._join_sync_final_model(is_last_joiner)


class JoinableDDP(Joinable):
    """The Join half of BucketedDDP (a mixin: it reads the wrapper's reducer, buffers and settings)."""

    def _init_join(self) -> None:
        Joinable.__init__(self)
        self._join_divide_initial = True

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """Context manager for training with uneven inputs across ranks, as torch DDP's ``join``.

        Wrap the training loop: a rank that runs out of batches leaves it and shadows the collectives of the
        others (module docstring) until every rank has; then the ranks take the same model.

        Args:
            divide_by_initial_world_size (bool): divide the summed gradients by the world size the wrapper started
                with, so every sample weighs the same (True), or by the ranks still training (False; only with the
                default comm hook). Default: True.
            enable (bool): False for inputs known to be even: no join communication at all. Default: True.
            throw_on_early_termination (bool): raise on every rank as soon as one runs out (for loops with
                collectives of their own). Default: False.

        Returns:
            Join: torch's join context over this model.

        Raises:
            ValueError: ``divide_by_initial_world_size=False`` with a comm hook registered.
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs) -> JoinHook:
        """The :class:`JoinHook` torch's ``Join`` runs on this rank once it has joined.

        Args:
            **kwargs: ``divide_by_initial_world_size`` (bool, default True) as in :meth:`join`; the others belong
                to the context's other joinables.

        Raises:
            ValueError: ``divide_by_initial_world_size=False`` with a comm hook registered.
        """
        self._join_divide_initial = bool(kwargs.get("divide_by_initial_world_size", True))
        self._check_join_divisor()
        return BucketedJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._reducer.buckets[0].buffer.device

    @property
    def join_process_group(self):
        return self.process_group

    # ------------------------------------------------------------------ one iteration, both sides

    def _join_forward(self, buffers_due: bool) -> int | None:
        """A rank still training, at a training forward (or :meth:`trigger_sync_in_backward`) in join mode.

        Returns:
            int | None: the divisor of this iteration's averaging (None: the comm hook's own).
        """
        work = Join.notify_join_context(self)
        divisor = self._join_round(joined=False, buffers_due=buffers_due)
        if work is not None:
            work.wait()  # done by now (it came before the round's all-reduce); not left dangling
        return divisor

    def _join_round(self, joined: bool, buffers_due: bool = False) -> int | None:
        """Steps 2 to 4 of the module docstring, on either side. Returns the divisor (None: the hook's own).

        Raises:
            RuntimeError: on every rank alike: the ranks still training disagree whether this backward syncs, or
                ``bucket_cap_mb="auto"`` is still timing layouts.
        """
        agreed = self._join_exchange(joined, buffers_due)
        _check_round(agreed)
        if agreed.buffers:
            src = agreed.source
            if self.process_group is not None:
                src = dist.get_global_rank(self.process_group, src)
            self._broadcast_from([b for _, b in self._module_buffers], src)
            self._buffer_versions = [b._version for _, b in self._module_buffers]
        full = self._join_divide_initial or agreed.training == self.world_size
        divisor = None if full else agreed.training
        if divisor is not None:
            self._check_join_divisor()
        if joined and agreed.syncs:
            self._shadow_backward(divisor)
        return divisor

    def _join_exchange(self, joined: bool, buffers_due: bool) -> JoinRound:
        world = self.world_size
        flags = torch.zeros(world + 3, dtype=torch.int64, device=self.join_device)
        if not joined:
            moved = any(
                b._version != seen for (_, b), seen in zip(self._module_buffers, self._buffer_versions, strict=True)
            )
            flags[self.rank] = 1
            flags[world] = int(self.require_backward_grad_sync)
            flags[world + 1] = int(buffers_due and self.broadcast_buffers and moved)
            flags[world + 2] = int(self._autotuner is not None and self._autotuner.active)
        dist.all_reduce(flags, group=self.process_group)
        values = flags.tolist()
        training = [r for r in range(world) if values[r]]
        source = training[-1] if training else -1
        return JoinRound(len(training), source, values[world], values[world + 1] > 0, values[world + 2] > 0)

    def _shadow_backward(self, divisor: int | None) -> None:
        """The joined side of a synced backward: every bucket's collective on zeros, in bucket order."""
        reducer = self._reducer
        hook, state = reducer.launch_hook(divisor)
        futures = []
        for spec, bucket in zip(reducer.layout, reducer.buckets, strict=True):
            zeros = torch.zeros_like(bucket.buffer)
            views = [zeros[o : o + p.numel()].view_as(p) for p, o in zip(bucket.params, spec.offsets, strict=True)]
            last = spec.index == len(reducer.buckets) - 1
            futures.append(hook(state, GradBucket(spec.index, zeros, bucket.params, views, last)))
        if self.find_unused_parameters:  # after every bucket, as the finalizer of the ranks training: nothing used
            used = torch.zeros(len(self._params), dtype=torch.int32, device=self.join_device)
            futures.append(dist.all_reduce(used, group=self.process_group, async_op=True).get_future())
        for future in futures:
            future.wait()

    def _join_sync_final_model(self, is_last_joiner: bool) -> None:
        """Broadcast the trainable parameters (and buffers) from the highest last joiner; leave join mode."""
        candidate = torch.tensor([self.rank if is_last_joiner else -1], dtype=torch.int64, device=self.join_device)
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=self.process_group)
        src = int(candidate.item())
        if self.process_group is not None:
            src = dist.get_global_rank(self.process_group, src)
        buffers = [b for _, b in self._module_buffers] if self.broadcast_buffers else []
        self._broadcast_from([*self._params, *buffers], src)
        self._buffer_versions = [b._version for _, b in self._module_buffers]
        # torch's Join leaves its config set after the context: a forward after it would keep notifying.
        self._join_config = _JoinConfig.construct_disabled_join_config()

    def _check_join_divisor(self) -> None:
        """``divide_by_initial_world_size=False`` needs the default averaging, which it changes."""
        if not self._join_divide_initial and self._reducer.launch_hook(None)[0] is not allreduce_hook:
            raise ValueError(
                "BucketedDDP.join(divide_by_initial_world_size=False) with a comm hook registered: the hook does its "
                "own averaging, so the divisor cannot change (torch DDP ignores the argument then). Keep "
                "divide_by_initial_world_size=True (the default), or register no comm hook."
            )


def _check_round(agreed: JoinRound) -> None:
    if agreed.trial:
        raise RuntimeError(
            "BucketedDDP: training under join (model.join(), accelerator.join_uneven_inputs with even_batches=False) "
            "while bucket_cap_mb='auto' is still timing layouts: a rank that joins mid-trial would shadow another "
            "layout's buckets. Give bucket_cap_mb a number (e.g. the one an 'auto' run logged), or enter the join "
            "after the trial's first steps."
        )
    if agreed.syncs not in (0, agreed.training):
        raise RuntimeError(
            f"BucketedDDP: under join, {agreed.syncs} of the {agreed.training} ranks still training sync this "
            "backward and the others run it under no_sync(): their all-reduces would not pair up. Gradient "
            "accumulation with uneven inputs needs every rank to sync at the same micro-steps; Accelerate's "
            "accumulate() syncs at each rank's own last batch, so with even_batches=False the micro-steps drift "
            "apart. Use even_batches=True (Accelerate's default), or accumulate over a number of batches that the "
            "ranks' batch counts share."
        )
