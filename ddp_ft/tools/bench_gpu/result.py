"""The GPU benchmark's result: the JSON it writes and the table it prints.

The JSON holds tokens/s, step time, peak memory and MFU per mode, the wrapper's overhead or the scaling, and
``--micro-batch auto``'s expected peak against the measured one.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path

import torch

from ...distributed import DistInfo
from ...training.model.memory import MicroBatchChoice, Qwen3Shape
from ...training.model.probe import MicroBatchProbe
from ...training.model.qlora import LoraSettings
from ..bench import MFU_FORMULA, ComputeSetup, peak_tflops, qlora_training_flops
from .steps import Batching

# DESIGN.md: Qwen3-4B QLoRA, seq 512, 2x RTX 4090 over PCIe (with real AMI samples, accumulation 16 / 8).
REFERENCE = {
    "device": "NVIDIA GeForce RTX 4090",
    "tokens_per_s_1_gpu": 1650,
    "tokens_per_s_2_gpus": "3000-3200",
    "speedup_2_gpus": 1.9,
    "peak_memory_gb_1_gpu": 5.58,
}


def mode_summary(runs: list[dict], warmup: dict, devices: int, mfu_per_token: float | None, cuda: bool) -> dict:
    """One mode's repeats: tokens/s and step time (median, range, all), MFU, memory, and every step's loss."""
    gb = 1e9
    tokens = [r["tokens_per_s"] for r in runs]
    steps = [s for r in runs for s in r["seconds"]]
    median = statistics.median(tokens)
    return {
        "devices": devices,
        "tokens_per_s": median,
        "tokens_per_s_range": [min(tokens), max(tokens)],
        "tokens_per_s_all_repeats": tokens,
        "step_s": statistics.median(steps),
        "step_s_range": [min(steps), max(steps)],
        "step_s_all": steps,
        "mfu": median * mfu_per_token if mfu_per_token else None,
        "resident_gb": max(r["resident_bytes"] for r in runs) / gb if cuda else None,
        "peak_allocated_gb": max(r["peak_allocated_bytes"] for r in runs) / gb if cuda else None,
        "peak_reserved_gb": max(r["peak_reserved_bytes"] for r in runs) / gb if cuda else None,
        # every step's loss in the order this mode ran them (warm-up first): the same run with and without
        # --liger / --compile compares here
        "losses": warmup["losses"] + [loss for r in runs for loss in r["losses"]],
    }


def report(
    args: argparse.Namespace,
    batching: Batching,
    setup: ComputeSetup,
    shape: Qwen3Shape,
    samples: dict[str, list[dict]],
    profiles: dict[str, dict],
    warmups: dict[str, dict],
    kernels: dict,
    choice: MicroBatchChoice | MicroBatchProbe | None,
    first_guess: MicroBatchChoice | None = None,
) -> None:
    """Print the table and write the JSON to ``args.out``; its settings hold the micro-batch and accumulation trained
    with (``batching``), not ``--micro-batch auto``."""
    info, device = setup.info, setup.info.device
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    flops = qlora_training_flops(shape, args.seq_len, LoraSettings().lora_r)
    peak = args.peak_tflops or peak_tflops(name, setup.precision.dtype)
    peak_source = "--peak-tflops" if args.peak_tflops else ("ddp_ft.tools.bench.PEAK_TFLOPS" if peak else "unknown")
    settings = vars(args) | batching._asdict()
    modes = {}
    for mode, runs in samples.items():
        devices = 1 if mode == "single" else info.world_size
        mfu_per_token = flops.per_token / (peak * 1e12) / devices if peak else None
        modes[mode] = mode_summary(runs, warmups[mode], devices, mfu_per_token, cuda) | {"profile": profiles.get(mode)}
    result = {
        "command": launch_command(info),
        "device": name,
        "world_size": info.world_size,
        "backend": setup.backend,
        "compute_dtype": setup.precision.name,
        "versions": versions(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in settings.items()},
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
        "micro_batch_auto": micro_batch_auto(choice, modes, first_guess) if choice is not None else None,
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


def micro_batch_auto(
    choice: MicroBatchChoice | MicroBatchProbe, modes: dict[str, dict], first_guess: MicroBatchChoice | None = None
) -> dict:
    """``--micro-batch auto``'s choice, its expected peak, and the measured ``max_memory_allocated`` beside it (with
    one mode only: with several, every mode's model is resident and the peak is not one model's).

    ``choice`` is the probe's (``ddp_ft.training.model.probe``: its points and line are kept under ``probe``) or the
    arithmetic's; ``first_guess``, the arithmetic's when the probe decided, is kept beside it, so a report shows both
    predictions against the one measurement."""
    measured = next(iter(modes.values()))["peak_allocated_gb"] if len(modes) == 1 else None
    expected = choice.expected_peak / 1e9
    extra = {"probe": choice.as_record()} if isinstance(choice, MicroBatchProbe) else {}
    if first_guess is not None:
        extra["arithmetic"] = {
            "micro_batch": first_guess.micro_batch,
            "expected_peak_gb": first_guess.expected_peak / 1e9,
        }
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
        **extra,
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
