"""Performance traps in a user's own script (``ddp_ft.perf_traps``): warned once, on rank 0, with the fix.

4-bit layers left at BitsAndBytesConfig's float32 compute dtype in a bf16 run, and a device idle for most of a step
while a larger micro-batch would fit. The device is measured on CUDA only: here a fake profiler stands in for it (the
module's ``step_profiler``), and without one nothing is measured on the CPU.
"""

import pytest
import torch
from torch import nn

import ddp_ft.perf_traps.idle as idle
from ddp_ft.perf_traps import (
    StepUsage,
    accelerate_fix,
    busy_ns,
    check_4bit_compute_dtype,
    larger_micro_batch,
    watch_idle_device,
)

from .test_user_traps import _Records

GB = 10**9
_REAL_PROFILER = idle.step_profiler
DTYPE_FIX = "bnb_4bit_compute_dtype=torch.bfloat16"


class _FakeProfiler:
    """A device busy ``busy`` of the step, 2 GB resident, 3 GB peak, 80 GB in all."""

    def __init__(self, busy: float):
        self.busy, self.starts, self.running = busy, 0, False

    def start(self):
        self.starts, self.running = self.starts + 1, True

    def stop(self):
        self.running = False
        return StepUsage(self.busy, 2 * GB, 3 * GB, 80 * GB)


def _fake_device(busy: float | None) -> None:
    """This process's steps measured by a fake profiler (None: the real choice, which measures nothing on a CPU)."""
    idle.step_profiler = (lambda device: _FakeProfiler(busy)) if busy is not None else _REAL_PROFILER


def _ours(messages: list[str]) -> dict[str, list[str]]:
    return {
        "dtype": [m for m in messages if "bnb_4bit_compute_dtype" in m],
        "idle": [m for m in messages if "the device was busy" in m],
    }


# ---------------------------------------------------------------- the rules, in process


def test_the_busy_time_of_a_step_is_the_union_of_its_kernels_intervals():
    assert busy_ns([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25
    assert busy_ns([]) == 0


def test_a_larger_micro_batch_is_advised_only_for_an_idle_device_with_memory_for_it_keeping_the_effective_batch():
    idle = StepUsage(0.2, 2 * GB, 3 * GB, 80 * GB)  # 0.5 GB per sample at micro-batch 2
    advice = larger_micro_batch(idle, micro_batch=2, accumulation=8)
    assert (advice.micro_batch, advice.accumulation, advice.keeps_effective_batch) == (16, 1, True)
    assert advice.expected_peak == 10 * GB and advice.gain == pytest.approx(5.0)  # min(16 / 2, 1 / 0.2)
    assert larger_micro_batch(StepUsage(0.6, 2 * GB, 3 * GB, 80 * GB), 2, 8) is None  # busy enough
    tight = StepUsage(0.2, 2 * GB, 3 * GB, 4 * GB)  # 3.4 GB budget: micro-batch 2 (3 GB) is all that fits
    assert larger_micro_batch(tight, 2, 8) is None
    grows = larger_micro_batch(idle, micro_batch=2, accumulation=1)  # no accumulation left to trade
    assert not grows.keeps_effective_batch and grows.accumulation == 1 and grows.micro_batch > 2


def _linear4bit(compute_dtype):
    import bitsandbytes as bnb

    return bnb.nn.Linear4bit(16, 16, compute_dtype=compute_dtype)


class _FourBitLM(nn.Module):
    """Embeddings in ``stream`` dtype, one 4-bit layer, one trainable layer."""

    def __init__(self, compute_dtype, stream=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(8, 16).to(stream).requires_grad_(False)
        self.proj = _linear4bit(compute_dtype)
        self.adapter = nn.Linear(16, 16)

    def get_input_embeddings(self):
        return self.embed


def test_the_4bit_compute_dtype_rule_warns_for_float32_compute_in_a_half_run_or_on_a_bf16_gpu_only():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    f32, bf16 = torch.float32, torch.bfloat16

    def check(model, mixed, device=cpu, capability=None):
        return check_4bit_compute_dtype(model, mixed, device, False, capability)

    assert DTYPE_FIX in check(_FourBitLM(f32), "bf16")
    assert check(_FourBitLM(bf16), "bf16") is None
    assert check(_FourBitLM(f32), "no") is None  # float32 throughout on a CPU: the user's plain choice
    assert "bf16=True" in check(_FourBitLM(f32), "no", gpu, (8, 0))  # a GPU with bf16 tensor cores
    assert check(_FourBitLM(f32), "no", gpu, (7, 5)) is None  # a T4: no native bf16
    assert DTYPE_FIX in check(_FourBitLM(None), "bf16")  # None: takes the float32 stream's dtype
    assert check(_FourBitLM(None, stream=bf16), "no") is None  # None in a bf16 model: computes in bf16
    assert DTYPE_FIX in check(_FourBitLM(f32, stream=bf16), "no")  # a bf16 model left at the default
    assert "torch.float16" in check(_FourBitLM(f32), "fp16")


def test_on_a_cpu_nothing_is_measured_without_a_fake_device():
    assert watch_idle_device(nn.Linear(2, 2), torch.device("cpu"), True, str) is None


def test_only_a_whole_training_step_is_measured_and_no_profiler_runs_between_steps(monkeypatch):
    """The measurement starts at the first training forward after step 3 (an evaluation between steps starts nothing),
    an evaluation inside the step drops it, the next step is measured; then the hooks go."""
    fake = _FakeProfiler(0.2)
    monkeypatch.setattr(idle, "step_profiler", lambda device: fake)
    records = _Records()
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch_idle_device(model, torch.device("cpu"), True, accelerate_fix)

    def step(evaluate_inside: bool = False):
        for micro in range(2):
            model(torch.ones(3, 4)).sum().backward()
            if evaluate_inside and micro == 0:
                with torch.no_grad():
                    model(torch.ones(5, 4))
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        step()
        with torch.no_grad():
            model(torch.ones(5, 4))  # an evaluation between steps
    assert fake.starts == 0
    step(evaluate_inside=True)
    assert fake.starts == 1 and not fake.running and records.messages == []
    step()
    assert fake.starts == 2 and not fake.running
    assert len(records.messages) == 1 and "optimizer step 5 (2 micro-batch(es) of 3" in records.messages[0]
    model(torch.ones(1, 4))
    assert not model._forward_pre_hooks
