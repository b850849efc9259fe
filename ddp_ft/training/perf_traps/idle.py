"""An idle device with memory to spare: one optimizer step measured, a larger micro-batch advised.

One optimizer step (the :data:`MEASURED_STEP`-th) is measured on rank 0: the share of its wall time the device was
busy (the union of its kernels' intervals, from ``torch.profiler``'s CUDA activity) and the peak memory against the
device's. Under half busy the step is host-bound (Python, autograd and kernel launches set the pace, as at micro-batch
1 on a fast GPU); if a larger micro-batch fits, a warning names it, the gain to expect and how to set it. Only CUDA is
measured (:func:`step_profiler`): a CPU has no device to idle.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ...ddp.watch import OptimizerMatch
from ..model.memory import AUTO_MARGIN

logger = logging.getLogger(__name__)

MEASURED_STEP = 4  # the optimizer step measured: past the first steps' allocations, compilation and warm-up
IDLE_SHARE = 0.5  # a device busy less than this share of the step waits on the host
MEASURE_TRIES = 3  # steps measured at most: a step with an evaluation inside it is measured again at the next one


@dataclass(frozen=True)
class StepUsage:
    """One optimizer step on the device, as a :class:`StepProfiler` measured it.

    Args:
        busy (float): share of the step's wall time with a kernel or copy running on the device, in [0, 1].
        resident_bytes (int): allocated when the step started: weights, optimizer state, gradients.
        peak_bytes (int): the most ever allocated (``max_memory_allocated``, not reset: the user's own reading of it
            stays intact), so never below this step's peak.
        total_bytes (int): the device's memory.
    """

    busy: float
    resident_bytes: int
    peak_bytes: int
    total_bytes: int


class StepProfiler(Protocol):
    """Measures the device over one optimizer step: ``start()`` at its beginning, ``stop()`` at its end."""

    def start(self) -> None: ...

    def stop(self) -> StepUsage | None: ...


def busy_ns(intervals: list[tuple[int, int]]) -> int:
    """The length of the union of ``(start, end)`` intervals: the time at least one of them was running."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


