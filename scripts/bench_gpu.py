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
import time
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from ddp_ft.ddp import BucketedDDP, DDPSettings
from ddp_ft.ddp.autotune import AUTO
from ddp_ft.distributed import DEVICE_CHOICES, DistInfo, destroy_distributed, keep_upstream_notices_to_rank_zero
from ddp_ft.tools.bench import (
    BENCH_SHAPES,
    ComputeSetup,
    build_random_qwen3,
    compute_setup,
    random_qwen3_name,
    synchronize,
)
from ddp_ft.tools.gpu_report.bench_gpu_result import micro_batch_auto, report  # noqa: F401  (micro_batch_auto: tests)
from ddp_ft.training.config import RunSettings, TrainSettings
from ddp_ft.training.data import DataSettings
from ddp_ft.training.model.compilation import compile_repeated_blocks
from ddp_ft.training.model.kernels import apply_liger_to_qwen3, check_kernel_settings
from ddp_ft.training.model.memory import MicroBatchChoice, Qwen3Shape
from ddp_ft.training.model.precision import DTYPES, Precision
from ddp_ft.training.model.probe import MicroBatchProbe, host_peak_bytes, probe_micro_batch
from ddp_ft.training.model.qlora import LoraSettings, ModelSettings, load_qlora_model
from ddp_ft.training.resolve import resolve_micro_batch
from ddp_ft.training.setup import cache_dir, seed_everything
from ddp_ft.training.steps import forward_backward, step_counts

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


def choose_micro_batch(args: argparse.Namespace, info: DistInfo, shape: Qwen3Shape, folder: Path) -> MicroBatchChoice:
    """``--micro-batch auto`` as the run settings resolve it (``ddp_ft.training.resolve.resolve_micro_batch``), with this
    benchmark's shape, sequence length, dtype and LoRA settings; ``--device-memory-gb`` replaces the GPU's total.

    Raises:
        ValueError: on the CPU without ``--device-memory-gb``, or when micro-batch 1 does not fit, naming the flag.
    """
    data = DataSettings()
    # Set after the checks: their floor of 64 tokens holds a chat prompt and an answer; random tokens need neither.
    data.max_seq_len = args.seq_len
    settings = RunSettings(
        model=ModelSettings(
            model_name_or_path=str(folder),
            compute_dtype=args.compute_dtype,
            gradient_checkpointing=getattr(args, "gradient_checkpointing", True),
        ),
        lora=LoraSettings(lora_dropout=args.lora_dropout),
        data=data,
        ddp=DDPSettings(),
        train=TrainSettings(effective_batch=args.effective_batch or 16, micro_batch=AUTO),
    )
    device_bytes = int(args.device_memory_gb * 1e9) if args.device_memory_gb is not None else None
    return resolve_micro_batch(settings, info, shape=shape, device_bytes=device_bytes)


