"""Throughput of one process without DDP vs torch DDP vs BucketedDDP on the tiny Qwen3 QLoRA model.

    torchrun --standalone --nproc_per_node=2 scripts/bench_ddp.py --out bench_results/bench_ddp.json

Device, backend and compute dtype are chosen together: ``--device auto`` is each rank's GPU with NCCL on a CUDA host
(bfloat16 from compute capability 8.0, float16 with a loss scaler below, ``--compute-dtype`` to override), and
``--device cpu`` gloo with float32, CUDA ignored. On the CPU each rank is pinned to one thread, the analogue of one
GPU per rank; on CUDA the timed region is bracketed by device synchronisations. The single-process baseline runs on
rank 0 alone while rank 1 waits. Modes are repeated and interleaved (their order rotates every repeat) so drift on
the machine hits all of them alike; medians are reported, and the BucketedDDP / torch DDP ratio also as the median of
per-repeat (paired) ratios with a bootstrap 95% interval. Every optimizer step accumulates ``--grad-accum``
micro-batches per rank, under ``no_sync`` for all but the last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ..ddp import BucketedDDP
from ..distributed import destroy_distributed, keep_upstream_notices_to_rank_zero
from ..distributed.devices import DEVICE_CHOICES
from ..training.model.precision import DTYPES, Precision
from ..training.model.qlora import LoraSettings, ModelSettings, build_tiny_qwen3, load_qlora_model
from .bench import ComputeSetup, ExposedWaitProbe, compute_setup, cpu_name, synchronize

MODES = ("single", "torch_ddp", "bucketed_ddp")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sample")
    p.add_argument("--micro-batch", type=int, default=2, help="samples per micro-step per rank")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-steps per optimizer step per rank")
    p.add_argument("--steps", type=int, default=1, help="timed optimizer steps per mode per repeat")
    p.add_argument("--repeats", type=int, default=96, help="interleaved repeats of every mode")
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="bucket cap of both DDPs, first bucket included (default: both DDPs' defaults, 1 MiB first, then 25 MiB)",
    )
    p.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of the tiny model")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument(
        "--device",
        choices=DEVICE_CHOICES,
        default="auto",
        help="cuda: each rank's GPU with NCCL; cpu: gloo, CUDA ignored; auto: cuda when available",
    )
    p.add_argument(
        "--compute-dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="auto: bfloat16 on GPUs of compute capability >= 8.0, float16 below, float32 on the CPU",
    )
    p.add_argument("--out", type=Path, default=Path("bench_results/bench_ddp.json"), help="JSON result file")
    p.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        help="no benchmark: pool the per-repeat ratios of these earlier result files (plain python, no torchrun)",
    )
    return p.parse_args()


def caps_of(bucket_cap_mb: float | None) -> dict[str, dict[str, float]]:
    """``--bucket-cap-mb`` as each DDP takes it: none, or the same cap for every bucket, the first included."""
    if bucket_cap_mb is None:
        return {"torch": {}, "ours": {}}
    return {
        "torch": {"bucket_cap_mb": bucket_cap_mb},
        "ours": {"bucket_cap_mb": bucket_cap_mb, "first_bucket_cap_mb": bucket_cap_mb},
    }


def bucket_bytes(models) -> dict[str, list[int]]:
    """Bucket sizes in bytes, in launch order: torch DDP's as rebuilt after its first iteration, and ours."""
    torch_sizes = models["torch_ddp"]._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")
    return {
        "torch_ddp": [int(x) for x in torch_sizes.split(",") if x.strip()],
        "bucketed_ddp": models["bucketed_ddp"].bucket_nbytes,
    }


