"""Qwen3-4B QLoRA training speed on GPUs: tokens/s, step time, peak memory and model FLOPs utilisation.

    python scripts/bench_gpu.py                                     # 1 GPU: BucketedDDP vs no wrapper
    torchrun --standalone --nproc_per_node=2 scripts/bench_gpu.py   # 2 GPUs: scaling

No download: a Qwen3-4B-shaped model (``ddp_ft.memory.QWEN3_4B``) with random weights is built once into
``$DDP_FT_CACHE`` (local rank 0 builds, the others wait) and loaded through ``load_qlora_model``: NF4 with double
quantisation, LoRA r=16 on every linear layer, non-reentrant gradient checkpointing, the compute dtype for the device
(``ddp_ft.bench.compute_setup``). Each optimizer step trains ``--accumulation`` random sequences of ``--seq-len``
tokens per rank (``--micro-batch`` sequences each) with the loop's ``forward_backward``, clipping and AdamW. Modes,
each with its own model, alternate within the run (order rotating every repeat) after ``--warmup`` steps each:

- 1 process: ``single`` (no wrapper) and ``bucketed_ddp`` (BucketedDDP on a process group of size 1): the wrapper's
  overhead, target under 1%.
- N processes: ``single`` (rank 0 alone, the others wait), ``independent`` (every rank unwrapped at once, no
  communication: the ceiling the devices allow) and ``bucketed_ddp``: the scaling.

Model FLOPs per token (``ddp_ft.bench.MFU_FORMULA``): 4*N_base + 6*N_lora + 12*L*T*d_attn (forward 2*N_base +
2*N_lora + 4*L*T*d_attn; the backward computes activation gradients through the frozen weights, 2*N_base, and
activation and weight gradients of the adapters, 4*N_lora; attention twice its forward); recomputation under
checkpointing not counted. Peak: ``--peak-tflops``, else ``ddp_ft.bench.PEAK_TFLOPS`` by device name, else unknown.
``--shape tiny`` (with ``--device cpu``) is the smoke test.

``--micro-batch auto`` takes the micro-batch the run settings' ``--micro-batch auto`` would
(``ddp_ft.setup.resolve_micro_batch``: ``ddp_ft.memory``'s arithmetic for this shape, ``--seq-len`` and
``--effective-batch`` against the GPU's memory) and records its expected peak beside the measured
``max_memory_allocated``. ``--liger`` and ``--compile`` build every mode's model as the plain loop does with them
(``ddp_ft.kernels``); each mode's loss per step is recorded, so a run with them compares with one without
(``--lora-dropout 0``: no dropout masks, the same losses up to the kernels' rounding).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_ft.bench import (
    BENCH_SHAPES,
    MFU_FORMULA,
    ComputeSetup,
    build_random_qwen3,
    compute_setup,
    peak_tflops,
    qlora_training_flops,
    random_qwen3_name,
    synchronize,
)
from ddp_ft.config import RunSettings, TrainSettings
from ddp_ft.data import DataSettings
from ddp_ft.ddp import BucketedDDP, DDPSettings
from ddp_ft.ddp.autotune import AUTO
from ddp_ft.distributed import DEVICE_CHOICES, DistInfo, destroy_distributed
from ddp_ft.kernels import apply_liger_to_qwen3, check_kernel_settings, compile_repeated_blocks
from ddp_ft.memory import MicroBatchChoice, Qwen3Shape
from ddp_ft.model import LoraSettings, ModelSettings, load_qlora_model
from ddp_ft.precision import DTYPES, Precision
from ddp_ft.setup import cache_dir, resolve_micro_batch, seed_everything
from ddp_ft.steps import forward_backward, step_counts

OVERRIDES = {  # --flag -> Qwen3Shape field
    "layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
}
# DESIGN.md: Qwen3-4B QLoRA, seq 512, 2x RTX 4090 over PCIe (with real AMI samples, accumulation 16 / 8).
REFERENCE = {
    "device": "NVIDIA GeForce RTX 4090",
    "tokens_per_s_1_gpu": 1650,
    "tokens_per_s_2_gpus": "3000-3200",
    "speedup_2_gpus": 1.9,
    "peak_memory_gb_1_gpu": 5.58,
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
    p.add_argument("--compute-dtype", choices=["auto", *DTYPES], default="auto", help="ddp_ft.precision")
    p.add_argument("--peak-tflops", type=float, help="the device's peak TFLOP/s in the compute dtype (MFU)")
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_gpu.json"), help="JSON result file")
    args = p.parse_args()
    if args.micro_batch != AUTO and (args.effective_batch is not None or args.device_memory_gb is not None):
        p.error("--effective-batch and --device-memory-gb go with --micro-batch auto")
    if args.micro_batch == AUTO and args.accumulation != 1:
        p.error("--micro-batch auto derives the accumulation from --effective-batch: drop --accumulation")
    return args


def choose_micro_batch(args: argparse.Namespace, info: DistInfo, shape: Qwen3Shape, folder: Path) -> MicroBatchChoice:
    """``--micro-batch auto`` as the run settings resolve it (``ddp_ft.setup.resolve_micro_batch``), with this
    benchmark's shape, sequence length, dtype and LoRA settings; ``--device-memory-gb`` replaces the GPU's total.

    Raises:
        ValueError: on the CPU without ``--device-memory-gb``, or when micro-batch 1 does not fit, naming the flag.
    """
    data = DataSettings()
    # Set after the checks: their floor of 64 tokens holds a chat prompt and an answer; random tokens need neither.
    data.max_seq_len = args.seq_len
    settings = RunSettings(
        model=ModelSettings(model_name_or_path=str(folder), compute_dtype=args.compute_dtype),
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
    """``steps`` optimizer steps as ``ddp_ft.loop`` takes them (forward_backward, unscale, clip, AdamW); the seconds
    and the loss of each (read after the last step: no host sync in the timed steps). ``info`` is the job's for
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


