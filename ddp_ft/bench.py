"""What the benchmarks and the GPU check share: one choice of device, backend and compute dtype, and timing that
waits for the device.

A benchmark that joins NCCL must hold its model and batches on its rank's GPU, and one that runs on the CPU must join
gloo and leave CUDA alone: :func:`compute_setup` makes the three choices together, from ``--device`` and
``--compute-dtype``. On CUDA the host runs ahead of the device, so a timed region starts and ends with
:func:`synchronize`, and intervals inside a step are CUDA events read after the region (:class:`ExposedWaitProbe`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .distributed import DistInfo, destroy_distributed, device_and_backend, init_distributed
from .precision import Precision, precision_for


@dataclass(frozen=True)
class ComputeSetup:
    """Where a benchmark runs and in which dtype.

    Args:
        info (DistInfo): this process's rank facts; ``info.device`` is its GPU or the CPU.
        backend (str): ``nccl`` with CUDA, ``gloo`` on the CPU (also for a single process, which has no group).
        precision (Precision): the compute dtype for ``info.device`` and why it was chosen.
    """

    info: DistInfo
    backend: str
    precision: Precision

    @property
    def device_map(self) -> dict[str, int | str]:
        """``from_pretrained``'s device map: the whole model on this rank's device."""
        device = self.info.device
        return {"": device.index if device.type == "cuda" else "cpu"}

    def describe(self) -> str:
        """``device cuda:0 (NVIDIA H100, compute capability 9.0), backend nccl, compute dtype bfloat16 (why)``."""
        device = self.info.device
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            where = f"{device} ({torch.cuda.get_device_name(device)}, compute capability {major}.{minor})"
        else:
            where = "cpu"
        return f"device {where}, backend {self.backend}, compute dtype {self.precision.name} ({self.precision.reason})"


def compute_setup(device: str = "auto", compute_dtype: str = "auto", timeout_s: float = 600.0) -> ComputeSetup:
    """Join the launcher's process group on the device ``device`` asks for, and choose the compute dtype for it.

    Args:
        device (str): ``auto`` (CUDA when available), ``cuda`` (this rank's GPU, NCCL) or ``cpu`` (gloo, CUDA
            ignored). Default: auto.
        compute_dtype (str): ``auto``, ``bfloat16``, ``float16`` or ``float32`` (``ddp_ft.precision``). Default: auto.
        timeout_s (float): collective timeout. Default: 600.

    Raises:
        ValueError: ``cuda`` without CUDA, or bfloat16 on a GPU older than compute capability 8.0, naming the fix.
    """
    device_type, backend = device_and_backend(device, torch.cuda.is_available())
    info = init_distributed(backend=backend, timeout_s=timeout_s, device_type=device_type)
    try:
        return ComputeSetup(info, backend, precision_for(compute_dtype, info.device))
    except ValueError:
        destroy_distributed()
        raise


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a timed region ends when the GPU finished, not when the host did."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ExposedWaitProbe:
    """Time from the last trainable gradient of a backward to the end of ``backward()``.

    In a synced backward that is the communication (and the wait for the slower rank) that the backward could not
    hide. It is measured from outside, by the same hooks, for torch DDP and BucketedDDP alike, so the part of a step
    where communication shows is compared directly, without the compute that dominates the tokens/s noise.

    On the CPU it is wall time. On CUDA the host does not wait for the collectives (both DDPs only make the
    backward's stream wait for the communication stream), so the interval is taken on the device: an event recorded
    in every gradient hook on the stream backward runs on (the last record wins) and one after ``backward()``,
    read by :attr:`seconds` only after the timed region.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self.last_grad: float | torch.cuda.Event = 0.0
        self.samples: list[float | tuple[torch.cuda.Event, torch.cuda.Event]] = []
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._stamp)

    def _stamp(self, param: torch.Tensor) -> None:
        if self.cuda:
            self.last_grad.record()
        else:
            self.last_grad = time.perf_counter()

    def backward(self, loss: torch.Tensor, record: bool) -> None:
        if self.cuda:
            self.last_grad = torch.cuda.Event(enable_timing=True)
        loss.backward()
        if not record:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.samples.append((self.last_grad, end))
        else:
            self.samples.append(time.perf_counter() - self.last_grad)

    @property
    def seconds(self) -> list[float]:
        """Every recorded interval in seconds (on CUDA this waits for the recorded events)."""
        return [s if isinstance(s, float) else _event_seconds(*s) for s in self.samples]


def _event_seconds(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    end.synchronize()
    return start.elapsed_time(end) / 1e3
