"""The benchmark's models: ``--micro-batch auto``'s choice, and one model, optimizer and loss scaler per mode."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ...ddp import BucketedDDP, DDPSettings
from ...ddp.autotune import AUTO
from ...distributed import DistInfo
from ...training.config import RunSettings, TrainSettings
from ...training.data import DataSettings
from ...training.model.compilation import compile_repeated_blocks
from ...training.model.kernels import apply_liger_to_qwen3
from ...training.model.memory import MicroBatchChoice, Qwen3Shape
from ...training.model.probe import MicroBatchProbe, host_peak_bytes, probe_micro_batch
from ...training.model.qlora import LoraSettings, ModelSettings, load_qlora_model
from ...training.resolve import resolve_micro_batch
from ...training.setup import seed_everything
from ..bench import ComputeSetup


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


def probe_model(args: argparse.Namespace, setup: ComputeSetup, model) -> MicroBatchProbe:
    """``--micro-batch auto`` as the loop decides it (``ddp_ft.training.model.probe``): measured on ``model`` at
    ``--seq-len`` against the GPU's memory or ``--device-memory-gb``; on the CPU by the profiler's memory events."""
    info = setup.info
    device_bytes = int(args.device_memory_gb * 1e9) if args.device_memory_gb is not None else None
    return probe_micro_batch(
        model,
        seq_len=args.seq_len,
        effective_batch=args.effective_batch or 16,
        info=info,
        precision=setup.precision,
        device_bytes=device_bytes,
        measure=None if info.device.type == "cuda" else host_peak_bytes(model),
    )


def build_models(
    args: argparse.Namespace, setup: ComputeSetup, modes: list[str], folder: Path, probe_auto: bool = False
) -> tuple:
    """One model per mode (``--liger`` and ``--compile`` as the plain loop applies them), its AdamW and loss scaler;
    how many blocks ``--compile`` compiled per model; with ``probe_auto`` (``--micro-batch auto``) the probe's
    choice on the first model, unwrapped, alone on the device, whose micro-batch and accumulation the run then
    trains with (else None)."""
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
