"""Qwen3-4B QLoRA training speed on GPUs: tokens/s, step time, peak memory and model FLOPs utilisation.

    python scripts/bench_gpu.py                                     # 1 GPU: BucketedDDP vs no wrapper
    torchrun --standalone --nproc_per_node=2 scripts/bench_gpu.py   # 2 GPUs: scaling

No download: a Qwen3-4B-shaped model (``ddp_ft.training.model.memory.QWEN3_4B``) with random weights is built once into
``$DDP_FT_CACHE`` (local rank 0 builds, the others wait) and loaded through ``load_qlora_model``: NF4 with double
quantisation, LoRA r=16 on every linear layer, non-reentrant gradient checkpointing, the compute dtype for the device
(``ddp_ft.tools.bench.compute_setup``). Each optimizer step trains ``--accumulation`` random sequences of ``--seq-len``
tokens per rank (``--micro-batch`` sequences each) with the loop's ``forward_backward``, clipping and AdamW. Modes,
each with its own model, alternate within the run (order rotating every repeat) after ``--warmup`` steps each:

- 1 process: ``single`` (no wrapper) and ``bucketed_ddp`` (BucketedDDP on a process group of size 1): the wrapper's
  overhead, target under 1%.
- N processes: ``single`` (rank 0 alone, the others wait), ``independent`` (every rank unwrapped at once, no
  communication: the ceiling the devices allow) and ``bucketed_ddp``: the scaling.

Model FLOPs per token (``ddp_ft.tools.bench.MFU_FORMULA``): 4*N_base + 6*N_lora + 12*L*T*d_attn (forward 2*N_base +
2*N_lora + 4*L*T*d_attn; the backward computes activation gradients through the frozen weights, 2*N_base, and
activation and weight gradients of the adapters, 4*N_lora; attention twice its forward); recomputation under
checkpointing not counted. Peak: ``--peak-tflops``, else ``ddp_ft.tools.bench.PEAK_TFLOPS`` by device name, else
unknown.
``--shape tiny`` (with ``--device cpu``) is the smoke test.

``--micro-batch auto`` takes the micro-batch the run settings' ``--micro-batch auto`` would: the first guess of
``ddp_ft.training.resolve.resolve_micro_batch`` (``ddp_ft.training.model.memory``'s arithmetic for this shape,
``--seq-len`` and ``--effective-batch`` against the GPU's memory), then the probe (``ddp_ft.training.model.probe``) on
the first model built, before BucketedDDP wraps it; it records both expected peaks beside the measured
``max_memory_allocated``. ``--liger`` and ``--compile`` build every mode's model as the plain loop does with them
(``ddp_ft.training.model.kernels``); each mode's loss per step is recorded, so a run with them compares with one without
(``--lora-dropout 0``: no dropout masks, the same losses up to the kernels' rounding).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from ...ddp.autotune import AUTO
from ...distributed import destroy_distributed, keep_upstream_notices_to_rank_zero
from ...distributed.devices import DEVICE_CHOICES
from ...training.model.kernels import check_kernel_settings
from ...training.model.memory import Qwen3Shape
from ...training.model.precision import DTYPES
from ...training.model.qlora import LoraSettings
from ...training.setup import cache_dir
from ..bench import BENCH_SHAPES, build_random_qwen3, compute_setup, random_qwen3_name
from .models import build_models, choose_micro_batch
from .modes import Modes, measure, profile
from .result import report
from .steps import Batching, random_batches

OVERRIDES = {  # --flag -> Qwen3Shape field
    "layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
}


def at_least(low: int):
    """An argparse type: an integer >= ``low``, else the flag's error names the bound."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def micro_batch_arg(text: str) -> int | str:
    """``--micro-batch``: a whole number >= 1, or ``auto``."""
    return AUTO if text == AUTO else at_least(1)(text)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=BENCH_SHAPES, default="qwen3-4b", help="model sizes; tiny: the CPU smoke test")
    for flag, field in OVERRIDES.items():
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, help=f"override the shape's {field}")
    p.add_argument("--seq-len", type=at_least(1), default=512, help="tokens per sequence")
    p.add_argument(
        "--micro-batch",
        type=micro_batch_arg,
        default=1,
        help="sequences per forward/backward, or auto: the largest that fits the GPU with --effective-batch unchanged",
    )
    p.add_argument("--accumulation", type=at_least(1), default=1, help="micro-batches per optimizer step per rank")
    p.add_argument(
        "--effective-batch",
        type=at_least(1),
        help="with --micro-batch auto: sequences per optimizer step over all ranks (default 16, the qwen3-4b-ami "
        "preset's); the accumulation follows from it",
    )
    p.add_argument(
        "--device-memory-gb",
        type=float,
        help="with --micro-batch auto: the device memory to fill instead of the GPU's total (the only way on the CPU)",
    )
    p.add_argument("--lora-dropout", type=float, default=LoraSettings().lora_dropout, help="LoRA dropout")
    p.add_argument("--liger", action="store_true", help="Liger's Qwen3 kernels, as the plain loop's --liger")
    p.add_argument("--compile", action="store_true", help="regional torch.compile, as the plain loop's --compile")
    p.add_argument(
        "--no-gradient-checkpointing",
        dest="gradient_checkpointing",
        action="store_false",
        help="keep every activation instead of recomputing each layer's in backward (the loop's default is on)",
    )
    p.add_argument("--warmup", type=at_least(0), default=3, help="untimed optimizer steps per mode")
    p.add_argument("--steps", type=at_least(1), default=5, help="timed optimizer steps per mode per repeat")
    p.add_argument("--repeats", type=at_least(1), default=5, help="alternations of the modes")
    p.add_argument(
        "--profile-steps",
        type=at_least(0),
        default=0,
        help="after the timed repeats, this many steps per mode under torch.profiler: device kernel time vs wall",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=["single", "independent", "bucketed_ddp"],
        help="a subset of the modes (default: all for the world size; one mode alone: its own peak memory)",
    )
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto", help="cuda: NCCL; cpu: gloo")
    p.add_argument("--compute-dtype", choices=["auto", *DTYPES], default="auto", help="ddp_ft.training.model.precision")
    p.add_argument("--peak-tflops", type=float, help="the device's peak TFLOP/s in the compute dtype (MFU)")
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_gpu.json"), help="JSON result file")
    args = p.parse_args()
    if args.micro_batch != AUTO and (args.effective_batch is not None or args.device_memory_gb is not None):
        p.error("--effective-batch and --device-memory-gb go with --micro-batch auto")
    if args.micro_batch == AUTO and args.accumulation != 1:
        p.error("--micro-batch auto derives the accumulation from --effective-batch: drop --accumulation")
    return args