def run_steps(
    model, optimizer, scaler, probe, batches, steps: int, grad_accum: int, distributed: bool, precision: Precision
) -> float:
    """Run ``steps`` optimizer steps; return the wall seconds (of the slowest rank when distributed)."""
    device = batches[0].device
    synchronize(device)
    if distributed:
        dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        for micro in range(grad_accum):
            ids = batches[(step * grad_accum + micro) % len(batches)]
            accumulate_only = distributed and micro < grad_accum - 1
            with model.no_sync() if accumulate_only else nullcontext():
                with precision.autocast_context():
                    loss = model(input_ids=ids, labels=ids).loss
                probe.backward(scaler.scale(loss), record=distributed and not accumulate_only)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    elapsed = torch.tensor(time.perf_counter() - start, device=device)
    if distributed:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


class Modes(NamedTuple):
    """Every mode's model, optimizer, loss scaler and wait probe, and this rank's batches (the same for every mode)."""

    args: argparse.Namespace
    setup: ComputeSetup
    models: dict
    optimizers: dict
    scalers: dict
    probes: dict
    batches: list[torch.Tensor]


def build_modes(args: argparse.Namespace, setup: ComputeSetup, model_dir: Path) -> Modes:
    """The three modes' models on the tiny Qwen3 in ``model_dir``, each built from the same seed."""
    info, precision = setup.info, setup.precision

    def build():
        torch.manual_seed(0)
        settings = ModelSettings(model_name_or_path=str(model_dir), compute_dtype=args.compute_dtype)
        return load_qlora_model(settings, LoraSettings(), setup.device_map, info.world_size).train()

    models = {
        "single": build(),
        # torch DDP keeps its 1 MiB first bucket only when bucket_cap_mb is not given; an explicit cap applies
        # to its first bucket too. Both DDPs get the same layout either way (checked after the warm-up).
        "torch_ddp": TorchDDP(build(), **caps_of(args.bucket_cap_mb)["torch"]),
        "bucketed_ddp": BucketedDDP(build(), **caps_of(args.bucket_cap_mb)["ours"]),
    }
    optimizers = {
        k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4) for k, m in models.items()
    }
    scalers = {k: precision.grad_scaler() for k in models}  # no-ops unless float16
    probes = {k: ExposedWaitProbe(m, info.device) for k, m in models.items()}
    g = torch.Generator().manual_seed(info.rank)
    batches = [
        torch.randint(0, args.vocab_size, (args.micro_batch, args.seq_len), generator=g).to(info.device)
        for _ in range(8)
    ]
    return Modes(args, setup, models, optimizers, scalers, probes, batches)


def measure(run: Modes, mode: str, steps: int) -> float | None:
    """``steps`` optimizer steps of ``mode``: the slowest rank's seconds (``single``: rank 0's, None elsewhere)."""
    args, info, precision = run.args, run.setup.info, run.setup.precision
    model, optimizer, scaler, probe = run.models[mode], run.optimizers[mode], run.scalers[mode], run.probes[mode]
    if mode == "single":
        seconds = None
        if info.is_main_process:
            seconds = run_steps(model, optimizer, scaler, probe, run.batches, steps, args.grad_accum, False, precision)
        dist.barrier()
        return seconds
    return run_steps(model, optimizer, scaler, probe, run.batches, steps, args.grad_accum, True, precision)


def warm_up(run: Modes) -> dict[str, list[int]]:
    """Two optimizer steps per mode, then the two DDPs' bucket layouts, which must match.

    Raises:
        SystemExit: when the layouts differ.
    """
    # first-iteration allocations; torch DDP rebuilds its buckets in the forward after its first synced backward,
    # so it needs two optimizer steps
    for mode in MODES:
        measure(run, mode, 2)
    run.models["bucketed_ddp"].pop_comm_stats()
    layouts = bucket_bytes(run.models)
    if layouts["torch_ddp"] != layouts["bucketed_ddp"]:
        raise SystemExit(f"the two DDPs have different bucket layouts, the comparison would be unfair: {layouts}")
    for probe in run.probes.values():
        probe.samples.clear()
    return layouts