def build_models(args: argparse.Namespace, setup: ComputeSetup, modes: list[str], folder: Path) -> tuple:
    """One model per mode (``--liger`` and ``--compile`` as the plain loop applies them), its AdamW and loss scaler;
    and how many blocks ``--compile`` compiled per model."""
    if args.liger:  # before the models are built: Liger swaps transformers' Qwen3 classes for this process
        apply_liger_to_qwen3(str(folder))
    models, optimizers, scalers, compiled = {}, {}, {}, 0
    for mode in modes:
        seed_everything(0)
        settings = ModelSettings(model_name_or_path=str(folder), compute_dtype=args.compute_dtype)
        lora = LoraSettings(lora_dropout=args.lora_dropout)
        model = load_qlora_model(settings, lora, setup.device_map, setup.info.world_size).train()
        if args.compile:  # in place, before BucketedDDP wraps it, as the plain loop does
            compiled = compile_repeated_blocks(model)
        models[mode] = BucketedDDP(model) if mode == "bucketed_ddp" else model
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizers[mode] = torch.optim.AdamW(trainable, lr=2e-4)
        scalers[mode] = setup.precision.grad_scaler()
    return models, optimizers, scalers, compiled


def main() -> None:
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
        if args.micro_batch == AUTO:
            choice = choose_micro_batch(args, info, shape, folder)
            args.micro_batch, args.accumulation = choice.micro_batch, choice.accumulation
            if info.is_main_process:
                print(choice.describe(), flush=True)
        models, optimizers, scalers, compiled = build_models(args, setup, modes, folder)
        g = torch.Generator().manual_seed(info.rank)
        batches = []
        for _ in range(4):
            group = []
            for _ in range(args.accumulation):
                ids = torch.randint(0, shape.vocab_size, (args.micro_batch, args.seq_len), generator=g).to(device)
                group.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
            batches.append(group)

        def measure(mode: str, steps: int) -> dict:
            runs = mode != "single" or info.is_main_process
            job = info if mode == "bucketed_ddp" else DistInfo(device=device)
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            seconds, losses = (
                train_steps(models[mode], optimizers[mode], scalers[mode], batches, job, setup.precision, steps)
                if runs
                else ([0.0] * steps, [])
            )
            memory = (
                [resident, torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)]
                if device.type == "cuda"
                else [0, 0, 0]
            )
            slowest = torch.tensor(
                seconds + [float(m) if runs else 0.0 for m in memory], dtype=torch.float64, device=device
            )
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            seconds, memory = slowest[:steps].tolist(), slowest[steps:].tolist()
            ranks = 1 if mode == "single" else info.world_size
            return {
                "seconds": seconds,
                "tokens_per_s": ranks * args.accumulation * args.micro_batch * args.seq_len * steps / sum(seconds)
                if steps
                else 0.0,  # --warmup 0
                "resident_bytes": memory[0],
                "peak_allocated_bytes": memory[1],
                "peak_reserved_bytes": memory[2],
                "losses": losses,
            }

        warmups = {mode: measure(mode, args.warmup) for mode in modes}
        samples: dict[str, list[dict]] = {m: [] for m in modes}
        for repeat in range(args.repeats):
            for mode in modes[repeat % len(modes) :] + modes[: repeat % len(modes)]:
                samples[mode].append(measure(mode, args.steps))
        profiles = {}
        for mode in modes if args.profile_steps > 0 else []:
            dist.barrier()
            if mode != "single" or info.is_main_process:
                job = info if mode == "bucketed_ddp" else DistInfo(device=device)
                profiles[mode] = device_busy(
                    models[mode], optimizers[mode], scalers[mode], batches, job, setup.precision, args.profile_steps
                )
        if info.is_main_process:
            kernels = {"liger": args.liger, "compile": args.compile, "compiled_blocks": compiled}
            report(args, setup, shape, samples, profiles, warmups, kernels, choice)
    finally:
        destroy_distributed()


