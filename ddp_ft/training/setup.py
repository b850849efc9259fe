"""The pieces both entry points (the plain loop's ``run.build_run``, the Trainer recipe) build a run from: every check,
then data, then model.

``check_run_settings`` needs only the settings and the world size and runs before anything is touched;
``prepare_run`` builds tokenizer and data (every data check before the model loads); ``build_model`` loads the
QLoRA model on this rank's device. Neither entry point builds its model any other way.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..ddp.autotune import AUTO
from ..distributed import DistInfo
from ..distributed.launch import check_accelerate_launch
from .batch import gradient_accumulation_steps
from .config import RunSettings
from .data import (
    PackedCollator,
    TruncationReport,
    check_packed_model,
    load_source,
    make_collator,
    packing_problem,
    resolve_packing,
    tokenize_dataset,
)
from .data.tokenizer import build_tiny_tokenizer, check_vocabulary, load_tokenizer
from .defaults import resolve_device_defaults
from .hooks import RunHooks, run_hooks
from .model.compilation import compile_repeated_blocks
from .model.kernels import apply_liger_to_qwen3, check_kernel_settings
from .model.memory import MicroBatchChoice, Qwen3Shape, auto_micro_batch
from .model.probe import MicroBatchProbe, probe_micro_batch
from .model.qlora import EMBEDDED_MODEL, build_tiny_qwen3, check_device_map, load_qlora_model
from .model.source import check_model_source

if TYPE_CHECKING:
    from collections.abc import Callable

    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass
class RunParts:
    """What both entry points (the plain loop, the Trainer recipe) build before the model."""

    accumulation: int  # micro-batches per rank per optimizer step
    device_map: dict[str, int | str] | str  # this rank's ``from_pretrained`` device map
    model_path: str  # a hub id or folder (the embedded default already built)
    tokenizer: PreTrainedTokenizerBase
    train_set: Dataset  # tokenized: input_ids, labels, attention_mask
    eval_set: Dataset
    collate: Callable[[list[dict]], dict[str, torch.Tensor]]  # right padding, or a PackedCollator (``packing``)
    truncation: TruncationReport  # how many training samples had to be cut
    hooks: RunHooks  # a harness's hook point (``ddp_ft.training.hooks``); inert unless one is installed
    packing: bool = False  # ``DataSettings.packing`` resolved: micro-batches packed into rows without padding
    data_record: dict | None = None  # the data settings as resolved (format found, its shape): ``ddp_ft_data.json``
    eval_rows: Dataset | None = None  # the eval split before tokenizing: prompts for ``--predict``

    @property
    def batch_cost(self) -> Callable[[list[int]], int] | None:
        """What a micro-batch of these lengths computes, for the balanced plan: the packed rows', else padded."""
        return self.collate.cost if isinstance(self.collate, PackedCollator) else None


def cache_dir() -> Path:
    """Where the embedded default's tokenizer and model are built (``DDP_FT_CACHE``, else ``~/.cache/ddp_ft``)."""
    return Path(os.environ.get("DDP_FT_CACHE", Path.home() / ".cache" / "ddp_ft"))


def resolve_model_and_tokenizer(model_name_or_path: str, info: DistInfo) -> tuple[str, str]:
    """Hub ids and folders pass through; the embedded default is built here once (local rank 0 builds,
    the others wait), then loaded through ``from_pretrained`` like any hub model."""
    if model_name_or_path != EMBEDDED_MODEL:
        check_model_source(model_name_or_path)  # scripts/train.py and the recipe under their own launchers too
        return model_name_or_path, model_name_or_path
    tokenizer_dir = cache_dir() / "tiny-tokenizer"
    if info.local_rank == 0:
        build_tiny_tokenizer(tokenizer_dir)
    _barrier(info)
    tokenizer = load_tokenizer(str(tokenizer_dir))
    # the tokenizer's special tokens in the model's config, as a hub model has them (else the Trainer aligns and warns)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model_dir = cache_dir() / f"tiny-qwen3-v{len(tokenizer)}-eos{ids['eos_token_id']}-pad{ids['pad_token_id']}"
    if info.local_rank == 0:
        build_tiny_qwen3(model_dir, vocab_size=len(tokenizer), seed=0, token_ids=ids)
    _barrier(info)
    return str(model_dir), str(tokenizer_dir)