def main() -> None:
    """Benchmark the three modes under torchrun, or pool earlier results with ``--pool``."""
    keep_upstream_notices_to_rank_zero()
    args = parse_args()
    if args.pool:
        return pool(args.pool)
    setup = compute_setup(args.device, args.compute_dtype)
    info = setup.info
    torch.set_num_threads(args.threads)
    try:
        if info.world_size != 2:
            raise SystemExit("run with: torchrun --standalone --nproc_per_node=2 scripts/bench_ddp.py")
        model_dir = Path(tempfile.gettempdir()) / f"ddp_ft-bench-tiny-qwen3-v{args.vocab_size}"
        if info.is_main_process:
            build_tiny_qwen3(model_dir, vocab_size=args.vocab_size, seed=0)
        dist.barrier()
        run = build_modes(args, setup, model_dir)
        tokens_per_rank_step = args.micro_batch * args.seq_len * args.grad_accum
        layouts = warm_up(run)
        samples: dict[str, list[float]] = {m: [] for m in MODES}
        for repeat in range(args.repeats):
            order = MODES[repeat % 3 :] + MODES[: repeat % 3]
            for mode in order:
                seconds = measure(run, mode, args.steps)
                if seconds is not None:
                    world = 1 if mode == "single" else info.world_size
                    samples[mode].append(world * tokens_per_rank_step * args.steps / seconds)

        comm = run.models["bucketed_ddp"].pop_comm_stats()
        waits: list[dict | None] = [None] * info.world_size  # every rank's synced backwards: the faster one waits
        dist.all_gather_object(waits, {m: run.probes[m].seconds for m in ("torch_ddp", "bucketed_ddp")})
        exposed_ms = {m: 1e3 * statistics.mean([s for w in waits for s in w[m]]) for m in ("torch_ddp", "bucketed_ddp")}
        if info.is_main_process:
            report(args, setup, samples, comm, exposed_ms, layouts, tokens_per_rank_step)
    finally:
        destroy_distributed()


