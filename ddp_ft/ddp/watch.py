"""Checks of the training loop around a BucketedDDP, once per optimizer step, off the backward path.

BucketedDDP sees forwards and backwards, not the optimizer. torch's global optimizer step hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) shows it every ``optimizer.step()`` of an optimizer that
holds its parameters, in any loop (plain torch, Accelerate, the HF Trainer). Before each such step it reads the
reducer's counters since the last one and catches what the user's loop got wrong:

- backward passes that all ran under ``no_sync()`` and a step taken outside it: the gradients were never averaged,
  so the ranks would step apart. An error, before the step. (A step taken inside ``no_sync()``, as Accelerate's
  ``LocalSGD`` does on purpose, is the user's choice of local steps.)
- more than one synced backward per step, at two steps in a row (one skipped fp16 step only adds one): an
  accumulation loop without ``no_sync()``. Correct but slow: a warning, once, with the all-reduces and bytes wasted.
- ``find_unused_parameters=True`` while every parameter got a gradient on every rank for the first steps: a
  warning, once, with what it costs per step.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

if TYPE_CHECKING:
    from .wrapper import BucketedDDP

logger = logging.getLogger(__name__)

UNUSED_CHECK_STEPS = 3  # optimizer steps after which an unused parameter never seen makes the search a waste


class StepWatch:
    """Watches the optimizer steps over one BucketedDDP's parameters (see the module docstring).

    Holds the wrapper weakly; the global hook goes when the watch does (with its wrapper) or at :meth:`remove`.

    Args:
        wrapper (BucketedDDP): the wrapper whose reducer's counters are read.
    """

    def __init__(self, wrapper: BucketedDDP) -> None:
        self._wrapper = weakref.ref(wrapper)
        self._params = {id(p) for p in wrapper._params}
        self._holds: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
        self._seen_synced = self._seen_unsynced = 0
        self._previous_synced = 0  # synced backwards before the last step
        self._steps = 0
        self._warned: set[str] = set()
        owner = weakref.ref(self)
        handle = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: _before_step(owner, optimizer))
        self._release = weakref.finalize(self, handle.remove)

    def remove(self) -> None:
        self._release()

    def _watches(self, optimizer: torch.optim.Optimizer) -> bool:
        holds = self._holds.get(optimizer)
        if holds is None:
            holds = any(id(p) in self._params for group in optimizer.param_groups for p in group["params"])
            self._holds[optimizer] = holds
        return holds

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Read what happened since the last step of a watched optimizer; raise or warn (module docstring).

        Raises:
            RuntimeError: the step follows backward passes that all ran under ``no_sync()``, outside it.
        """
        wrapper = self._wrapper()
        if wrapper is None or not self._watches(optimizer):
            return
        reducer = wrapper._reducer
        synced = reducer.synced_done - self._seen_synced
        unsynced = reducer.unsynced_forwards - self._seen_unsynced
        self._seen_synced, self._seen_unsynced = reducer.synced_done, reducer.unsynced_forwards
        previous, self._previous_synced = self._previous_synced, synced
        self._steps += 1
        if synced == 0 and unsynced > 0 and wrapper.require_backward_grad_sync and wrapper.world_size > 1:
            raise RuntimeError(
                f"BucketedDDP: optimizer.step() after {unsynced} forward/backward pass(es) that all ran under "
                "no_sync(): the gradients were never averaged, so the ranks would step apart. Run the last "
                "micro-step of each optimizer step outside no_sync() (accelerator.accumulate(model) does this), or "
                "its backward inside accelerator.trigger_sync_in_backward(model)."
            )
        if synced > 1 and synced == previous:
            self._warn_once(
                "synced",
                f"BucketedDDP: {synced} synced backward passes per optimizer step: {synced - 1} x "
                f"{len(wrapper.bucket_sizes)} all-reduces ({(synced - 1) * sum(reducer._wire_bytes) / 2**20:.1f} MiB) "
                "per step more than needed, each a wait for the slowest rank. Run every micro-step but the last "
                "inside model.no_sync() (accelerator.accumulate(model) does this); the gradients are the same.",
            )
        if reducer.find_unused_parameters and self._steps == UNUSED_CHECK_STEPS and not reducer.saw_unused:
            self._warn_once(
                "unused",
                f"BucketedDDP: find_unused_parameters=True, but every trainable parameter got a gradient on every "
                f"rank in the first {UNUSED_CHECK_STEPS} optimizer steps: it costs one more all-reduce "
                f"({len(wrapper._params)} flags) and a host read per synced backward. Pass "
                "find_unused_parameters=False (TrainingArguments(ddp_find_unused_parameters=False)) unless some "
                "parameter goes unused later.",
            )

    def _warn_once(self, key: str, message: str) -> None:
        wrapper = self._wrapper()
        if key not in self._warned and wrapper is not None and wrapper.rank == 0:
            logger.warning(message)
        self._warned.add(key)


def _before_step(owner: weakref.ref, optimizer: torch.optim.Optimizer) -> None:
    watch = owner()
    if watch is not None:
        watch.before_step(optimizer)
