"""The first thing to run on a CUDA host (``make gpu-check``): do BucketedDDP, the 4-bit stack and the dtype choice
work on these GPUs, and what does a short QLoRA run cost?

One process, then two when there are two GPUs or more (on ``--device cpu``: gloo, always two), each a fresh group of
spawned processes on their own devices, exactly as torchrun would lay them out. Every process runs:

- ``dtype``: the compute dtype ``precision_for`` picks for its device, and why; bfloat16 never below compute
  capability 8.0, where ``torch.cuda.is_bf16_supported()`` can still say True (emulation).
- ``grads_equal_torch_ddp``: BucketedDDP and ``torch.nn.parallel.DistributedDataParallel`` wrap the same QLoRA model
  (embedded tiny Qwen3, NF4, LoRA, non-reentrant checkpointing) and see the same data: one micro-step under
  ``no_sync`` and one synced; every trainable gradient finite, non-zero and equal to torch DDP's within the tolerance
  of the compute dtype (the project's tests ask bitwise equality on CPU/gloo; GPU kernels such as the attention
  backward need not be deterministic between two model copies), and identical on all ranks.
- ``no_sync``: the backward under ``no_sync`` launched no all-reduce (BucketedDDP's counters) and, with two ranks,
  left different gradients on them (nothing was averaged behind the counters' back); the synced one launched one
  all-reduce per bucket.
- ``qlora_run``: a short run with the project's defaults (LoRA r=16, AdamW, gradient accumulation under
  ``no_sync``, the loss scaler in float16): tokens/s, step time, peak memory (CUDA allocator: allocated and
  reserved; CPU: peak RSS) and BucketedDDP's exposed communication per step. It fails on a non-finite loss, on a
  float16 run whose scaler skipped every step, or on a wrong number of all-reduces per step.

Rank 0 gathers every rank's checks; the orchestrating process prints a PASS/FAIL table, writes the JSON, and its exit
status is non-zero on any failure, a crashed rank or a phase past its timeout.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from .bench import compute_setup, synchronize
from .ddp import BucketedDDP
from .distributed import DEVICE_CHOICES, destroy_distributed, device_and_backend
from .precision import BF16_MIN_CAPABILITY, DTYPES

INJECT_ENV = "DDP_FT_GPU_CHECK_INJECT"  # test-only: "grad" perturbs one BucketedDDP gradient on the last rank
# Tolerance of BucketedDDP's gradients against torch DDP's (rtol, atol as a fraction of the largest gradient): the
# project's global-batch tolerances (tests/test_qlora_ddp.py); a wrong reduction is off by 50% or more.
GRAD_TOL = {"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 1e-2), "float16": (1e-2, 5e-3)}
COMPARE_CAPS_MB = (0.05, 0.01)  # bucket cap, first bucket cap: several buckets even on the tiny model
COMPARE_BATCH = (2, 64)  # samples, tokens per sample, per rank and micro-step


@dataclass
class GpuCheckSettings:
    """What ``scripts/gpu_check.py`` runs."""

    device: str = field(default="auto", metadata={"help": "auto (cuda when available), cuda (NCCL) or cpu (gloo)."})
    compute_dtype: str = field(
        default="auto", metadata={"help": "auto (bfloat16 from compute capability 8.0, float16 below), or a dtype."}
    )
    world_sizes: list[int] = field(
        default_factory=list,
        metadata={"help": "Process counts to run, in order. Default: 1, then 2 with 2+ GPUs (always 2 on cpu)."},
    )
    seq_len: int = field(default=512, metadata={"help": "Tokens per sample in the QLoRA run."})
    micro_batch: int = field(default=4, metadata={"help": "Samples per micro-step per process in the QLoRA run."})
    grad_accum: int = field(default=2, metadata={"help": "Micro-steps per optimizer step (all but the last no_sync)."})
    warmup_steps: int = field(default=2, metadata={"help": "Untimed optimizer steps before the timed ones."})
    steps: int = field(default=10, metadata={"help": "Timed optimizer steps of the QLoRA run."})
    timeout_s: float = field(default=240.0, metadata={"help": "Seconds one phase (one process count) may take."})

    def __post_init__(self) -> None:
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"device={self.device!r}: choose one of {', '.join(DEVICE_CHOICES)}.")
        if self.compute_dtype != "auto" and self.compute_dtype not in DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r}: choose auto or one of {sorted(DTYPES)}.")
        for name in ("seq_len", "micro_batch", "grad_accum", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1.")
        if self.warmup_steps < 0 or self.timeout_s <= 0 or any(w < 1 for w in self.world_sizes):
            raise ValueError("warmup_steps must be >= 0, timeout_s > 0 and every world size >= 1.")


@dataclass
class Check:
    """One row of the table: a named check of one process count, and why it passed or failed."""

    name: str
    passed: bool
    detail: str
    values: dict = field(default_factory=dict)


def plan_world_sizes(device_type: str, gpu_count: int, requested: list[int]) -> list[int]:
    """The process counts to run: ``requested``, or 1 then 2 where two devices exist (the CPU always has two).

    Raises:
        ValueError: more processes than GPUs, naming the count and the fix.
    """
    sizes = requested or ([1, 2] if device_type == "cpu" or gpu_count >= 2 else [1])
    if device_type == "cuda" and max(sizes) > gpu_count:
        raise ValueError(
            f"{max(sizes)} processes but {gpu_count} GPU(s) visible: one process per GPU; pass "
            f"--world-sizes with at most {gpu_count}, or --device cpu."
        )
    return sizes


def check_dtype(precision, requested: str, capability: tuple[int, int] | None, bf16_reported: bool | None) -> Check:
    """The dtype ``precision_for`` picked, held to the rule: bfloat16 only on compute capability >= 8.0."""
    old_gpu = capability is not None and tuple(capability) < BF16_MIN_CAPABILITY
    if requested == "auto":
        expected = torch.float32 if capability is None else torch.float16 if old_gpu else torch.bfloat16
    else:
        expected = precision.dtype
    passed = precision.dtype == expected and not (old_gpu and precision.dtype == torch.bfloat16)
    passed &= precision.loss_scaling == (precision.dtype == torch.float16)
    detail = f"{precision.name} ({precision.reason})"
    if capability is not None:
        emulated = " (emulated: not used)" if old_gpu and bf16_reported else ""
        detail += f"; compute capability {capability[0]}.{capability[1]}, is_bf16_supported()={bf16_reported}{emulated}"
    if precision.loss_scaling:
        detail += "; trained with a loss scaler"
    values = {"dtype": precision.name, "capability": capability, "is_bf16_supported": bf16_reported}
    return Check("dtype", passed, detail, values)


# ---------------------------------------------------------------------------------------------- one process's checks


def _gather_flat(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


def _build(model_path: str, setup, lora_dropout: float):
    from .model import LoraSettings, ModelSettings, load_qlora_model  # transformers and peft: in the workers only

    torch.manual_seed(0)
    settings = ModelSettings(model_name_or_path=model_path, compute_dtype=setup.precision.name)
    lora = LoraSettings(lora_dropout=lora_dropout)
    return load_qlora_model(settings, lora, setup.device_map, setup.info.world_size).train()


def _batch(seed: int, vocab: int, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=g).to(device)


def compare_with_torch_ddp(setup, model_path: str, inject: bool = False) -> list[Check]:
    """``grads_equal_torch_ddp`` and ``no_sync``: both DDPs, one no_sync micro-step and one synced."""
    info, precision = setup.info, setup.precision
    models = []
    for _ in range(2):
        model = _build(model_path, setup, lora_dropout=0.0)  # dropout would draw different masks in the two copies
        with torch.no_grad():  # LoRA B starts at zero, which would leave every lora_A gradient zero
            g = torch.Generator().manual_seed(1)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        models.append(model)
    cap, first_cap = COMPARE_CAPS_MB
    ours = BucketedDDP(models[0], bucket_cap_mb=cap, first_bucket_cap_mb=first_cap)
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    theirs = TorchDDP(models[1], device_ids=device_ids, bucket_cap_mb=cap)
    vocab = models[0].get_input_embeddings().num_embeddings
    trainable = [n for n, p in ours.module.named_parameters() if p.requires_grad]

    # float16 backward runs on a scaled loss, as under the loss scaler, so that small gradients do not flush to zero
    loss_scale = 2.0**8 if precision.loss_scaling else 1.0
    quiet, differ = None, None
    for micro, sync in enumerate((False, True)):
        ids = _batch(1000 * info.rank + micro, vocab, COMPARE_BATCH, info.device)
        for model in (ours, theirs):
            with nullcontext() if sync else model.no_sync():
                with precision.autocast_context():
                    loss = model(input_ids=ids, labels=ids).loss
                (loss * loss_scale).backward()
        if not sync:
            quiet = ours.last_comm_stats()
            if info.world_size > 1:
                copies = _gather_flat([p.grad for p in ours.module.parameters() if p.requires_grad])
                differ = not torch.equal(copies[0], copies[1])
    step = ours.pop_comm_stats()
    ours_grads = [p.grad for p in ours.module.parameters() if p.requires_grad]
    theirs_grads = [p.grad for p in theirs.module.parameters() if p.requires_grad]
    if inject and info.rank == info.world_size - 1:
        ours_grads[0].add_(ours_grads[0].abs().max())

    rtol, atol_fraction = GRAD_TOL[precision.name]
    worst, worst_name, bitwise, problems = 0.0, "", True, []
    for name, g_ours, g_theirs in zip(trainable, ours_grads, theirs_grads, strict=True):
        if not torch.isfinite(g_ours).all() or torch.count_nonzero(g_ours) == 0:
            problems.append(f"{name} is {'not finite' if not torch.isfinite(g_ours).all() else 'zero'}")
            continue
        diff = (g_ours.float() - g_theirs.float()).abs()
        scale = g_theirs.abs().max().item()
        bitwise &= torch.equal(g_ours, g_theirs)
        excess = (diff - rtol * g_theirs.float().abs()).max().item() / max(scale, 1e-30)
        if excess > worst:
            worst, worst_name = excess, name
        if excess > atol_fraction:
            problems.append(f"{name} differs from torch DDP by {diff.max().item():.3g} (largest gradient {scale:.3g})")
    same_on_ranks = True
    if info.world_size > 1:
        copies = _gather_flat(ours_grads)
        same_on_ranks = all(torch.equal(copies[0], c) for c in copies[1:])
        if not same_on_ranks:
            problems.append("BucketedDDP's gradients differ across ranks after the synced backward")
    buckets = len(ours.bucket_sizes)
    ours.remove_hooks()
    equal = "bitwise equal" if bitwise else f"within rtol {rtol:g}, atol {atol_fraction:g} x the largest gradient"
    ranks = ", identical on all ranks" if info.world_size > 1 and same_on_ranks else ""
    values = {
        "tensors": len(trainable),
        "buckets": buckets,
        "bitwise_equal": bitwise,
        "same_on_all_ranks": same_on_ranks,
        "worst_excess_over_largest": worst,
        "worst_tensor": worst_name,
    }
    detail = f"{len(trainable)} LoRA tensors in {buckets} buckets, {precision.name}: {equal}{ranks}"
    grads = Check("grads_equal_torch_ddp", not problems, "; ".join(problems[:3]) or detail, values)

    silent = quiet.allreduce_calls == 0 and quiet.allreduce_bytes == 0
    one_per_bucket = step.allreduce_calls == buckets and step.synced_backwards == 1 and step.backwards == 2
    spread = {True: ", gradients differ across ranks", False: ", GRADIENTS EQUAL ACROSS RANKS", None: ""}[differ]
    detail = (
        f"no_sync backward: {quiet.allreduce_calls} all-reduces, {quiet.allreduce_bytes} bytes{spread}; "
        f"synced backward: {step.allreduce_calls} all-reduces for {buckets} buckets"
    )
    values = {
        "no_sync_allreduce_calls": quiet.allreduce_calls,
        "no_sync_allreduce_bytes": quiet.allreduce_bytes,
        "grads_differ_across_ranks": differ,
        "step_allreduce_calls": step.allreduce_calls,
        "buckets": buckets,
    }
    return [grads, Check("no_sync", silent and one_per_bucket and differ is not False, detail, values)]


def _peak_memory(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "peak_allocated_gb": torch.cuda.max_memory_allocated(device) / 1e9,
            "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9,
        }
    return {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}


def qlora_run(setup, model_path: str, settings: GpuCheckSettings) -> Check:
    """A short QLoRA run with the project's defaults under BucketedDDP: throughput, memory, exposed communication."""
    info, precision = setup.info, setup.precision
    gc.collect()  # the comparison's models go, and on CUDA their cached blocks, so peak reserved is this run's own
    if info.device.type == "cuda":
        torch.cuda.empty_cache()
    model = BucketedDDP(_build(model_path, setup, lora_dropout=0.05))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    scaler = precision.grad_scaler()
    vocab = model.module.get_input_embeddings().num_embeddings
    shape = (settings.micro_batch, settings.seq_len)
    batches = [_batch(1000 * info.rank + i, vocab, shape, info.device) for i in range(4)]
    losses, skipped = [], 0

    def step(index: int) -> None:
        nonlocal skipped
        for micro in range(settings.grad_accum):
            ids = batches[(index * settings.grad_accum + micro) % len(batches)]
            last = micro == settings.grad_accum - 1
            with nullcontext() if last else model.no_sync():
                with precision.autocast_context():
                    loss = model(input_ids=ids, labels=ids).loss / settings.grad_accum
                scaler.scale(loss).backward()
            losses.append(loss.detach())
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.is_enabled() and scaler.get_scale() < scale  # the scale drops exactly when a step is skipped
        optimizer.zero_grad(set_to_none=True)

    for i in range(settings.warmup_steps):
        step(i)
    model.pop_comm_stats()
    skipped, losses = 0, []
    synchronize(info.device)
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)
    dist.barrier()
    start = time.perf_counter()
    for i in range(settings.steps):
        step(settings.warmup_steps + i)
    synchronize(info.device)  # the GPU's work is done, not only queued
    elapsed = torch.tensor(time.perf_counter() - start, device=info.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    comm = model.pop_comm_stats()
    memory = _peak_memory(info.device)
    loss_values = torch.stack(losses).float().cpu() * settings.grad_accum
    tokens = info.world_size * settings.steps * settings.grad_accum * settings.micro_batch * settings.seq_len
    values = {
        "tokens_per_s": tokens / elapsed.item(),
        "tokens_per_s_per_device": tokens / elapsed.item() / info.world_size,
        "step_time_s": elapsed.item() / settings.steps,
        **memory,
        "exposed_comm_ms_per_step": comm.exposed_comm_ms / settings.steps,
        "overlap": comm.overlap,
        "allreduce_calls_per_step": comm.allreduce_calls / settings.steps,
        "allreduce_mb_per_step": comm.allreduce_bytes / settings.steps / 2**20,
        "buckets": len(model.bucket_sizes),
        "loss_first": loss_values[0].item(),
        "loss_last": loss_values[-1].item(),
        "skipped_steps": int(skipped),
        "tokens_per_step": tokens // settings.steps,
    }
    problems = []
    if not torch.isfinite(loss_values).all():
        problems.append("non-finite loss")
    if scaler.is_enabled() and skipped == settings.steps:
        problems.append(f"the float16 loss scaler skipped all {settings.steps} steps")
    if comm.allreduce_calls != len(model.bucket_sizes) * settings.steps:
        problems.append(
            f"{comm.allreduce_calls} all-reduces in {settings.steps} steps of {len(model.bucket_sizes)} buckets"
        )
    memory_text = (
        f"peak {memory['peak_allocated_gb']:.2f} GB allocated / {memory['peak_reserved_gb']:.2f} reserved"
        if "peak_allocated_gb" in memory
        else f"peak RSS {memory['peak_rss_gb']:.2f} GB"
    )
    detail = (
        f"{values['tokens_per_s']:,.0f} tokens/s, {values['step_time_s'] * 1e3:.0f} ms/step, {memory_text}, "
        f"exposed comm {values['exposed_comm_ms_per_step']:.2f} ms/step, loss {values['loss_first']:.3f} -> "
        f"{values['loss_last']:.3f}"
    )
    model.remove_hooks()
    return Check("qlora_run", not problems, "; ".join(problems) or detail, values)


def run_checks(settings: GpuCheckSettings, setup) -> list[Check]:
    """Every check on this process (collectives inside: all ranks call it)."""
    from .loop import resolve_model_and_tokenizer
    from .model import EMBEDDED_MODEL

    info = setup.info
    capability, bf16 = None, None
    if info.device.type == "cuda":
        capability = torch.cuda.get_device_capability(info.device)
        bf16 = torch.cuda.is_bf16_supported()
    checks = [check_dtype(setup.precision, settings.compute_dtype, capability, bf16)]
    model_path, _ = resolve_model_and_tokenizer(EMBEDDED_MODEL, info)
    checks += compare_with_torch_ddp(setup, model_path, inject=os.environ.get(INJECT_ENV) == "grad")
    checks.append(qlora_run(setup, model_path, settings))
    return checks


def _worker(rank: int, world_size: int, settings: GpuCheckSettings, port: int, out_dir: str) -> None:
    """One spawned process: join the group the orchestrator's store hosts, run the checks, rank 0 writes them."""
    env = {
        "RANK": rank,
        "LOCAL_RANK": rank,
        "WORLD_SIZE": world_size,
        "LOCAL_WORLD_SIZE": world_size,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "TORCHELASTIC_USE_AGENT_STORE": True,
    }
    os.environ.update({k: str(v) for k, v in env.items()})
    if Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host
    try:
        setup = compute_setup(settings.device, settings.compute_dtype, timeout_s=settings.timeout_s)
        if setup.info.device.type == "cpu":
            torch.set_num_threads(1)  # one thread per process: the CPU analogue of one GPU per process
        if world_size == 1:  # init_distributed makes no group for one process; both DDPs need one
            device_id = {"device_id": setup.info.device} if setup.info.device.type == "cuda" else {}
            dist.init_process_group(
                setup.backend,
                store=dist.HashStore(),
                rank=0,
                world_size=1,
                timeout=timedelta(seconds=settings.timeout_s),
                **device_id,
            )
        checks = run_checks(settings, setup)
        every_rank: list = [None] * world_size
        dist.all_gather_object(every_rank, [asdict(c) for c in checks])
        if rank == 0:
            result = {
                "world_size": world_size,
                "setup": setup.describe(),
                "device": setup.info.device.type,
                "backend": setup.backend,
                "compute_dtype": setup.precision.name,
                "checks": merge_ranks(every_rank),
            }
            Path(out_dir, "result.json").write_text(json.dumps(result))
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        destroy_distributed()
    # Done and written: leave without interpreter finalization, as tests/dist_harness.py does. A gloo thread can
    # release a collective's callback while the interpreter shuts down and abort the process ("terminate called
    # without an active exception", seen here once in a few runs), which would turn a finished check into a crash.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def merge_ranks(every_rank: list[list[dict]]) -> list[dict]:
    """One row per check: passed on every rank; a failing rank's detail, else rank 0's; rank 0's values."""
    merged = []
    for rows in zip(*every_rank, strict=True):
        failing = [(r, row) for r, row in enumerate(rows) if not row["passed"]]
        detail = "; ".join(f"rank {r}: {row['detail']}" for r, row in failing) if failing else rows[0]["detail"]
        merged.append({**rows[0], "passed": not failing, "detail": detail})
    return merged


# ------------------------------------------------------------------------------------------------ the orchestrator


def run_phase(world_size: int, settings: GpuCheckSettings) -> dict:
    """Spawn ``world_size`` processes that run every check; their merged result, or an ``error`` row.

    The processes rendezvous on a TCPStore this process hosts on a port the OS chose, as torchrun's agent does
    (``TORCHELASTIC_USE_AGENT_STORE``): no port to collide on.
    """
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=settings.timeout_s)
    )
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            _worker, args=(world_size, settings, store.port, tmp), nprocs=world_size, join=False, start_method="spawn"
        )
        started = time.monotonic()
        deadline = started + settings.timeout_s
        error = None
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    error = f"did not finish within {settings.timeout_s:.0f} s"
                    break
        except mp.ProcessExitedException as crash:
            error = str(crash)  # a crash without a traceback (a signal); replaced below by a rank's traceback if any
            time.sleep(1.0)  # let a peer that raised write its traceback; the others die of the lost peer
        except mp.ProcessRaisedException:
            pass
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
        raised = sorted(Path(tmp).glob("rank*.err"))
        result_file = Path(tmp, "result.json")
        if error is None and not raised and result_file.exists():
            return {**json.loads(result_file.read_text()), "seconds": time.monotonic() - started}
        if raised:
            error = " | ".join(f"{p.stem}: {p.read_text().strip().splitlines()[-1]}" for p in raised)
        return {
            "world_size": world_size,
            "error": error or "a process exited without a result",
            "traceback": "\n".join(f"--- {p.stem}:\n{p.read_text()}" for p in raised),
        }