def train_steps(
    model, optimizer, scaler, batches, info: DistInfo, precision: Precision, steps: int
) -> tuple[list[float], list[float]]:
    """``steps`` optimizer steps as ``ddp_ft.training.loop`` takes them (forward_backward, unscale, clip, AdamW); the
    seconds and the loss of each (read after the last step: no host sync in the timed steps). ``info`` is the job's for
    BucketedDDP, a world of one for the unwrapped modes (no collectives)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    alone = isinstance(model, BucketedDDP) and not info.is_distributed  # forward_backward skips no_sync here
    seconds, losses = [], []
    for step in range(steps):
        group = batches[step % len(batches)]
        synchronize(info.device)
        start = time.perf_counter()
        if alone and len(group) > 1:
            counts = step_counts(group, info)
            loss = 0.0
            for i, batch in enumerate(group):
                with model.no_sync() if i < len(group) - 1 else nullcontext():
                    loss = loss + forward_backward(model, [batch], info, counts, precision, scaler)[0]
        else:
            loss = forward_backward(model, group, info, precision=precision, scaler=scaler)[0]
        losses.append(loss)
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        synchronize(info.device)
        seconds.append(time.perf_counter() - start)
    return seconds, [float(x) for x in torch.stack(losses).tolist()] if losses else []


def device_busy(model, optimizer, scaler, batches, info: DistInfo, precision: Precision, steps: int) -> dict:
    """``steps`` more optimizer steps under ``torch.profiler``: how much of the wall time the device spent in kernels.

    A busy fraction far below 1 means the host (Python, autograd, kernel launches) sets the pace, not the GPU: longer
    sequences or larger micro-batches then raise tokens/s almost for free, and no wrapper can hide it. Kernel time is
    summed as ``torch.profiler``'s own table sums "Self CUDA" (device events, user annotations excluded); kernels on
    other streams that overlap (NCCL) count in full. The profiler slows the host, so the fraction is a lower bound of
    an unprofiled step's. On the CPU there is no device: host time only.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = info.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        seconds, _ = train_steps(model, optimizer, scaler, batches, info, precision, steps)
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    wall_ms = 1e3 * sum(seconds)
    kernel_ms = sum(e.self_device_time_total for e in device_events) / 1e3
    return {
        "steps": steps,
        "wall_ms_per_step": wall_ms / steps,
        "device_kernel_ms_per_step": kernel_ms / steps if cuda else None,
        "device_busy_fraction": kernel_ms / wall_ms if cuda else None,
        "device_ops_per_step": len(device_events) / steps if cuda else None,
    }


def build_models(
    args: argparse.Namespace, setup: ComputeSetup, modes: list[str], folder: Path, probe_auto: bool = False
) -> tuple:
    """One model per mode (``--liger`` and ``--compile`` as the plain loop applies them), its AdamW and loss scaler;
    how many blocks ``--compile`` compiled per model; with ``probe_auto`` (``--micro-batch auto``) the probe's
    choice on the first model, unwrapped, alone on the device, which sets ``args.micro_batch`` and
    ``args.accumulation`` (else None)."""
    if args.liger:  # before the models are built: Liger swaps transformers' Qwen3 classes for this process
        apply_liger_to_qwen3(str(folder))
    models, optimizers, scalers, compiled, probe = {}, {}, {}, 0, None
    for mode in modes:
        seed_everything(0)
        settings = ModelSettings(
            model_name_or_path=str(folder),
            compute_dtype=args.compute_dtype,
            gradient_checkpointing=getattr(args, "gradient_checkpointing", True),
        )
        lora = LoraSettings(lora_dropout=args.lora_dropout)
        model = load_qlora_model(settings, lora, setup.device_map, setup.info.world_size).train()
        if args.compile:  # in place, before BucketedDDP wraps it, as the plain loop does
            compiled = compile_repeated_blocks(model)
        if probe_auto and probe is None:  # before BucketedDDP wraps it: its hooks would communicate
            probe = probe_model(args, setup, model)
        models[mode] = BucketedDDP(model) if mode == "bucketed_ddp" else model
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizers[mode] = torch.optim.AdamW(trainable, lr=2e-4)
        scalers[mode] = setup.precision.grad_scaler()
    return models, optimizers, scalers, compiled, probe


def probe_model(args: argparse.Namespace, setup: ComputeSetup, model) -> MicroBatchProbe:
    """``--micro-batch auto`` as the loop decides it (``ddp_ft.training.model.probe``): measured on ``model`` at ``--seq-len``
    against the GPU's memory or ``--device-memory-gb``; on the CPU by the profiler's memory events."""
    info = setup.info
    device_bytes = int(args.device_memory_gb * 1e9) if args.device_memory_gb is not None else None
    probe = probe_micro_batch(
        model,
        seq_len=args.seq_len,
        effective_batch=args.effective_batch or 16,
        info=info,
        precision=setup.precision,
        device_bytes=device_bytes,
        measure=None if info.device.type == "cuda" else host_peak_bytes(model),
    )
    args.micro_batch, args.accumulation = probe.micro_batch, probe.accumulation
    return probe