def main() -> None:
    """Measure every mode, print the table and write the JSON (rank 0)."""
    keep_upstream_notices_to_rank_zero()
    args = parse_args()
    shape = Qwen3Shape(
        **{
            **vars(BENCH_SHAPES[args.shape]),
            **{f: getattr(args, k) for k, f in OVERRIDES.items() if getattr(args, k) is not None},
        }
    )
    setup = compute_setup(args.device, args.compute_dtype)
    info, device = setup.info, setup.info.device
    choice = None
    try:
        check_kernel_settings(args.liger, args.compile, device)  # refused before anything loads
        if not info.is_distributed:  # BucketedDDP needs a process group: one of size 1
            extra = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(setup.backend, store=dist.HashStore(), rank=0, world_size=1, **extra)
        modes = args.modes or (
            ["single", "independent", "bucketed_ddp"] if info.is_distributed else ["single", "bucketed_ddp"]
        )
        folder = cache_dir() / random_qwen3_name(shape, torch.bfloat16)  # bf16, as the hub's checkpoint
        if info.local_rank == 0:
            build_random_qwen3(folder, shape, torch.bfloat16)
        dist.barrier()
        if args.micro_batch == AUTO:  # the arithmetic's first guess, then the probe on the first model built
            choice = choose_micro_batch(args, info, shape, folder)
            if info.is_main_process:
                print(choice.describe(), flush=True)
        models, optimizers, scalers, compiled, probe = build_models(args, setup, modes, folder, choice is not None)
        if probe is not None and info.is_main_process:
            print(probe.describe(), flush=True)
        decided = probe if probe is not None else choice
        if decided is None:
            batching = Batching(args.micro_batch, args.accumulation)
        else:  # the flags stay as parsed; the run trains with the choice
            batching = Batching(decided.micro_batch, decided.accumulation)
        batches = random_batches(batching, args.seq_len, shape, info)
        run = Modes(args, setup, models, optimizers, scalers, batches, batching)
        warmups = {mode: measure(run, mode, args.warmup) for mode in modes}
        samples: dict[str, list[dict]] = {m: [] for m in modes}
        for repeat in range(args.repeats):
            for mode in modes[repeat % len(modes) :] + modes[: repeat % len(modes)]:
                samples[mode].append(measure(run, mode, args.steps))
        profiles = profile(run, modes)
        if info.is_main_process:
            kernels = {"liger": args.liger, "compile": args.compile, "compiled_blocks": compiled}
            kernels["gradient_checkpointing"] = getattr(args, "gradient_checkpointing", True)
            report(
                args, batching, setup, shape, samples, profiles, warmups, kernels, decided, choice if probe else None
            )
    finally:
        destroy_distributed()