class CudaStepProfiler:
    """A :class:`StepProfiler` for one CUDA device: its kernels and copies from ``torch.profiler``'s CUDA activity
    (the union of their intervals against the step's wall time), its memory from the caching allocator.

    The step starts and ends on an idle device (one ``synchronize`` each), so neither the step before's kernels nor
    this step's tail are misplaced. Tracing adds a little host time per launch, so a step reads slightly less busy
    than it is; the threshold (half) leaves room for that.

    Args:
        device (torch.device): the CUDA device of this process.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._profile: torch.profiler.profile | None = None
        self._resident = self._started = 0

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        self._resident = torch.cuda.memory_allocated(self.device)
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        self._profile.start()
        self._started = time.perf_counter_ns()

    def stop(self) -> StepUsage | None:
        torch.cuda.synchronize(self.device)
        wall = time.perf_counter_ns() - self._started
        self._profile.stop()
        results = self._profile.profiler.kineto_results if self._profile.profiler is not None else None
        device_events = [e for e in (results.events() if results is not None else []) if e.device_type() == _CUDA]
        self._profile = None
        if wall <= 0:
            return None
        busy = min(1.0, busy_ns([(e.start_ns(), e.end_ns()) for e in device_events]) / wall)
        total = torch.cuda.mem_get_info(self.device)[1]
        return StepUsage(busy, self._resident, torch.cuda.max_memory_allocated(self.device), total)


_CUDA = torch.autograd.DeviceType.CUDA


def step_profiler(device: torch.device) -> StepProfiler | None:
    """The profiler of a step on ``device``: CUDA's, or None (nothing is measured) on any other device.

    Entry points call it through this module at prepare time, so a test can put a fake in its place.
    """
    return CudaStepProfiler(device) if device.type == "cuda" else None


@dataclass(frozen=True)
class MicroBatchAdvice:
    """A larger micro-batch that fits, from one measured step (:func:`larger_micro_batch`).

    Args:
        micro_batch (int): the micro-batch that fits.
        accumulation (int): micro-batches per optimizer step with it.
        keeps_effective_batch (bool): ``micro_batch x accumulation`` equals the measured step's samples per rank.
        expected_peak (int): bytes, ``resident + micro_batch x`` the measured bytes per sample.
        gain (float): the tokens/s to expect at most, as a multiple: ``min(micro_batch / measured, 1 / busy)``.
    """

    micro_batch: int
    accumulation: int
    keeps_effective_batch: bool
    expected_peak: int
    gain: float


def larger_micro_batch(
    usage: StepUsage, micro_batch: int, accumulation: int, margin: float = AUTO_MARGIN
) -> MicroBatchAdvice | None:
    """The largest micro-batch worth advising after a step that kept the device under :data:`IDLE_SHARE` busy.

    Activations grow with the micro-batch, the rest stays: at micro-batch ``m`` the peak is about
    ``resident + m x (peak - resident) / measured``, and it must stay under the device's memory less ``margin`` (as
    ``--micro-batch auto``'s budget, ``ddp_ft.training.model.memory.AUTO_MARGIN``). Among the micro-batches that fit,
    the largest divisor of the step's samples per rank keeps the effective batch (the accumulation shrinks to match);
    without one (accumulation 1), the largest that fits, which grows the effective batch. A host-bound step takes about
    as long at a larger micro-batch, so tokens/s grow with it until the device is busy: at most ``1 / busy``.

    Args:
        usage (StepUsage): the measured step.
        micro_batch (int): its samples per forward.
        accumulation (int): its forwards (micro-batches).
        margin (float): share of the device's memory kept free.
            Default: :data:`~ddp_ft.training.model.memory.AUTO_MARGIN`.

    Returns:
        MicroBatchAdvice | None: None when the device was busy enough or nothing larger fits.
    """
    if usage.busy >= IDLE_SHARE or micro_batch < 1 or accumulation < 1:
        return None
    per_rank = micro_batch * accumulation
    per_sample = max(usage.peak_bytes - usage.resident_bytes, 0) / micro_batch
    room = usage.total_bytes * (1.0 - margin) - usage.resident_bytes
    fits = math.floor(room / per_sample) if per_sample else per_rank  # nothing measured grows: keep the batch
    keeping = [d for d in range(micro_batch + 1, min(fits, per_rank) + 1) if per_rank % d == 0]
    chosen = max(keeping) if keeping else fits
    if chosen <= micro_batch:
        return None
    accumulation = per_rank // chosen if keeping else 1
    gain = min(chosen / micro_batch, 1.0 / max(usage.busy, 1e-9))
    expected = int(usage.resident_bytes + chosen * per_sample)
    return MicroBatchAdvice(chosen, accumulation, bool(keeping), expected, gain)


def accelerate_fix(advice: MicroBatchAdvice) -> str:
    """How an Accelerate loop sets the micro-batch: its DataLoader's and the accelerator's accumulation."""
    return (
        f"Set your DataLoader's batch_size={advice.micro_batch} and accumulate {advice.accumulation} micro-batch(es) "
        f"per optimizer step (BucketedAccelerator(gradient_accumulation_steps={advice.accumulation}))."
    )


def trainer_fix(advice: MicroBatchAdvice) -> str:
    """How a Trainer script sets it; ddp_ft's recipe chooses it itself."""
    return (
        f"Set TrainingArguments(per_device_train_batch_size={advice.micro_batch}, "
        f"gradient_accumulation_steps={advice.accumulation}) (ddp_ft's recipe: --micro-batch auto)."
    )


def loop_fix(advice: MicroBatchAdvice) -> str:
    """How ddp_ft's own loop sets it."""
    return (
        "Pass --micro-batch auto (the largest micro-batch that fits, the effective batch kept), or "
        f"--micro-batch {advice.micro_batch}."
    )


