"""The steps of ``make gpu-report``, most valuable first, for this host: what each runs, and what it can skip.

On CUDA (the full shapes, each step's expected seconds from the H100 runs of 2026-11-24 or estimated beside them):

1. ``bench_gpu_reference``: ``scripts/bench_gpu.py`` as ``make bench-gpu`` runs it (Qwen3-4B shape, sequence 512,
   micro-batch 1: BucketedDDP against no wrapper).
2. ``bench_gpu_auto``: the same with ``--micro-batch auto`` (effective batch 16), one mode, so that the expected peak
   of ``ddp_ft.memory`` stands beside the measured ``max_memory_allocated`` of one model.
3. ``variant_baseline``, ``variant_liger``, ``variant_compile``: one mode, no LoRA dropout, the same steps, without
   and with ``--liger`` / ``--compile``; each variant against the baseline: loss at every step within the compute
   dtype's tolerance (``ddp_ft.gpu_check.GRAD_TOL``), tokens/s and peak memory. A variant this host refuses
   (``ddp_ft.kernels.check_kernel_settings``: no Triton, no liger-kernel) is skipped with the refusal.
4. ``shared_gpu_gloo``: ``scripts/gpu_check.py`` on 2 processes sharing one GPU over gloo with CUDA tensors
   (``--backend gloo``, one GPU visible): BucketedDDP against torch DDP and ``no_sync`` with real asynchronous
   communication, which one process cannot give; NCCL refuses two ranks on one GPU.
5. ``gpu_check``: ``scripts/gpu_check.py`` as ``make gpu-check`` runs it.
6. ``ladder``: ``scripts/ladder.py`` on 2 GPUs (NCCL). With one GPU it is skipped: its CUDA split reads NCCL's kernels
   from the profiler's trace, and over gloo the communication leaves none to read.
7. ``scaling_2gpu``: ``torchrun --nproc_per_node=2 scripts/bench_gpu.py`` on 2+ GPUs, else skipped.

On the CPU (``--device cpu``, the smoke test) the same steps run with tiny shapes and few steps; what needs CUDA is
skipped with the reason (Liger's refusal, the shared GPU, the 2-GPU scaling).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from ..kernels import check_kernel_settings
from . import summaries
from .runner import Step

# Liger and --compile against the same run without them: one mode, no dropout masks, the same steps.
VARIANT_ARGS = ["--modes", "bucketed_ddp", "--lora-dropout", "0"]
CUDA_VARIANT_STEPS = ["--warmup", "2", "--steps", "3", "--repeats", "3"]
CPU_TINY = ["--shape", "tiny", "--device", "cpu", "--seq-len", "32"]
CPU_STEPS = ["--warmup", "1", "--steps", "1", "--repeats", "2"]
GPU_CHECK_CPU = ["--device", "cpu", "--world-sizes", "2", "--seq-len", "16", "--micro-batch", "1"]
GPU_CHECK_CPU += ["--grad-accum", "2", "--warmup-steps", "0", "--steps", "1"]
LADDER_CPU = ["--device", "cpu", "--workloads", "qlora", "--rungs", "torch_ddp", "bucketed_ddp", "--repeats", "1"]
LADDER_CPU += ["--steps", "1", "--warmup", "2", "--seq-len", "32", "--micro-batch", "1", "--vocab-size", "512"]


def kernel_refusal(liger: bool, compile: bool, device: str) -> str | None:
    """Why this host refuses ``--liger`` / ``--compile`` (``ddp_ft.kernels``' own error), or None."""
    try:
        check_kernel_settings(liger, compile, torch.device(device))
    except ValueError as error:
        return f"refused on this host: {error}"
    return None


def one_visible_gpu() -> str:
    """``CUDA_VISIBLE_DEVICES`` naming one GPU: the first of those visible now (``0`` when unset)."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",") if d.strip()]
    return visible[0] if visible else "0"


def plan_steps(device: str, gpu_count: int, results: Path, scripts: Path, python: str = sys.executable) -> list[Step]:
    """The report's steps for ``device`` (``cuda`` or ``cpu``) with ``gpu_count`` GPUs visible, in order.

    Args:
        device (str): ``cuda``: the real shapes; ``cpu``: tiny shapes, few steps, CUDA-only steps skipped.
        gpu_count (int): GPUs visible (the ladder and the scaling need 2).
        results (Path): the folder each step writes its JSON into (``<step name>.json``).
        scripts (Path): this checkout's ``scripts/``.
        python (str): the interpreter the steps run. Default: this one.
    """
    return _bench_steps(device, results, scripts, python) + _check_steps(device, gpu_count, results, scripts, python)


def _bench_steps(device: str, results: Path, scripts: Path, python: str) -> list[Step]:
    """``bench_gpu`` at the reference shape and at ``--micro-batch auto``, then the variants against their baseline."""
    cuda = device == "cuda"
    tiny = [] if cuda else CPU_TINY
    steps = CUDA_VARIANT_STEPS if cuda else CPU_STEPS
    auto = ["--micro-batch", "auto", "--modes", "bucketed_ddp"]
    auto += ["--warmup", "2", "--steps", "3", "--repeats", "2"] if cuda else ["--effective-batch", "4"]
    auto += [] if cuda else ["--device-memory-gb", "1", "--warmup", "1", "--steps", "1", "--repeats", "1"]

    def bench(name: str, title: str, args: list[str], expected_s: float, cpu_expected_s: float = 20, **kw) -> Step:
        out = results / f"{name}.json"
        command = [python, str(scripts / "bench_gpu.py"), *tiny, *args, "--out", str(out)]
        if not cuda:
            expected_s = cpu_expected_s
        return Step(name, title, command, out, expected_s, 4 * expected_s if cuda else 120 + expected_s, **kw)

    return [
        bench(
            "bench_gpu_reference",
            "bench_gpu at the reference shape (make bench-gpu)",
            [] if cuda else CPU_STEPS,
            150,
            summarize=summaries.bench_gpu,
        ),
        bench(
            "bench_gpu_auto",
            "bench_gpu --micro-batch auto: expected against measured peak",
            auto,
            90,
            summarize=summaries.micro_batch_auto,
        ),
        bench(
            "variant_baseline",
            "bench_gpu, one mode, no dropout: the variants' baseline",
            [*VARIANT_ARGS, *steps],
            60,
            summarize=summaries.bench_gpu,
        ),
        bench(
            "variant_liger",
            "bench_gpu --liger against the baseline",
            [*VARIANT_ARGS, *steps, "--liger"],
            60,
            skip=kernel_refusal(True, False, device),
            summarize=summaries.variant,
        ),
        bench(
            "variant_compile",
            "bench_gpu --compile against the baseline",
            [*VARIANT_ARGS, *steps, "--compile"],
            90,
            45,
            skip=kernel_refusal(False, True, device),
            summarize=summaries.variant,
        ),
    ]


def _check_steps(device: str, gpu_count: int, results: Path, scripts: Path, python: str) -> list[Step]:
    """Two processes on one GPU over gloo, ``gpu_check``, the ladder, the 2-GPU scaling."""
    cuda = device == "cuda"
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    short = f"{gpu_count} GPU(s) visible: needs 2 or more"
    shared_out, check_out, ladder_out, scaling_out = (
        results / f"{name}.json" for name in ("shared_gpu_gloo", "gpu_check", "ladder", "scaling_2gpu")
    )
    shared = [python, str(scripts / "gpu_check.py"), "--device", "cuda", "--backend", "gloo", "--world-sizes", "2"]
    check = [python, str(scripts / "gpu_check.py"), *([] if cuda else GPU_CHECK_CPU)]
    ladder = [*torchrun, str(scripts / "ladder.py"), *(["--device", "cuda", "--repeats", "3"] if cuda else LADDER_CPU)]
    scaling = [*torchrun, str(scripts / "bench_gpu.py")]
    two = gpu_count >= 2
    shared_skip = (
        None if cuda else "needs CUDA (on the CPU the gpu_check step runs the same checks on 2 gloo processes)"
    )
    ladder_skip = (
        None
        if not cuda or two
        else (
            f"{short}: NCCL takes one process per GPU, and over gloo the ladder's CUDA split (NCCL kernels in the "
            "profiler's trace) would find no communication to read"
        )
    )
    scaling_skip = (
        (None if two else short) if cuda else "needs 2 GPUs (the CPU's 2-process scaling: make demo, make bench-e2e)"
    )
    return [
        Step(
            "shared_gpu_gloo",
            "2 processes sharing one GPU over gloo: BucketedDDP against torch DDP, no_sync silent",
            [*shared, "--out", str(shared_out)],
            shared_out,
            45,
            180,
            skip=shared_skip,
            env={"CUDA_VISIBLE_DEVICES": one_visible_gpu()} if cuda else {},
            summarize=summaries.gpu_check,
        ),
        Step(
            "gpu_check",
            "gpu_check (make gpu-check)",
            [*check, "--out", str(check_out)],
            check_out,
            45 if cuda else 40,
            300 if cuda else 180,
            summarize=summaries.gpu_check,
        ),
        Step(
            "ladder",
            "the DDP ladder (make ladder)",
            [*ladder, "--out", str(ladder_out)],
            ladder_out,
            120 if cuda else 40,
            300 if cuda else 180,
            skip=ladder_skip,
            summarize=summaries.ladder,
        ),
        Step(
            "scaling_2gpu",
            "bench_gpu on 2 GPUs: the scaling",
            [*scaling, "--out", str(scaling_out)],
            scaling_out,
            200,
            420,
            skip=scaling_skip,
            summarize=summaries.bench_gpu,
        ),
    ]