def _barrier(info: DistInfo) -> None:
    if info.is_distributed:
        dist.barrier()


def check_run_settings(settings: RunSettings, info: DistInfo) -> tuple[int, dict | str]:
    """The checks that need nothing but the settings and the world size; both entry points run them first.

    The device's defaults are resolved here, in place (``ddp_ft.training.defaults``: ``compile: auto``, and
    ``micro_batch: auto`` off CUDA). On a GPU ``--micro-batch auto`` becomes a first guess (:func:`resolve_micro_batch`,
    or 1 where the arithmetic does not know the model) and ``settings.micro_batch_auto`` tells the entry point to probe
    the built model (:func:`probe_run_micro_batch`). From here on ``settings.train.micro_batch`` is an int and
    ``settings.model.compile`` a bool.

    Returns:
        tuple[int, dict | str]: gradient accumulation steps, and this rank's device map.

    Raises:
        ValueError: ``--micro-batch auto`` without a GPU or that cannot fit, an Accelerate launch setting no entry
            point can honour, ``--liger`` or ``--compile`` where they cannot work (``ddp_ft.training.model.kernels``),
            impossible batch arithmetic, a model-splitting device map under DDP, or a compute dtype this device cannot
            run, each naming the setting to change.
    """
    precision = settings.model.precision(info.device)  # bf16 on a card that only emulates it is refused here
    check_accelerate_launch(chosen=precision.mixed_precision)  # what `accelerate launch` exported, if unhonourable
    resolve_device_defaults(settings, info)  # compile auto; micro-batch auto off CUDA; an impossible --compile refused
    check_kernel_settings(settings.model.liger, False, info.device)  # --liger (--compile: just above, with LoRA's)
    t = settings.train
    if t.micro_batch == AUTO:
        guess = resolve_micro_batch(settings, info)
        t.micro_batch, settings.micro_batch_auto = (guess.micro_batch if guess is not None else 1), True
    accumulation = gradient_accumulation_steps(t.effective_batch, t.micro_batch, info.world_size)
    device_map = settings.model.device_map or {"": info.device.index if info.device.type == "cuda" else "cpu"}
    check_device_map(device_map, info.world_size)
    return accumulation, device_map


def resolve_micro_batch(
    settings: RunSettings, info: DistInfo, shape: Qwen3Shape | None = None, device_bytes: int | None = None
) -> MicroBatchChoice | None:
    """``--micro-batch auto``'s first guess, before the model loads: the largest micro-batch whose expected peak
    fits this rank's GPU by arithmetic, logged on rank 0.

    The entry points then probe the built model (:func:`probe_run_micro_batch`), which decides: the arithmetic
    knows Qwen3 shapes in eager mode only (``--compile`` took 1.84x its expected peak on an H100). It remains the
    guess the data and the resume position are checked with.

    The arithmetic of ``ddp_ft.training.model.memory.auto_micro_batch`` at ``max_seq_len``, with the run's dtype, layout
    and LoRA rank, against the device's total memory (``torch.cuda.mem_get_info``; under a process group the smallest of
    the ranks', so that every rank makes the same choice). The entry points call it on CUDA only (on the CPU ``auto``
    is 1: ``ddp_ft.training.defaults``); a caller on another device must give ``device_bytes``.

    Args:
        settings (RunSettings): the run's settings.
        info (DistInfo): this rank; its device and the world size.
        shape (Qwen3Shape | None): the model's sizes. Default: from the model's ``config.json`` (``AutoConfig``).
        device_bytes (int | None): memory of the device. Default: ``torch.cuda.mem_get_info(info.device)``'s total.

    Returns:
        MicroBatchChoice | None: the guess; None for the embedded tiny model (no ``config.json`` before it is built)
        and for a model whose config is not Qwen3-shaped (the probe decides alone).

    Raises:
        ValueError: off CUDA without ``device_bytes``, or when micro-batch 1 does not fit by the arithmetic; naming
            --micro-batch.
    """
    if device_bytes is None:
        if info.device.type != "cuda":
            raise ValueError(
                f"--micro-batch auto fills a GPU's memory; this run is on {info.device.type}, whose memory is the "
                "host's: give --micro-batch a number (default 1)."
            )
        device_bytes = torch.cuda.mem_get_info(info.device)[1]
        if info.is_distributed and dist.is_initialized():  # every rank chooses for the smallest device: one choice
            smallest = torch.tensor([device_bytes], dtype=torch.int64, device=info.device)
            dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
            device_bytes = int(smallest.item())
    if shape is None:
        name = settings.model.model_name_or_path
        if name == EMBEDDED_MODEL:
            return None
        from transformers import AutoConfig

        try:
            shape = Qwen3Shape.from_config(AutoConfig.from_pretrained(name))
        except AttributeError:  # not a Qwen3-shaped config: no arithmetic for it
            return None
    precision = settings.model.precision(info.device)
    choice = auto_micro_batch(
        shape,
        settings.data.max_seq_len,
        settings.train.effective_batch,
        info.world_size,
        device_bytes,
        compute_dtype=precision.name,
        upcast_frozen_weights=settings.model.upcast_frozen_weights,
        lora_r=settings.lora.lora_r,
        double_quant=settings.model.double_quant,
    )
    if info.is_main_process:
        logger.info("%s", choice.describe())
    return choice


