"""Memory per GPU of Qwen3-4B in 4-bit QLoRA: peft's float32 upcast of the frozen weights vs keeping them.

    python scripts/memory_4bit.py --out docs/memory_4bit_cpu.json

The arithmetic (``ddp_ft.training.model.memory.estimate``) is checked against a CPU proxy: Qwen3-4B at full width
(hidden 2560, vocab 151,936, tied embeddings) with 2 decoder layers instead of 36, random weights written with
``save_pretrained`` and loaded through ``load_qlora_model`` (NF4 on the CPU by bitsandbytes), one step of the training
loop's ``forward_backward`` under autocast at ``--seq-len``. Measured: the bytes of parameters, buffers and quantisation
state (their storages), of the LoRA gradients and AdamW moments, and the peak of the CPU allocator's accounting over
the step (matmuls skipped, ``ddp_ft.training.model.memory.step_peak_bytes``). The arithmetic, once it matches, gives 36
layers. Exits 1 if it does not.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..distributed import DistInfo
from ..training.model.memory import QWEN3_4B, Qwen3Shape, estimate, parameter_bytes, step_peak_bytes
from ..training.model.precision import DTYPES
from ..training.model.qlora import LoraSettings, ModelSettings, load_qlora_model
from ..training.steps import forward_backward
from .bench import build_random_qwen3, cpu_name

LAYOUTS = {"upcast": True, "kept": False}  # name -> upcast_frozen_weights
SLACK_BYTES = 64 * 1024  # the step's small tensors (token ids, labels, norm statistics, loss scalars) are not modelled


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("docs/memory_4bit_cpu.json"), help="JSON report")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per forward")
    p.add_argument("--compute-dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--proxy-layers", type=int, default=2, help="decoder layers of the CPU proxy")
    return p.parse_args()


def measure(path: Path, upcast: bool, args: argparse.Namespace) -> dict[str, int]:
    """Bytes of one layout of the proxy: parameters, LoRA gradients, AdamW moments, the step's peak."""
    settings = ModelSettings(
        model_name_or_path=str(path), compute_dtype=args.compute_dtype, upcast_frozen_weights=upcast
    )
    model = load_qlora_model(settings, LoraSettings(), {"": "cpu"}).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:  # the DDP buckets: gradients exist before the backward
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, model.config.vocab_size, (args.micro_batch, args.seq_len))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    precision = settings.precision(torch.device("cpu"))
    peak = step_peak_bytes(lambda: forward_backward(model, [batch], DistInfo(), precision=precision))
    optimizer = torch.optim.AdamW(trainable)
    optimizer.step()  # zero gradients: only the moments' allocation matters here
    moments = sum(t.nbytes for s in optimizer.state.values() for k, t in s.items() if k != "step")
    return {
        "parameters": parameter_bytes(model),
        "lora_gradients": sum(p.grad.nbytes for p in trainable),
        "adamw_moments": moments,
        "step_peak": peak,
    }


def arithmetic(shape: Qwen3Shape, upcast: bool, args: argparse.Namespace):
    """The bytes ``ddp_ft.training.model.memory.estimate`` gives ``shape`` at this run's settings."""
    return estimate(shape, args.seq_len, args.micro_batch, args.compute_dtype, upcast_frozen_weights=upcast)


def main() -> int:
    """Measure the proxy, compare it with the arithmetic, print the table and write the JSON.

    Returns:
        0 when the arithmetic matches the proxy, else 1.
    """
    args = parse_args()
    start = time.perf_counter()
    proxy = Qwen3Shape(**{**vars(QWEN3_4B), "num_hidden_layers": args.proxy_layers})
    report: dict = {
        "command": "python scripts/memory_4bit.py " + " ".join(sys.argv[1:]),
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "compute_dtype": args.compute_dtype,
        "proxy_shape": vars(proxy),
        "shape": vars(QWEN3_4B),
        "proxy": {},
        "qwen3_4b": {},
    }
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_qwen3(Path(tmp) / "proxy", proxy, DTYPES[args.compute_dtype])
        for name, upcast in LAYOUTS.items():
            measured = measure(path, upcast, args)
            e = arithmetic(proxy, upcast, args)
            computed = {"parameters": e.parameter_bytes, **e.training_state, "step_peak": e.step_peak}
            diff = {k: measured[k] - computed[k] for k in measured}
            ok &= all(v == 0 for k, v in diff.items() if k != "step_peak") and 0 <= diff["step_peak"] <= SLACK_BYTES
            report["proxy"][name] = {"measured": measured, "arithmetic": computed, "measured_minus_arithmetic": diff}
    for name, upcast in LAYOUTS.items():
        e = arithmetic(QWEN3_4B, upcast, args)
        report["qwen3_4b"][name] = {
            "parameters": e.parameters,
            "training_state": e.training_state,
            "activations_at_step_peak": e.activations,
            "parameter_bytes": e.parameter_bytes,
            "resident_bytes": e.resident,
            "step_peak_bytes": e.step_peak,
            "peak_bytes": e.peak,
        }
    report["wall_s"] = round(time.perf_counter() - start, 1)
    report["max_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)
    report["machine"] = f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}"
    report["arithmetic_matches_proxy"] = ok
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


def print_table(report: dict) -> None:
    """The report as a table: Qwen3-4B's bytes per layout, then the proxy's measured minus arithmetic."""
    gb = 1e9
    q = report["qwen3_4b"]
    print(
        f"\nQwen3-4B, NF4 + LoRA r=16 all-linear, {report['compute_dtype']}, seq {report['seq_len']}, "
        f"micro-batch {report['micro_batch']}, non-reentrant checkpointing (GB = 1e9 bytes)"
    )
    print(f"{'':34} {'upcast (peft)':>14} {'kept (ours)':>12}")
    rows = [
        ("resident: parameters", "parameter_bytes"),
        ("resident: + grads and AdamW", "resident_bytes"),
        ("step peak (activations)", "step_peak_bytes"),
        ("expected peak per GPU", "peak_bytes"),
    ]
    for label, key in rows:
        print(f"{label:34} {q['upcast'][key] / gb:14.3f} {q['kept'][key] / gb:12.3f}")
    print(f"\nCPU proxy ({report['proxy_shape']['num_hidden_layers']} layers at full width), measured - arithmetic:")
    for name, r in report["proxy"].items():
        print(
            f"  {name:7} "
            + ", ".join(f"{k} {r['measured'][k]:,} ({v:+,})" for k, v in r["measured_minus_arithmetic"].items())
        )
    print(
        f"\narithmetic matches the proxy: {report['arithmetic_matches_proxy']}; "
        f"{report['wall_s']} s, max RSS {report['max_rss_gb']} GB"
    )
