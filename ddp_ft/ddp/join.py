"""Uneven inputs for BucketedDDP through torch's Join protocol, as torch DDP has it.

Inside ``model.join()`` a rank out of batches waits in the context's exit.
There :class:`BucketedJoinHook` shadows each training forward of the others, in the same order on every rank:

1. ``Join.notify_join_context``: training ranks say so; joined ranks answer with zeros.
2. One small all-reduce of flags (:class:`JoinRound`).
3. If buffers are due, all are broadcast from the highest training rank, as rank 0 may be stale.
4. If the backward syncs, joined ranks reduce zero buckets through the same hook, in bucket order.

When all have joined, the highest last joiner broadcasts the model, so the ranks end equal.
A joined rank's optimizer does not step, and collectives outside the model are not shadowed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

from .comm_hooks import GradBucket, allreduce_hook


@dataclass(frozen=True)
class JoinRound:
    """What the ranks agreed on for one join iteration.

    Attributes:
        training (int): ranks still training.
        source (int): the highest of them, source of buffer broadcasts.
        syncs (int): ranks whose backward syncs.
        buffers (bool): buffers are broadcast this iteration.
        trial (bool): ``bucket_cap_mb="auto"`` is still timing layouts.
    """

    training: int
    source: int
    syncs: int
    buffers: bool
    trial: bool


class BucketedJoinHook(JoinHook):
    """The joined rank's side of the join for one BucketedDDP.

    Args:
        ddp (JoinableDDP): the wrapper.
    """

    def __init__(self, ddp: JoinableDDP) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        """Shadow one training forward and its backward of the ranks still training."""
        self.ddp._join_round(joined=True)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Take the model of the highest last joiner and leave join mode."""
        self.ddp._join_sync_final_model(is_last_joiner)


class JoinableDDP(Joinable):
    """The Join half of BucketedDDP, a mixin over the wrapper's state."""

    def _init_join(self) -> None:
        Joinable.__init__(self)
        self._join_divide_initial = True

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """Context manager for training with uneven inputs across ranks, as torch DDP's ``join``.

        Args:
            divide_by_initial_world_size (bool): average over the starting world size, else the ranks still
                training. Default: True.
            enable (bool): False for even inputs, with no join communication. Default: True.
            throw_on_early_termination (bool): raise on every rank once one runs out. Default: False.

        Returns:
            Join: torch's join context over this model.

        Raises:
            ValueError: if ``divide_by_initial_world_size=False`` with a comm hook registered.

        Example:
            >>> with model.join():
            ...     for batch in loader:
            ...         model(**batch).loss.backward()
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs) -> JoinHook:
        """The :class:`JoinHook` torch's ``Join`` runs on this rank once it joined.

        Args:
            **kwargs: ``divide_by_initial_world_size`` as in :meth:`join`; others belong to other joinables.

        Raises:
            ValueError: as :meth:`join`.
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
        """A training rank's side of one join iteration; returns the divisor, or None for the hook's own."""
        work = Join.notify_join_context(self)
        divisor = self._join_round(joined=False, buffers_due=buffers_due)
        if work is not None:
            work.wait()  # done by now; not left dangling
        return divisor

    def _join_round(self, joined: bool, buffers_due: bool = False) -> int | None:
        """Steps 2 to 4 on either side; returns the divisor, or None for the hook's own."""
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
        if self.find_unused_parameters:  # after the buckets, as the training ranks' finalizer: nothing used
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
        # torch's Join leaves its config set, so a later forward would keep notifying.
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