class Modes(NamedTuple):
    """Every mode's model, optimizer and loss scaler, and this rank's batches (the same for every mode)."""

    args: argparse.Namespace
    setup: ComputeSetup
    models: dict
    optimizers: dict
    scalers: dict
    batches: list[list[dict]]


def random_batches(args: argparse.Namespace, shape: Qwen3Shape, info: DistInfo) -> list[list[dict]]:
    """Four optimizer steps of random sequences (``accumulation`` micro-batches each), seeded by the rank."""
    g = torch.Generator().manual_seed(info.rank)
    batches = []
    for _ in range(4):
        group = []
        for _ in range(args.accumulation):
            ids = torch.randint(0, shape.vocab_size, (args.micro_batch, args.seq_len), generator=g).to(info.device)
            group.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
        batches.append(group)
    return batches


def measure(run: Modes, mode: str, steps: int) -> dict:
    """``steps`` timed optimizer steps of ``mode`` (``single`` on rank 0 only); every value the slowest rank's."""
    args, info = run.args, run.setup.info
    device = info.device
    runs = mode != "single" or info.is_main_process
    job = info if mode == "bucketed_ddp" else DistInfo(device=device)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    seconds, losses = ([0.0] * steps, [])
    if runs:
        model, optimizer, scaler = run.models[mode], run.optimizers[mode], run.scalers[mode]
        seconds, losses = train_steps(model, optimizer, scaler, run.batches, job, run.setup.precision, steps)
    memory = [0, 0, 0]
    if device.type == "cuda":
        memory = [resident, torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)]
    slowest = torch.tensor(seconds + [float(m) if runs else 0.0 for m in memory], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    seconds, memory = slowest[:steps].tolist(), slowest[steps:].tolist()
    ranks = 1 if mode == "single" else info.world_size
    tokens = ranks * args.accumulation * args.micro_batch * args.seq_len * steps
    return {
        "seconds": seconds,
        "tokens_per_s": tokens / sum(seconds) if steps else 0.0,  # --warmup 0
        "resident_bytes": memory[0],
        "peak_allocated_bytes": memory[1],
        "peak_reserved_bytes": memory[2],
        "losses": losses,
    }


def profile(run: Modes, modes: list[str]) -> dict[str, dict]:
    """Each mode's device-busy share over ``--profile-steps`` profiled steps (none when 0)."""
    info, profiles = run.setup.info, {}
    for mode in modes if run.args.profile_steps > 0 else []:
        dist.barrier()
        if mode != "single" or info.is_main_process:
            job = info if mode == "bucketed_ddp" else DistInfo(device=info.device)
            model, optimizer, scaler = run.models[mode], run.optimizers[mode], run.scalers[mode]
            profiles[mode] = device_busy(
                model, optimizer, scaler, run.batches, job, run.setup.precision, run.args.profile_steps
            )
    return profiles


def main() -> None:
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
            args.micro_batch, args.accumulation = choice.micro_batch, choice.accumulation
            if info.is_main_process:
                print(choice.describe(), flush=True)
        models, optimizers, scalers, compiled, probe = build_models(args, setup, modes, folder, choice is not None)
        if probe is not None and info.is_main_process:
            print(probe.describe(), flush=True)
        run = Modes(args, setup, models, optimizers, scalers, random_batches(args, shape, info))
        warmups = {mode: measure(run, mode, args.warmup) for mode in modes}
        samples: dict[str, list[dict]] = {m: [] for m in modes}
        for repeat in range(args.repeats):
            for mode in modes[repeat % len(modes) :] + modes[: repeat % len(modes)]:
                samples[mode].append(measure(run, mode, args.steps))
        profiles = profile(run, modes)
        if info.is_main_process:
            kernels = {"liger": args.liger, "compile": args.compile, "compiled_blocks": compiled}
            kernels["gradient_checkpointing"] = getattr(args, "gradient_checkpointing", True)
            report(args, setup, shape, samples, profiles, warmups, kernels, probe or choice, choice if probe else None)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