def report(
    args: argparse.Namespace,
    setup: ComputeSetup,
    shape: Qwen3Shape,
    samples: dict[str, list[dict]],
    profiles: dict[str, dict],
    warmups: dict[str, dict],
    kernels: dict,
    choice: MicroBatchChoice | None,
) -> None:
    info, device = setup.info, setup.info.device
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    flops = qlora_training_flops(shape, args.seq_len, LoraSettings().lora_r)
    peak = args.peak_tflops or peak_tflops(name, setup.precision.dtype)
    peak_source = "--peak-tflops" if args.peak_tflops else ("ddp_ft.bench.PEAK_TFLOPS" if peak else "unknown")
    gb = 1e9
    modes = {}
    for mode, runs in samples.items():
        tokens = [r["tokens_per_s"] for r in runs]
        steps = [s for r in runs for s in r["seconds"]]
        devices = 1 if mode == "single" else info.world_size
        median = statistics.median(tokens)
        modes[mode] = {
            "devices": devices,
            "tokens_per_s": median,
            "tokens_per_s_range": [min(tokens), max(tokens)],
            "tokens_per_s_all_repeats": tokens,
            "step_s": statistics.median(steps),
            "step_s_range": [min(steps), max(steps)],
            "step_s_all": steps,
            "mfu": median / devices * flops.per_token / (peak * 1e12) if peak else None,
            "resident_gb": max(r["resident_bytes"] for r in runs) / gb if cuda else None,
            "peak_allocated_gb": max(r["peak_allocated_bytes"] for r in runs) / gb if cuda else None,
            "peak_reserved_gb": max(r["peak_reserved_bytes"] for r in runs) / gb if cuda else None,
            "profile": profiles.get(mode),
            # every step's loss in the order this mode ran them (warm-up first): the same run with and without
            # --liger / --compile compares here
            "losses": warmups[mode]["losses"] + [loss for r in runs for loss in r["losses"]],
        }
    result = {
        "command": launch_command(info),
        "device": name,
        "world_size": info.world_size,
        "backend": setup.backend,
        "compute_dtype": setup.precision.name,
        "versions": versions(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "shape": vars(shape),
        "flops_per_token": {
            "forward": flops.forward,
            "backward": flops.backward,
            "total": flops.per_token,
            "n_base": flops.base_matmul_params,
            "n_lora": flops.lora_params,
        },
        "mfu_formula": MFU_FORMULA,
        "peak_tflops": peak,
        "peak_tflops_source": peak_source,
        "modes": modes,
        "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,  # rank 0, all modes
        "reference": REFERENCE,
        "kernels": kernels,
        "micro_batch_auto": micro_batch_auto(choice, modes) if choice is not None else None,
    }
    if "single" in samples and "bucketed_ddp" in samples:
        paired = [
            b["tokens_per_s"] / s["tokens_per_s"]
            for b, s in zip(samples["bucketed_ddp"], samples["single"], strict=True)
        ]
        key = "bucketed_ddp_overhead" if info.world_size == 1 else "speedup_over_1_process"
        value = 1 - statistics.median(paired) if info.world_size == 1 else statistics.median(paired)
        result[key] = value
        result[key + "_per_repeat"] = [1 - p if info.world_size == 1 else p for p in paired]
    if "independent" in samples and "bucketed_ddp" in samples:
        result["bucketed_ddp_over_independent"] = (
            modes["bucketed_ddp"]["tokens_per_s"] / modes["independent"]["tokens_per_s"]
        )
    print_table(result, setup)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def micro_batch_auto(choice: MicroBatchChoice, modes: dict[str, dict]) -> dict:
    """``--micro-batch auto``'s choice, its expected peak, and the measured ``max_memory_allocated`` beside it (with
    one mode only: with several, every mode's model is resident and the peak is not one model's)."""
    measured = next(iter(modes.values()))["peak_allocated_gb"] if len(modes) == 1 else None
    expected = choice.expected_peak / 1e9
    return {
        "micro_batch": choice.micro_batch,
        "accumulation": choice.accumulation,
        "world_size": choice.world_size,
        "expected_peak_gb": expected,
        "budget_gb": choice.budget / 1e9,
        "device_gb": choice.device_bytes / 1e9,
        "measured_peak_allocated_gb": measured,
        "measured_over_expected": measured / expected if measured else None,
        "describe": choice.describe(),
    }


def launch_command(info: DistInfo) -> str:
    nodes = info.world_size // info.local_world_size
    launcher = "python" if not info.is_distributed else f"torchrun --nproc_per_node={info.local_world_size}"
    return " ".join([launcher + (f" --nnodes={nodes}" if nodes > 1 else ""), *sys.argv])


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for package in ("transformers", "peft", "bitsandbytes"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def print_table(r: dict, setup: ComputeSetup) -> None:
    s = r["shape"]
    print(f"{setup.describe()}; world size {r['world_size']}")
    print(
        f"Qwen3 shape: {s['num_hidden_layers']} layers, hidden {s['hidden_size']}, vocab {s['vocab_size']}; NF4 + "
        f"LoRA r=16 all-linear, seq {r['settings']['seq_len']}, micro-batch {r['settings']['micro_batch']}, "
        f"accumulation {r['settings']['accumulation']}, {r['settings']['repeats']} repeats x "
        f"{r['settings']['steps']} steps"
    )
    rows = [
        f"| {'mode':<12} | {'tokens/s':>9} | {'min..max':>17} | {'step s':>7} | {'min..max step s':>15} | "
        f"{'MFU':>6} | {'peak alloc/reserved GB':>22} |",
        "|" + "---|" * 7,
    ]
    for mode, m in r["modes"].items():
        mfu = f"{m['mfu']:.1%}" if m["mfu"] is not None else "?"
        mem = f"{m['peak_allocated_gb']:.2f} / {m['peak_reserved_gb']:.2f}" if m["peak_allocated_gb"] else "-"
        lo, hi = m["tokens_per_s_range"]
        slo, shi = m["step_s_range"]
        rows.append(
            f"| {mode:<12} | {m['tokens_per_s']:>9.1f} | {lo:>8.1f}..{hi:<7.1f} | {m['step_s']:>7.3f} | "
            f"{slo:>7.3f}..{shi:<6.3f} | {mfu:>6} | {mem:>22} |"
        )
    print("\n".join(rows))
    if auto := r["micro_batch_auto"]:
        measured = auto["measured_peak_allocated_gb"]
        print(
            f"{auto['describe']}; measured peak allocated "
            + (f"{measured:.3f} GB ({auto['measured_over_expected']:.1%} of expected)" if measured else "n/a")
        )
    if "bucketed_ddp_overhead" in r:
        print(
            f"BucketedDDP overhead at world size 1 (paired median per repeat): {r['bucketed_ddp_overhead']:.2%} "
            "(target < 1%)"
        )
    for mode, m in r["modes"].items():
        if prof := m["profile"]:
            busy = (
                f"device kernels {prof['device_kernel_ms_per_step']:.0f} ms ({prof['device_busy_fraction']:.0%} busy), "
                f"{prof['device_ops_per_step']:,.0f} device ops"
                if prof["device_busy_fraction"] is not None
                else "no device (host time only)"
            )
            print(f"profile {mode}: {prof['wall_ms_per_step']:.0f} ms per step, {busy} ({prof['steps']} steps)")
    if "speedup_over_1_process" in r:
        print(f"speedup of {r['world_size']} ranks over 1 process: {r['speedup_over_1_process']:.2f}x")
    if "bucketed_ddp_over_independent" in r:
        print(f"BucketedDDP / independent ranks (no communication): {r['bucketed_ddp_over_independent']:.1%}")
    f = r["flops_per_token"]
    print(
        f"model FLOPs per token {f['total'] / 1e9:.4g} G (forward {f['forward'] / 1e9:.4g} G, backward "
        f"{f['backward'] / 1e9:.4g} G; N_base {f['n_base']:,}, N_lora {f['n_lora']:,}); peak "
        f"{r['peak_tflops'] or '?'} TFLOP/s ({r['peak_tflops_source']})\n{r['mfu_formula']}"
    )
    if r["modes"].get("single", {}).get("peak_allocated_gb"):
        print("peak memory: every mode's model stays resident; --modes single gives one model's own peak")
    else:
        print(f"max RSS of rank 0 (all modes): {r['max_rss_gb']:.2f} GB")
    ref = r["reference"]
    print(
        f"reference ({ref['device']}, Qwen3-4B QLoRA seq 512 on AMI): {ref['tokens_per_s_1_gpu']} tokens/s on 1 "
        f"GPU, {ref['tokens_per_s_2_gpus']} on 2 (~{ref['speedup_2_gpus']}x), peak {ref['peak_memory_gb_1_gpu']} GB"
    )


if __name__ == "__main__":
    main()
