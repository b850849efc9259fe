"""The checks one process runs, every rank alike (collectives inside): ``dtype`` (:func:`check_dtype`, pure),
``grads_equal_torch_ddp`` and ``no_sync`` (:func:`compare_with_torch_ddp`), ``qlora_run`` (:func:`qlora_run`);
:func:`run_checks` runs them all.
"""

from __future__ import annotations

import gc
import os
import resource
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ...ddp import BucketedDDP
from ...training.model.precision import BF16_MIN_CAPABILITY
from ..bench import synchronize
from .settings import Check, GpuCheckSettings

INJECT_ENV = "DDP_FT_GPU_CHECK_INJECT"  # test-only: "grad" perturbs one BucketedDDP gradient on the last rank
# Tolerance of BucketedDDP's gradients against torch DDP's (rtol, atol as a fraction of the largest gradient): the
# project's global-batch tolerances (tests/ddp/test_qlora_stack.py); a wrong reduction is off by 50% or more.
GRAD_TOL = {"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 1e-2), "float16": (1e-2, 5e-3)}
COMPARE_CAPS_MB = (0.05, 0.01)  # bucket cap, first bucket cap: several buckets even on the tiny model
COMPARE_BATCH = (2, 64)  # samples, tokens per sample, per rank and micro-step


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


def _gather_flat(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


def _build(model_path: str, setup, lora_dropout: float):
    from ...training.model.qlora import (  # transformers and peft: in the workers only
        LoraSettings,
        ModelSettings,
        load_qlora_model,
    )

    torch.manual_seed(0)
    settings = ModelSettings(model_name_or_path=model_path, compute_dtype=setup.precision.name)
    lora = LoraSettings(lora_dropout=lora_dropout)
    return load_qlora_model(settings, lora, setup.device_map, setup.info.world_size).train()


def _batch(seed: int, vocab: int, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=g).to(device)


def _model_pair(model_path: str, setup) -> list:
    """Two identical LoRA models with non-zero ``lora_B`` (at zero, every lora_A gradient would be zero)."""
    models = []
    for _ in range(2):
        model = _build(model_path, setup, lora_dropout=0.0)  # dropout would draw different masks in the two copies
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        models.append(model)
    return models


def compare_with_torch_ddp(setup, model_path: str, inject: bool = False) -> list[Check]:
    """``grads_equal_torch_ddp`` and ``no_sync``: both DDPs, one no_sync micro-step and one synced."""
    info, precision = setup.info, setup.precision
    models = _model_pair(model_path, setup)
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
    buckets = len(ours.bucket_sizes)
    grads = _grads_check(trainable, ours_grads, theirs_grads, buckets, info, precision)
    ours.remove_hooks()
    return [grads, _no_sync_check(quiet, step, buckets, differ)]


def _grads_check(trainable: list[str], ours_grads, theirs_grads, buckets: int, info, precision) -> Check:
    """``grads_equal_torch_ddp``: BucketedDDP's gradients against torch DDP's, tensor by tensor, and across ranks."""
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
    return Check("grads_equal_torch_ddp", not problems, "; ".join(problems[:3]) or detail, values)


def _no_sync_check(quiet, step, buckets: int, differ: bool | None) -> Check:
    """``no_sync``: no all-reduce in the no_sync backward (``quiet``), one per bucket in the synced one (``step``)."""
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
    return Check("no_sync", silent and one_per_bucket and differ is not False, detail, values)


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
    model.remove_hooks()
    return _qlora_check(values, memory, loss_values, scaler.is_enabled(), comm.allreduce_calls, settings.steps)


def _qlora_check(values: dict, memory: dict, loss_values, scaled: bool, allreduce_calls: int, steps: int) -> Check:
    """``qlora_run``'s verdict: finite losses, not every step skipped by the loss scaler, one all-reduce per bucket."""
    problems = []
    if not torch.isfinite(loss_values).all():
        problems.append("non-finite loss")
    if scaled and values["skipped_steps"] == steps:
        problems.append(f"the float16 loss scaler skipped all {steps} steps")
    if allreduce_calls != values["buckets"] * steps:
        problems.append(f"{allreduce_calls} all-reduces in {steps} steps of {values['buckets']} buckets")
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
    return Check("qlora_run", not problems, "; ".join(problems) or detail, values)


def run_checks(settings: GpuCheckSettings, setup) -> list[Check]:
    """Every check on this process (collectives inside: all ranks call it)."""
    from ...training.model.qlora import EMBEDDED_MODEL
    from ...training.setup import resolve_model_and_tokenizer

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