def probe_run_micro_batch(
    model: torch.nn.Module, settings: RunSettings, info: DistInfo, **overrides: object
) -> MicroBatchProbe:
    """``--micro-batch auto``'s decision, on the built model: ``ddp_ft.training.model.probe.probe_micro_batch`` at
    ``max_seq_len`` with the run's autocast, its choice written to ``settings.train.micro_batch`` in place of the first
    guess.

    Call it on every rank, after the model is built as the run trains it (compiled, with Liger) and before
    BucketedDDP wraps it; then take the accumulation from the result (the effective batch is unchanged).

    Args:
        model (torch.nn.Module): the unwrapped model.
        settings (RunSettings): the run's settings; ``train.micro_batch`` is set.
        info (DistInfo): this rank.
        **overrides: passed to ``probe_micro_batch`` (``device_bytes``, ``measure``, ``margin``: tests).

    Raises:
        ValueError: micro-batch 1 does not fit on some rank, naming --micro-batch.
    """
    t = settings.train
    guess = t.micro_batch
    probe = probe_micro_batch(
        model,
        seq_len=settings.data.max_seq_len,
        effective_batch=t.effective_batch,
        info=info,
        precision=settings.model.precision(info.device),
        **overrides,
    )
    if info.is_main_process and probe.micro_batch != guess:
        logger.info("--micro-batch auto: the probe's %d replaces the first guess %d", probe.micro_batch, guess)
    t.micro_batch = probe.micro_batch
    return probe


