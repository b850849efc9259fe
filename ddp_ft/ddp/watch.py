"""Checks of the training loop around a BucketedDDP, once per optimizer step, off the backward path.

torch's global optimizer step hooks show BucketedDDP every step of an optimizer holding its parameters.
An error for a step after backwards that all ran under ``no_sync()``; the ranks would step apart.
A warning, once each, for several synced backwards per step, a needless ``find_unused_parameters``,
a forgotten ``set_epoch``, and a slow data loader.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, DistributedSampler

logger = logging.getLogger(__name__)

UNUSED_CHECK_STEPS = 3  # steps without an unused parameter before warning
DATA_WAIT_STEPS = range(3, 9)  # steps whose host gap is measured, past warm-up
DATA_WAIT_SHARE = 0.10  # share of a step spent waiting for data that warns
DATA_WAIT_FLOOR_MS = 1.0  # and the least wait that counts


class OptimizerMatch:
    """Whether an optimizer steps any of these parameters, decided once per optimizer and kept weakly."""

    def __init__(self, params) -> None:
        self._ids = {id(p) for p in params}
        self._holds: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()

    def __call__(self, optimizer: torch.optim.Optimizer) -> bool:
        holds = self._holds.get(optimizer)
        if holds is None:
            holds = any(id(p) in self._ids for group in optimizer.param_groups for p in group["params"])
            self._holds[optimizer] = holds
        return holds


class StepWatch:
    """Watches the optimizer steps over one BucketedDDP's parameters, holding it weakly.

    Args:
        wrapper (nn.Module): the BucketedDDP whose reducer's counters are read.
    """

    def __init__(self, wrapper: torch.nn.Module) -> None:
        self._wrapper = weakref.ref(wrapper)
        self._watches = OptimizerMatch(wrapper._params)
        self._seen_synced = self._seen_unsynced = 0
        self._previous_synced = 0  # synced backwards before the last step
        self._steps = 0
        self._warned: set[str] = set()
        self._samplers: list[tuple[weakref.ref, int, int]] | None = None  # (sampler, epoch, samples since)
        self._loaders: list[weakref.ref] = []
        self._interval_start: float | None = None  # perf_counter() at the last watched step's end
        self._gap_ms: float | None = None  # from there to the next training forward
        self._shares: list[float] = []
        owner = weakref.ref(self)
        handles = (
            register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: _call(owner, "before_step", optimizer)),
            register_optimizer_step_post_hook(lambda optimizer, args, kwargs: _call(owner, "after_step", optimizer)),
        )
        self._release = weakref.finalize(self, _remove, handles)

    def remove(self) -> None:
        self._release()

    def on_forward(self, inputs: tuple, kwargs: dict) -> None:
        """At a training forward, close the host gap after the last step and count samples."""
        if self._gap_ms is None and self._interval_start is not None:
            self._gap_ms = (time.perf_counter() - self._interval_start) * 1e3
        if self._samplers:
            batch = next((t for t in (*inputs, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim()), None)
            if batch is not None:
                self._samplers = [(ref, epoch, seen + batch.shape[0]) for ref, epoch, seen in self._samplers]

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After a watched step, measure waiting for data and check the samplers' epochs."""
        if self._wrapper() is None or not self._watches(optimizer):
            return
        now = time.perf_counter()
        try:  # advisory checks must never stop a run
            if self._gap_ms is not None and self._steps in DATA_WAIT_STEPS and now > self._interval_start:
                share = self._gap_ms / ((now - self._interval_start) * 1e3)
                self._shares.append(share if self._gap_ms >= DATA_WAIT_FLOOR_MS else 0.0)
            if self._steps == DATA_WAIT_STEPS[-1] and self._shares:
                self._check_data_wait(statistics.median(self._shares))
            if self._samplers is None:
                self._find_loaders()
            self._check_epochs()
        except Exception:
            logger.debug("BucketedDDP: the data-side checks stopped", exc_info=True)
            self._samplers, self._shares = [], []
        self._interval_start, self._gap_ms = now, None

    def _find_loaders(self) -> None:
        """Find the live shuffling DistributedSamplers and DataLoaders once, held weakly."""
        # type(), not isinstance(): the heap holds weak proxies whose dead referents raise on access.
        objects = gc.get_objects()
        samplers = [o for o in objects if issubclass(type(o), DistributedSampler) and o.shuffle]
        self._samplers = [(weakref.ref(s), s.epoch, 0) for s in samplers] if len(samplers) == 1 else []
        self._loaders = [weakref.ref(o) for o in objects if issubclass(type(o), DataLoader)]

    def _check_epochs(self) -> None:
        kept = []
        for ref, epoch, seen in self._samplers or []:
            sampler = ref()
            if sampler is None:
                continue
            if sampler.epoch != epoch:
                epoch, seen = sampler.epoch, 0
            elif seen > len(sampler):
                self._warn_once(
                    "epoch",
                    f"BucketedDDP: the DistributedSampler has handed out {seen} samples to this rank, more than its "
                    f"{len(sampler)} per epoch, with its epoch still {epoch}: the next epoch repeats the same order. "
                    "Call sampler.set_epoch(epoch) at the start of every epoch.",
                )
            kept.append((ref, epoch, seen))
        self._samplers = kept

    def _check_data_wait(self, share: float) -> None:
        if share <= DATA_WAIT_SHARE:
            return
        workers = sorted({loader.num_workers for ref in self._loaders if (loader := ref()) is not None})
        self._warn_once(
            "data",
            f"BucketedDDP: at least {share:.0%} of each optimizer step (median of steps {DATA_WAIT_STEPS[0]} to "
            f"{DATA_WAIT_STEPS[-1]}) passes between optimizer.step() and the next forward: loading the next batch "
            f"(or logging). DataLoader num_workers in this process: {workers or 'none found'}; raise num_workers "
            "(and pin_memory=True on GPUs), or pre-tokenize the data, before blaming the scaling.",
        )

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Check the loop since the last step of a watched optimizer.

        Raises:
            RuntimeError: if every backward since the last step ran under ``no_sync()``.
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


def _call(owner: weakref.ref, method: str, optimizer: torch.optim.Optimizer) -> None:
    watch = owner()
    if watch is not None:
        getattr(watch, method)(optimizer)


def _remove(handles: tuple) -> None:
    for handle in handles:
        handle.remove()