def run_gpu_check(settings: GpuCheckSettings) -> dict:
    """Every phase, in order; the report that the table and the JSON show. ``report["passed"]`` is the verdict."""
    device_type, backend = device_and_backend(settings.device, torch.cuda.is_available())
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if device_type == "cuda" else []
    sizes = plan_world_sizes(device_type, len(gpus), settings.world_sizes)
    started = time.monotonic()
    phases = [run_phase(w, settings) for w in sizes]
    runs = {p["world_size"]: c["values"] for p in phases for c in p.get("checks", []) if c["name"] == "qlora_run"}
    report = {
        "passed": all("error" not in p and all(c["passed"] for c in p["checks"]) for p in phases),
        "device": device_type,
        "backend": backend,
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "settings": asdict(settings),
        "phases": phases,
        "runs": runs,
        "seconds": time.monotonic() - started,
    }
    if 1 in runs and 2 in runs:
        report["scaling_efficiency_2"] = runs[2]["tokens_per_s"] / (2 * runs[1]["tokens_per_s"])
    return report


def format_report(report: dict) -> str:
    """The PASS/FAIL table, the run's numbers, and the verdict."""
    hardware = ", ".join(report["gpus"]) or "CPU"
    lines = [f"gpu_check: torch {report['torch']} (CUDA {report['cuda']}), {hardware}"]
    for phase in report["phases"]:
        if "setup" in phase:
            lines.append(f"  {phase['world_size']} process(es): {phase['setup']}")
    lines += ["", "| processes | check | result | detail |", "|---:|---|---|---|"]
    for phase in report["phases"]:
        rows = phase.get("checks") or [{"name": "(phase)", "passed": False, "detail": phase.get("error", "")}]
        for c in rows:
            detail = c["detail"].replace("|", "/")
            lines.append(f"| {phase['world_size']} | {c['name']} | {'PASS' if c['passed'] else 'FAIL'} | {detail} |")
    if report["runs"]:
        lines += [
            "",
            "| processes | tokens/s | tokens/s per device | step ms | peak memory GB | exposed comm ms/step |"
            " all-reduces/step |",
            "|---:|---:|---:|---:|---|---:|---:|",
        ]
        for world, r in report["runs"].items():
            memory = (
                f"{r['peak_allocated_gb']:.2f} allocated / {r['peak_reserved_gb']:.2f} reserved"
                if "peak_allocated_gb" in r
                else f"{r['peak_rss_gb']:.2f} RSS"
            )
            lines.append(
                f"| {world} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_device']:,.0f} | "
                f"{r['step_time_s'] * 1e3:.1f} | {memory} | {r['exposed_comm_ms_per_step']:.2f} | "
                f"{r['allreduce_calls_per_step']:.0f} |"
            )
    if "scaling_efficiency_2" in report:
        lines.append(
            f"scaling efficiency, 2 processes: {report['scaling_efficiency_2']:.1%} (tiny model: launch- "
            "and communication-bound, not Qwen3-4B's)"
        )
    failed = sum(not c["passed"] for p in report["phases"] for c in p.get("checks", [])) + sum(
        "error" in p for p in report["phases"]
    )
    verdict = "PASS" if report["passed"] else f"FAIL ({failed} failed)"
    lines.append(f"\n{verdict} in {report['seconds']:.0f} s")
    return "\n".join(lines)
