"""An idle device with memory to spare: one step measured, a larger micro-batch advised.

Rank 0 measures one optimizer step on CUDA: how busy the device was and its peak memory. Under half busy,
the host sets the pace; if a larger micro-batch fits, a warning names it and how to set it.
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

MEASURED_STEP = 4  # past warm-up and compilation
IDLE_SHARE = 0.5  # busy below this share: host-bound
MEASURE_TRIES = 3  # a step with an evaluation is retried


@dataclass(frozen=True)
class StepUsage:
    """One optimizer step on the device, as a :class:`StepProfiler` measured it.

    Args:
        busy (float): share of the step's wall time the device ran work, in [0, 1].
        resident_bytes (int): allocated when the step started.
        peak_bytes (int): ``max_memory_allocated``, never reset so the user's reading stays intact.
        total_bytes (int): the device's memory.
    """

    busy: float
    resident_bytes: int
    peak_bytes: int
    total_bytes: int


class StepProfiler(Protocol):
    """Measures the device over one optimizer step."""

    def start(self) -> None: ...

    def stop(self) -> StepUsage | None: ...


def busy_ns(intervals: list[tuple[int, int]]) -> int:
    """The length of the union of ``(start, end)`` intervals."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


class CudaStepProfiler:
    """A :class:`StepProfiler` for one CUDA device, from ``torch.profiler``'s CUDA activity.

    The step starts and ends synchronized, so no kernel is misplaced. Tracing makes a step read slightly less
    busy; the half threshold leaves room for that.

    Args:
        device (torch.device): this process's CUDA device.
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
    """The step profiler for ``device``: CUDA's, else None; a seam for tests."""
    return CudaStepProfiler(device) if device.type == "cuda" else None


@dataclass(frozen=True)
class MicroBatchAdvice:
    """A larger micro-batch that fits, from one measured step.

    Args:
        micro_batch (int): the micro-batch that fits.
        accumulation (int): micro-batches per optimizer step with it.
        keeps_effective_batch (bool): the effective batch stays the same.
        expected_peak (int): bytes expected at the peak.
        gain (float): the most tokens/s to expect, as a multiple.
    """

    micro_batch: int
    accumulation: int
    keeps_effective_batch: bool
    expected_peak: int
    gain: float


def larger_micro_batch(
    usage: StepUsage, micro_batch: int, accumulation: int, margin: float = AUTO_MARGIN
) -> MicroBatchAdvice | None:
    """The largest micro-batch worth advising after an idle step.

    Activations grow with the micro-batch; the rest stays. A divisor of the per-rank batch keeps the effective
    batch. A host-bound step takes about as long when larger, so the gain is at most ``1 / busy``.

    Args:
        usage (StepUsage): the measured step.
        micro_batch (int): its samples per forward.
        accumulation (int): its micro-batches.
        margin (float): share of device memory kept free. Default: ``AUTO_MARGIN``

    Returns:
        MicroBatchAdvice | None: None when the device was busy enough or nothing larger fits.
    """
    if usage.busy >= IDLE_SHARE or micro_batch < 1 or accumulation < 1:
        return None
    per_rank = micro_batch * accumulation
    per_sample = max(usage.peak_bytes - usage.resident_bytes, 0) / micro_batch
    room = usage.total_bytes * (1.0 - margin) - usage.resident_bytes
    fits = math.floor(room / per_sample) if per_sample else per_rank  # nothing grows: keep the batch
    keeping = [d for d in range(micro_batch + 1, min(fits, per_rank) + 1) if per_rank % d == 0]
    chosen = max(keeping) if keeping else fits
    if chosen <= micro_batch:
        return None
    accumulation = per_rank // chosen if keeping else 1
    gain = min(chosen / micro_batch, 1.0 / max(usage.busy, 1e-9))
    expected = int(usage.resident_bytes + chosen * per_sample)
    return MicroBatchAdvice(chosen, accumulation, bool(keeping), expected, gain)


def accelerate_fix(advice: MicroBatchAdvice) -> str:
    """How an Accelerate loop sets the micro-batch."""
    return (
        f"Set your DataLoader's batch_size={advice.micro_batch} and accumulate {advice.accumulation} micro-batch(es) "
        f"per optimizer step (BucketedAccelerator(gradient_accumulation_steps={advice.accumulation}))."
    )


def trainer_fix(advice: MicroBatchAdvice) -> str:
    """How a Trainer script sets it."""
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
    """Measures one training step of a model and warns once if the device idled.

    torch's global optimizer-step hook finds the steps of any loop. A forward pre-hook starts the profiler on a
    training forward, so it never runs outside a step. A ``no_grad`` forward inside the step drops the
    measurement, and the next step is tried, :data:`MEASURE_TRIES` at most.

    Args:
        model (nn.Module): the model being trained; not held.
        profiler (StepProfiler): measures the step.
        fix (Callable[[MicroBatchAdvice], str]): how this entry point sets the micro-batch.
    """

    def __init__(self, model: torch.nn.Module, profiler: StepProfiler, fix: Callable[[MicroBatchAdvice], str]) -> None:
        self._profiler, self._fix = profiler, fix
        self._watches = OptimizerMatch(p for p in model.parameters() if p.requires_grad)
        self._steps = self._tries = 0
        self._armed = self._measuring = self._done = False
        self._forwards = self._rows = 0
        self.message: str | None = None
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
        """Start the armed measurement, count micro-batches, or drop an evaluation."""
        if self._done:  # torch copies the forward hooks, not the optimizer's
            self.remove()
            return
        try:  # advisory: must never stop training
            if not torch.is_grad_enabled():
                if self._measuring:
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
        """Conclude a measurement, or arm the next one."""
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


# Each model's check, while the model lives.
_CHECKS: weakref.WeakKeyDictionary[torch.nn.Module, IdleDeviceCheck] = weakref.WeakKeyDictionary()
# Models whose micro-batch the probe measured: nothing to advise.
_SIZED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def sized_by_probe(model: torch.nn.Module) -> None:
    """Exempt ``model`` from the check: ``--micro-batch auto``'s probe already chose the largest that fits.

    The check profiles one step, which slows that step.
    """
    _SIZED.add(model)


def watch_idle_device(
    model: torch.nn.Module, device: torch.device, is_main_process: bool, fix: Callable[[MicroBatchAdvice], str]
) -> IdleDeviceCheck | None:
    """Install the idle-device check on a model, once, on the main process only.

    Args:
        model (nn.Module): the model being trained.
        device (torch.device): its device; only CUDA is measured.
        is_main_process (bool): rank 0, which measures and warns.
        fix (Callable[[MicroBatchAdvice], str]): how this entry point sets the micro-batch.

    Returns:
        IdleDeviceCheck | None: the check, or None where nothing is measured (off CUDA, off rank 0, or
        :func:`sized_by_probe`).
    """
    if not is_main_process or model in _SIZED:
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
