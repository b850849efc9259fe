"""The steps of ``make gpu-report``, most valuable first, for this host: what each runs, and what it can skip.

On CUDA (each step's expected seconds from the H100 runs in ``docs/performance.md``):

1. ``random_model``: a random-weight Qwen3-4B with Qwen's tokenizer (``scripts/random_model.py``; no download).
2. ``loop_defaults``, ``recipe_defaults``: what a user runs (``ddp_ft.tools.gpu_report.e2e``): ``scripts/train.py`` and
   ``accelerate launch recipes/qwen_ami.py`` on the AMI meetings at their defaults (micro-batch auto, regional
   compilation, packing): non-padding tokens/s, peak against the probe's expected peak, compile time and graphs.
   ``packed_2048``: the loop at sequence 2,048, packed, Unsloth's published shape (each AMI sample fills a row);
   ``packed_2048_short``: the same rows holding five short texts each (``pieces``), for packing's cost, at the
   defaults (flex attention) and through sdpa (``packed_2048_short_sdpa``).
3. The decomposition at micro-batch auto: ``bench_gpu`` {eager, compiled} x {checkpointing on, off}, one mode, no
   dropout; each compiled cell's losses against its eager twin's (the compute dtype's tolerance), the expected
   against the measured peak (the 10% gate).
4. ``loop_old_defaults``: the loop at the seed's settings (micro-batch 1, eager, padded); ``stock_reference``: the
   stock Trainer at the reference write-up's (micro-batch 1, eager); ``loop_half_micro_batch``: micro-batch 8, the
   micro-step of two GPUs at effective batch 16, for ``ddp-ft forecast``.
5. The decomposition at micro-batch 1.
6. ``shared_gpu_gloo``: ``scripts/gpu_check.py`` on 2 processes sharing one GPU over gloo with CUDA tensors
   (``--backend gloo``, one GPU visible): BucketedDDP against torch DDP and ``no_sync`` with real asynchronous
   communication, which one process cannot give; NCCL refuses two ranks on one GPU.
7. ``forecast_check``: ``ddp-ft forecast`` from a 1-process run against 2 processes sharing the GPU over gloo
   (``python -m ddp_ft.tools.forecast_check --device cuda``: ``ddp-ft train`` and ``ddp-ft doctor`` with
   ``--backend gloo``, one GPU visible); the CPU runs it as its own command (``make forecast-check``).
8. ``gpu_check``: ``scripts/gpu_check.py`` as ``make gpu-check`` runs it.
9. ``ladder``: ``scripts/ladder.py`` on 2 GPUs (NCCL). With one GPU it is skipped: its CUDA split reads NCCL's kernels
   from the profiler's trace, and over gloo the communication leaves none to read.
10. ``scaling_2gpu``: ``torchrun --nproc_per_node=2 scripts/bench_gpu.py`` on 2+ GPUs, else skipped.

The default budget (600 s) fits 1-4 on one H100; the rest runs with a larger ``--budget-s``. The reference shape's two
modes (BucketedDDP against no wrapper at micro-batch 1) and Liger at micro-batch 1 are not steps: an H100 run settled
them (``docs/performance.md``). On the CPU (``--device cpu``, the smoke test) the loop's
defaults on the tiny preset, one decomposition cell (eager, checkpointing off) at tiny shapes, ``gpu_check`` and the
ladder run; what needs CUDA is skipped with the reason.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ...training.model.kernels import check_kernel_settings
from ..forecast_check import RESULT_JSON
from ..forecast_check.stages import one_visible_gpu
from . import summaries
from .e2e import e2e_steps
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
    """Why this host refuses ``--liger`` / ``--compile`` (``ddp_ft.training.model.kernels``' own error), or None."""
    try:
        check_kernel_settings(liger, compile, torch.device(device))
    except ValueError as error:
        return f"refused on this host: {error}"
    return None


def plan_steps(
    device: str, gpu_count: int, results: Path, scripts: Path, python: str = sys.executable, data: Path | None = None
) -> list[Step]:
    """The report's steps for ``device`` (``cuda`` or ``cpu``) with ``gpu_count`` GPUs visible, in order.

    Args:
        device (str): ``cuda``: the real shapes; ``cpu``: tiny shapes, few steps, CUDA-only steps skipped.
        gpu_count (int): GPUs visible (the ladder and the scaling need 2).
        results (Path): the folder each step writes its JSON into (``<step name>.json``).
        scripts (Path): this checkout's ``scripts/``.
        python (str): the interpreter the steps run. Default: this one.
        data (Path | None): the folder with ``qwen2-tokenizer/`` and ``ami/ami_abstractive.jsonl`` for the
            end-to-end steps. Default: none, and those steps are skipped (``make gpu-report`` passes one).
    """
    e2e = e2e_steps(device, results, scripts, python, data)
    cells = _decomposition(device, results, scripts, python)
    first, then = e2e[: 7 if device == "cuda" else 1], e2e[7 if device == "cuda" else 1 :]
    auto = [c for c in cells if c.name.endswith("_auto")]
    one = [c for c in cells if not c.name.endswith("_auto")]
    return first + auto + then + one + _check_steps(device, gpu_count, results, scripts, python)


DECOMPOSITION = [(compiled, ckpt, mb) for mb in ("auto", "mb1") for ckpt in (True, False) for compiled in (False, True)]
# the smoke test's: the cell with the new flag (compilation under BucketedDDP: tests/training/test_compile_overlap.py)
CPU_CELLS = {"decomp_eager_nockpt_auto"}


def cell_name(compiled: bool, ckpt: bool, mb: str) -> str:
    return f"decomp_{'compiled' if compiled else 'eager'}_{'ckpt' if ckpt else 'nockpt'}_{mb}"


def _decomposition(device: str, results: Path, scripts: Path, python: str) -> list[Step]:
    """{eager, compiled} x {checkpointing on, off} x {micro-batch auto, 1}: ``bench_gpu``, one mode, no dropout (the
    compiled cell's losses against its eager twin's), tokens/s and peak (expected against measured at auto)."""
    cuda = device == "cuda"
    steps = []
    for compiled, ckpt, mb in DECOMPOSITION:
        name = cell_name(compiled, ckpt, mb)
        out = results / f"{name}.json"
        args = [*VARIANT_ARGS, *(CUDA_VARIANT_STEPS if cuda else CPU_STEPS), *([] if cuda else CPU_TINY)]
        args += ["--compile"] * compiled + ["--no-gradient-checkpointing"] * (not ckpt)
        if mb == "auto":
            args += ["--micro-batch", "auto", *([] if cuda else ["--effective-batch", "4", "--device-memory-gb", "1"])]
        skip = kernel_refusal(False, compiled, device)
        if not cuda and name not in CPU_CELLS:
            skip = "CUDA only: the CPU smoke test runs " + " and ".join(sorted(CPU_CELLS))
        twin = cell_name(False, ckpt, mb) if compiled else None
        steps.append(
            Step(
                name,
                f"bench_gpu {'compiled' if compiled else 'eager'}, checkpointing {'on' if ckpt else 'off'}, "
                f"micro-batch {mb.removeprefix('mb')}",
                [python, str(scripts / "bench_gpu.py"), *args, "--out", str(out)],
                out,
                35 if cuda else 40,
                180 if cuda else 240,
                skip=skip,
                summarize=summaries.decomposition_cell(twin),
            )
        )
    return steps


def _check_steps(device: str, gpu_count: int, results: Path, scripts: Path, python: str) -> list[Step]:
    """Two processes on one GPU over gloo, the forecast check, ``gpu_check``, the ladder, the 2-GPU scaling."""
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
        _forecast_check(cuda, results, python),
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


def _forecast_check(cuda: bool, results: Path, python: str) -> Step:
    """``ddp-ft forecast`` against 2 processes sharing one GPU over gloo; on the CPU, skipped for its own command."""
    out = results / "forecast_check"
    skip = None if cuda else "the CPU runs it as its own command (make forecast-check)"
    return Step(
        "forecast_check",
        "ddp-ft forecast against 2 processes sharing one GPU over gloo",
        [python, "-m", "ddp_ft.tools.forecast_check", "--device", "cuda", "--out", str(out)],
        out / RESULT_JSON,
        150,
        600,
        skip=skip,
        env={"CUDA_VISIBLE_DEVICES": one_visible_gpu()} if cuda else {},
        summarize=summaries.forecast_check,
    )