def prepare_run(settings: RunSettings, info: DistInfo, checked: tuple[int, dict | str] | None = None) -> RunParts:
    """Check the settings against the world size, then build tokenizer and data; every check before the model.

    Args:
        settings (RunSettings): the run's settings.
        info (DistInfo): this rank.
        checked (tuple | None): what :func:`check_run_settings` returned, where the caller ran it first (the plain
            loop's ``build_run``). Default: it runs here.

    Raises:
        ValueError: impossible batch arithmetic, a model-splitting device map under DDP, bad data, or fewer
            training samples than one effective batch, each naming the setting to change.
    """
    t = settings.train
    accumulation, device_map = checked or check_run_settings(settings, info)
    model_path, tokenizer_path = resolve_model_and_tokenizer(settings.model.model_name_or_path, info)
    tokenizer = load_tokenizer(tokenizer_path, settings.data.chat_template)
    raw = load_source(settings.data)
    train_set, truncation = tokenize_dataset(raw.splits["train"], tokenizer, settings.data)
    eval_set, _ = tokenize_dataset(raw.splits["eval"], tokenizer, settings.data)
    if info.is_main_process and truncation.advice():  # the synthetic meetings are cut on purpose: a short CPU run
        level = logging.INFO if settings.data.source_kind == "synthetic" else logging.WARNING
        logger.log(level, "%s", truncation.advice())
    if len(train_set) < t.effective_batch:
        least = t.micro_batch * info.world_size  # the smallest effective batch this world size can train
        if len(train_set) < least:
            fix = (
                f"fewer than the {least} one micro-batch on each of world_size={info.world_size} ranks needs: run "
                "fewer processes, lower --micro-batch, or use more data"
            )
        else:
            fix = "lower --effective-batch or use more data"
        raise ValueError(
            f"the training set has {len(train_set)} samples, fewer than one effective batch "
            f"(effective_batch={t.effective_batch}): {fix}."
        )
    if t.predict and len(raw.splits["eval"]) == 0:
        raise ValueError(
            f"--predict {t.predict} generates for eval samples, and this run holds none out: give --eval-source, "
            "an --eval-fraction above 0, or a source with a validation split; or drop --predict."
        )
    packing = choose_packing(settings, info, model_path)
    collate = PackedCollator(tokenizer.pad_token_id, settings.data.max_seq_len) if packing else make_collator(tokenizer)
    return RunParts(
        accumulation=accumulation,
        device_map=device_map,
        model_path=model_path,
        tokenizer=tokenizer,
        train_set=train_set,
        eval_set=eval_set,
        collate=collate,
        truncation=truncation,
        hooks=run_hooks(),
        packing=packing,
        data_record=raw.record(settings.data),
        eval_rows=raw.splits["eval"],
    )


def choose_packing(settings: RunSettings, info: DistInfo, model_path: str) -> bool:
    """``--packing`` resolved for this device and model (``ddp_ft.training.data.resolve_packing``) in place, logged on
    rank 0.

    The model's config is read (not the model) only when packing may be on, to find an architecture whose attention
    would mix packed sequences before anything loads; ``build_model`` checks the loaded model again.

    Raises:
        ValueError: ``--packing true`` for a model whose attention would let a sequence attend to its neighbour.
    """
    packing = settings.data.packing
    problem = None
    if packing is True or (packing == AUTO and info.device.type == "cuda"):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path)
        config.use_cache = False  # as load_qlora_model sets it: the cache is the loaded model's check
        problem = packing_problem(config)
    chosen, reason = resolve_packing(packing, info.device.type, problem)
    if info.is_main_process:
        logger.info("packing %s (%s)", "on" if chosen else "off", reason)
    settings.data.packing = chosen  # resolved in place, as compile and micro_batch: run_config.yaml says what ran
    return chosen


def build_model(settings: RunSettings, info: DistInfo, parts: RunParts) -> torch.nn.Module:
    """The QLoRA model on this rank's device, seeded by ``settings.train.seed``, checked against the tokenizer."""
    seed_everything(settings.train.seed)
    model_settings = type(settings.model)(**{**asdict(settings.model), "model_name_or_path": parts.model_path})
    model = load_qlora_model(model_settings, settings.lora, parts.device_map, info.world_size)
    check_vocabulary(parts.tokenizer, model.get_input_embeddings().num_embeddings)
    if parts.packing:  # the attention implementation is known now: refuse one that would mix packed sequences
        check_packed_model(model)
    parts.hooks.attach(model)
    return model


def build_training_model(
    settings: RunSettings, info: DistInfo, parts: RunParts
) -> tuple[torch.nn.Module, MicroBatchProbe | None]:
    """The plain loop's model as it will train, before any wrap: Liger's patch before the build (where refused, it was
    in ``check_run_settings``), the QLoRA model (:func:`build_model`), its decoder layers compiled in place
    (``ddp_ft.training.model.compilation``: names, checkpoints and the overlap unchanged), and with ``--micro-batch
    auto`` the probe's choice measured on it (:func:`probe_run_micro_batch`; unwrapped, so nothing is communicated).

    Returns:
        tuple: the model, and the probe's result (None without ``--micro-batch auto``).
    """
    if settings.model.liger:
        apply_liger_to_qwen3(parts.model_path)
    model = build_model(settings, info, parts)
    if settings.model.compile:
        compile_repeated_blocks(model)
    probe = probe_run_micro_batch(model, settings, info) if settings.micro_batch_auto else None
    return model, probe


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (the LoRA initialisation draws from torch's)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