class IdleDeviceCheck:
    """Measures one optimizer step of a model's training and warns once if the device idled with memory to spare.

    torch's global optimizer step post-hook marks the steps of any optimizer holding the model's trainable
    parameters, in any loop (plain torch, Accelerate, the HF Trainer, whose optimizers step the torch one inside).
    After step ``MEASURED_STEP - 1`` the next training forward (a forward pre-hook, grad enabled) starts the
    profiler, and the end of that step stops it: the profiler never runs outside a training step, so a run that ends
    or evaluates there leaves none running. The same hook counts the step's training forwards (its micro-batches) and
    their rows (the micro-batch); a forward under ``no_grad`` inside the step (an evaluation) drops the measurement,
    and the next step is measured, :data:`MEASURE_TRIES` at most. Then the hooks go. Nothing runs on the backward.

    Args:
        model (nn.Module): the model being trained (the hooks go on it; it is not held).
        profiler (StepProfiler): measures the step.
        fix (Callable[[MicroBatchAdvice], str]): how this entry point sets the micro-batch, for the warning.
    """

    def __init__(self, model: torch.nn.Module, profiler: StepProfiler, fix: Callable[[MicroBatchAdvice], str]) -> None:
        self._profiler, self._fix = profiler, fix
        self._watches = OptimizerMatch(p for p in model.parameters() if p.requires_grad)
        self._steps = self._tries = 0
        self._armed = self._measuring = self._done = False  # done: the hooks go at the next forward (on_forward)
        self._forwards = self._rows = 0
        self.message: str | None = None  # the warning, once given
        owner = weakref.ref(self)
        handles = (
            register_optimizer_step_post_hook(lambda optimizer, args, kwargs: _after_step(owner, optimizer)),
            model.register_forward_pre_hook(
                lambda module, args, kwargs: _on_forward(owner, args, kwargs), with_kwargs=True
            ),
        )
        self._release = weakref.finalize(self, _remove, handles)

    def remove(self) -> None:
        self._release()

    def on_forward(self, args: tuple, kwargs: dict) -> None:
        """A forward starts: start the armed measurement, count the step's micro-batches, or drop it (evaluation)."""
        if self._done:  # the hooks go here: torch iterates over the optimizer's hooks live, the forward's over a copy
            self.remove()
            return
        try:  # advisory: whatever goes wrong in it must not stop a training run
            if not torch.is_grad_enabled():
                if self._measuring:  # an evaluation inside the step: not a training step's time
                    self._measuring = False
                    self._profiler.stop()
                return
            if self._armed:
                self._armed, self._measuring = False, True
                self._forwards = self._rows = 0
                self._tries += 1
                self._profiler.start()
            if self._measuring:
                batch = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim()), None)
                self._forwards += 1
                self._rows = max(self._rows, batch.shape[0] if batch is not None else 0)
        except Exception:
            self._give_up()

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer step ended: conclude a measurement, or arm the next one (class docstring)."""
        if self._done or not self._watches(optimizer):
            return
        self._steps += 1
        try:
            if self._measuring:
                self._measuring = False
                usage = self._profiler.stop()
                if usage is not None and self._forwards:
                    self._done = True
                    self._conclude(usage)
                    return
            if self._tries >= MEASURE_TRIES:
                self._done = True
            elif self._steps >= MEASURED_STEP - 1:
                self._armed = True
        except Exception:
            self._give_up()

    def _give_up(self) -> None:
        logger.debug("ddp_ft: the idle-device check stopped", exc_info=True)
        self._armed = self._measuring = False
        self._done = True

    def _conclude(self, usage: StepUsage) -> None:
        advice = larger_micro_batch(usage, self._rows, self._forwards)
        if advice is None:
            return
        batch = (
            ""
            if advice.keeps_effective_batch
            else (
                f", which grows the samples per rank per optimizer step from {self._rows * self._forwards} to "
                f"{advice.micro_batch} (retune the learning rate)"
            )
        )
        self.message = (
            f"ddp_ft: the device was busy {usage.busy:.0%} of optimizer step {self._steps} ({self._forwards} "
            f"micro-batch(es) of {self._rows}; peak {usage.peak_bytes / 1e9:.2f} GB of {usage.total_bytes / 1e9:.2f} GB): "
            "the host (Python, autograd, kernel launches) sets the pace, not the device. Micro-batch "
            f"{advice.micro_batch} x {advice.accumulation} would fit (expected peak {advice.expected_peak / 1e9:.2f} "
            f"GB){batch}: up to {advice.gain:.1f}x the tokens/s. {self._fix(advice)}"
        )
        logger.warning(self.message)


# The check of each model, kept while the model lives (the check holds neither the model nor itself).
_CHECKS: weakref.WeakKeyDictionary[torch.nn.Module, IdleDeviceCheck] = weakref.WeakKeyDictionary()


def watch_idle_device(
    model: torch.nn.Module, device: torch.device, is_main_process: bool, fix: Callable[[MicroBatchAdvice], str]
) -> IdleDeviceCheck | None:
    """Install the idle-device check on a model about to train, once per model, on the main process only.

    Args:
        model (nn.Module): the model being trained.
        device (torch.device): its device; only CUDA is measured (:func:`step_profiler`).
        is_main_process (bool): rank 0, which measures and warns (the ranks run the same steps).
        fix (Callable[[MicroBatchAdvice], str]): how this entry point sets the micro-batch.

    Returns:
        IdleDeviceCheck | None: the check, or None where nothing is measured.
    """
    if not is_main_process:
        return None
    if model in _CHECKS:
        return _CHECKS[model]
    profiler = step_profiler(device)
    if profiler is None:
        return None
    _CHECKS[model] = check = IdleDeviceCheck(model, profiler, fix)
    return check


def _after_step(owner: weakref.ref, optimizer: torch.optim.Optimizer) -> None:
    check = owner()
    if check is not None:
        check.after_step(optimizer)


def _on_forward(owner: weakref.ref, args: tuple, kwargs: dict) -> None:
    check = owner()
    if check is not None:
        check.on_forward(args, kwargs)


def _remove(handles: tuple) -> None:
    for handle in handles:
        handle.remove()
