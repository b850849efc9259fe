"""The pieces both entry points (the plain loop's ``run.build_run``, the Trainer recipe) build a run from: every check,
then data, then model.

``ddp_ft.training.resolve.resolve_run`` needs only the settings and the world size and runs before anything is
touched; ``prepare_run`` builds tokenizer and data (every data check before the model loads); ``build_model`` loads the
QLoRA model on this rank's device. Neither entry point builds its model any other way.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..distributed import DistInfo
from .config import RunSettings
from .data import (
    PackedCollator,
    TruncationReport,
    check_packed_model,
    load_source,
    make_collator,
    tokenize_dataset,
)
from .data.tokenizer import build_tiny_tokenizer, check_vocabulary, load_tokenizer
from .hooks import RunHooks, run_hooks
from .model.attention import resolve_attention
from .model.compilation import compile_repeated_blocks
from .model.kernels import apply_liger_to_qwen3
from .model.qlora import EMBEDDED_MODEL, build_tiny_qwen3, load_qlora_model
from .model.source import check_model_source
from .resolve import Resolved, probe_run_micro_batch, resolve_run, resolve_run_packing

if TYPE_CHECKING:
    from collections.abc import Callable

    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass
class RunParts:
    """What both entry points (the plain loop, the Trainer recipe) build before the model."""

    resolved: Resolved  # micro-batch, accumulation, compile, packing, precision, device map: what the run trains with
    model_path: str  # a hub id or folder (the embedded default already built)
    tokenizer: PreTrainedTokenizerBase
    train_set: Dataset  # tokenized: input_ids, labels, attention_mask
    eval_set: Dataset
    collate: Callable[[list[dict]], dict[str, torch.Tensor]]  # right padding, or a PackedCollator (packing on)
    truncation: TruncationReport  # how many training samples had to be cut
    hooks: RunHooks  # a harness's hook point (``ddp_ft.training.hooks``); inert unless one is installed
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


def prepare_run(settings: RunSettings, info: DistInfo, resolved: Resolved | None = None) -> RunParts:
    """Check the settings against the world size, then build tokenizer and data; every check before the model.

    Args:
        settings (RunSettings): the run's settings.
        info (DistInfo): this rank.
        resolved (Resolved | None): what ``resolve_run`` returned, where the caller ran it first (the plain loop's
            ``build_run``). Default: it runs here. Packing is resolved here, once the model's config is at hand.

    Raises:
        ValueError: impossible batch arithmetic, a model-splitting device map under DDP, bad data, or fewer
            training samples than one effective batch, each naming the setting to change.
    """
    t = settings.train
    resolved = resolved or resolve_run(settings, info)
    model_path, tokenizer_path = resolve_model_and_tokenizer(settings.model.model_name_or_path, info)
    tokenizer = load_tokenizer(tokenizer_path, settings.data.chat_template)
    raw = load_source(settings.data)
    train_set, truncation = tokenize_dataset(raw.splits["train"], tokenizer, settings.data)
    eval_set, _ = tokenize_dataset(raw.splits["eval"], tokenizer, settings.data)
    if info.is_main_process and truncation.advice():  # the synthetic meetings are cut on purpose: a short CPU run
        level = logging.INFO if settings.data.source_kind == "synthetic" else logging.WARNING
        logger.log(level, "%s", truncation.advice())
    if len(train_set) < t.effective_batch:
        least = resolved.micro_batch * info.world_size  # the smallest effective batch this world size can train
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
    resolved = resolve_run_packing(resolved, settings, info, model_path)
    packed = resolved.packing
    lengths = [len(ids) for ids in train_set["input_ids"]]
    attention, why = resolve_attention(
        settings.model.attention, info.device.type, packed, lengths, settings.data.max_seq_len
    )
    resolved = replace(resolved, attention=attention, attention_why=why)
    if info.is_main_process:
        logger.info("attention: %s (%s)", attention or "transformers' default", why)
    collate = PackedCollator(tokenizer.pad_token_id, settings.data.max_seq_len) if packed else make_collator(tokenizer)
    return RunParts(
        resolved=resolved,
        model_path=model_path,
        tokenizer=tokenizer,
        train_set=train_set,
        eval_set=eval_set,
        collate=collate,
        truncation=truncation,
        hooks=run_hooks(),
        data_record=raw.record(settings.data) | {"packing": packed},  # what ran
        eval_rows=raw.splits["eval"],
    )


def build_model(settings: RunSettings, info: DistInfo, parts: RunParts) -> torch.nn.Module:
    """The QLoRA model on this rank's device, seeded by ``settings.train.seed``, checked against the tokenizer."""
    seed_everything(settings.train.seed)
    resolved = {
        "model_name_or_path": parts.model_path,
        "gradient_checkpointing": parts.resolved.checkpointing,
        "attention": parts.resolved.attention or "auto",
    }
    model_settings = type(settings.model)(**{**asdict(settings.model), **resolved})
    model = load_qlora_model(model_settings, settings.lora, parts.resolved.device_map, info.world_size)
    check_vocabulary(parts.tokenizer, model.get_input_embeddings().num_embeddings)
    if parts.resolved.packing:  # the attention implementation is known now: refuse one that would mix packed sequences
        check_packed_model(model)
    parts.hooks.attach(model)
    return model


def build_training_model(settings: RunSettings, info: DistInfo, parts: RunParts) -> tuple[torch.nn.Module, Resolved]:
    """The plain loop's model as it will train, before any wrap: Liger's patch before the build (where refused, it was
    in ``resolve_run``), the QLoRA model (:func:`build_model`), its decoder layers compiled in place
    (``ddp_ft.training.model.compilation``: names, checkpoints and the overlap unchanged), and with ``--micro-batch
    auto`` on CUDA the probe's choice measured on it (``probe_run_micro_batch``; unwrapped, so nothing is communicated).

    Returns:
        tuple: the model, and what the run trains with (``parts.resolved``, or the probe's choice in it).
    """
    resolved = parts.resolved
    if settings.model.liger:
        apply_liger_to_qwen3(parts.model_path)
    model = build_model(settings, info, parts)
    if resolved.compile:
        compile_repeated_blocks(model)
    if resolved.probe_pending:
        resolved = probe_run_micro_batch(model, settings, info, resolved)
    return model, resolved


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (the LoRA initialisation draws from torch's)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