def bootstrap_median_ci(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median (seeded: the same samples give the same interval)."""
    g = torch.Generator().manual_seed(0)
    data = torch.tensor(values, dtype=torch.float64)
    picks = torch.randint(0, len(values), (resamples, len(values)), generator=g)
    medians = data[picks].median(dim=1).values.sort().values
    return medians[int(0.025 * resamples)].item(), medians[int(0.975 * resamples) - 1].item()


def pool(files: list[Path]) -> None:
    """Paired BucketedDDP / torch DDP ratios of several runs together: a tighter interval than any one run."""
    paired = []
    for f in files:
        result = json.loads(f.read_text())
        layouts = result.get("bucket_bytes")
        if not layouts or layouts["torch_ddp"] != layouts["bucketed_ddp"]:
            raise SystemExit(
                f"{f}: not a like-for-like run (bucket layouts unchecked or different); rerun the benchmark"
            )
        runs = result["tokens_per_s_all_repeats"]
        paired += [b / t for b, t in zip(runs["bucketed_ddp"], runs["torch_ddp"], strict=True)]
        print(
            f"{f}: {len(runs['torch_ddp'])} repeats, paired median {result['bucketed_over_torch_ddp_paired_median']:.3f}"
        )
    lo, hi = bootstrap_median_ci(paired)
    print(
        f"pooled over {len(paired)} repeats: BucketedDDP / torch DDP paired median {statistics.median(paired):.4f} "
        f"(95% CI {lo:.4f}..{hi:.4f}), mean {statistics.mean(paired):.4f}, "
        f"{sum(r >= 1 for r in paired)} of {len(paired)} repeats >= 1"
    )


def report(args, setup: ComputeSetup, samples, comm, exposed_ms, layouts, tokens_per_rank_step) -> None:
    """Print the table and the ratios, and write the JSON to ``--out``."""
    optimizer_steps = args.repeats * args.steps
    median = {m: statistics.median(v) for m, v in samples.items()}
    paired = [b / t for b, t in zip(samples["bucketed_ddp"], samples["torch_ddp"], strict=True)]
    info = setup.info
    if info.device.type == "cuda":
        hardware = f"{info.world_size} x {torch.cuda.get_device_name(info.device)}, {setup.backend}"
    else:
        hardware = f"{cpu_name()}, {info.world_size} ranks x {args.threads} thread(s), {setup.backend}"
    result = {
        "hardware": hardware,
        "device": info.device.type,
        "backend": setup.backend,
        "compute_dtype": setup.precision.name,
        "compute_dtype_reason": setup.precision.reason,
        "torch": torch.__version__,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "tokens_per_s": median,
        "tokens_per_s_all_repeats": samples,
        "step_time_s": {m: (1 if m == "single" else 2) * tokens_per_rank_step / median[m] for m in MODES},
        "bucketed_over_torch_ddp": median["bucketed_ddp"] / median["torch_ddp"],
        # each repeat runs both DDPs back to back: the median of per-repeat ratios cancels slow drift
        "bucketed_over_torch_ddp_paired_median": statistics.median(paired),
        "bucketed_over_torch_ddp_paired_ci95": bootstrap_median_ci(paired),
        "scaling_efficiency": {
            "bucketed_ddp": median["bucketed_ddp"] / (2 * median["single"]),
            "torch_ddp": median["torch_ddp"] / (2 * median["single"]),
        },
        "bucketed_ddp_per_optimizer_step": {
            "allreduce_calls": comm.allreduce_calls / optimizer_steps,
            "allreduce_bytes": comm.allreduce_bytes / optimizer_steps,
            "exposed_comm_ms": comm.exposed_comm_ms / optimizer_steps,
            "comm_window_ms": comm.comm_window_ms / optimizer_steps,
            "overlap": comm.overlap,
            "buckets": len(layouts["bucketed_ddp"]),
        },
        "bucket_bytes": layouts,  # launch order, identical for both DDPs
        # mean over both ranks' synced backwards, one per optimizer step
        "wait_after_last_grad_ms_per_optimizer_step": exposed_ms,
    }
    rows = [f"| {'mode':<13} | {'tokens/s':>9} | {'step s':>7} | {'min..max tokens/s':>19} |", "|" + "---|" * 4]
    for m in MODES:
        lo, hi = min(samples[m]), max(samples[m])
        rows.append(f"| {m:<13} | {median[m]:>9.0f} | {result['step_time_s'][m]:>7.3f} | {lo:>8.0f}..{hi:<9.0f} |")
    per_step = result["bucketed_ddp_per_optimizer_step"]
    print(f"{setup.describe()}; {hardware}")
    print("\n".join(rows))
    print(
        f"BucketedDDP / torch DDP: {result['bucketed_over_torch_ddp']:.3f} "
        f"(paired per repeat: {result['bucketed_over_torch_ddp_paired_median']:.3f}, "
        f"95% CI {result['bucketed_over_torch_ddp_paired_ci95'][0]:.3f}..{result['bucketed_over_torch_ddp_paired_ci95'][1]:.3f})   "
        f"scaling efficiency: BucketedDDP {result['scaling_efficiency']['bucketed_ddp']:.1%}, "
        f"torch DDP {result['scaling_efficiency']['torch_ddp']:.1%}\n"
        f"buckets of both DDPs (bytes, launch order): {layouts['bucketed_ddp']}\n"
        f"BucketedDDP per optimizer step: {per_step['allreduce_calls']:.0f} all-reduce calls, "
        f"{per_step['allreduce_bytes'] / 2**20:.2f} MiB, communication window {per_step['comm_window_ms']:.2f} ms "
        f"of which exposed {per_step['exposed_comm_ms']:.2f} ms (overlap {comm.overlap or 0:.0%})\n"
        f"wait after the last gradient per optimizer step, same probe for both, mean of both ranks: "
        f"BucketedDDP {exposed_ms['bucketed_ddp']:.2f} ms, torch DDP {exposed_ms['torch_ddp']:.2f} ms"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
