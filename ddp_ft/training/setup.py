"""The pieces both entry points build a run from: checks, then data, then model.

``resolve_run`` runs before anything is touched. ``prepare_run`` builds tokenizer and data, checking all before
the model loads. ``build_model`` loads the QLoRA model on this rank's device.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..ddp.autotune import AUTO
from ..distributed import DistInfo
from .config import RunSettings
from .data import (
    PackedCollator,
    TruncationReport,
    batch_width,
    check_packed_model,
    load_source,
    make_collator,
    sample_lengths,
    tokenize_dataset,
)
from .data.balance import WIDTH_MULTIPLE
from .data.prompts import first_prompts
from .data.tokenizer import build_tiny_tokenizer, check_vocabulary, load_tokenizer
from .hooks import RunHooks, run_hooks
from .model.attention import resolve_attention
from .model.compilation import compile_repeated_blocks
from .model.kernels import apply_liger_to_qwen3
from .model.positions import check_generation, check_positions
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
    """What both entry points build before the model."""

    resolved: Resolved  # what the run trains with
    model_path: str  # a hub id or folder
    tokenizer: PreTrainedTokenizerBase
    train_set: Dataset  # tokenized
    eval_set: Dataset
    collate: Callable[[list[dict]], dict[str, torch.Tensor]]  # right padding, or packed
    truncation: TruncationReport
    hooks: RunHooks  # inert unless a harness installs one
    data_record: dict | None = None  # for ``ddp_ft_data.json``
    eval_rows: Dataset | None = None  # untokenized, for ``--predict``

    @property
    def batch_cost(self) -> Callable[[list[int]], int] | None:
        """A micro-batch's cost for the balanced plan: packed rows', else padded."""
        return self.collate.cost if isinstance(self.collate, PackedCollator) else None


def cache_dir() -> Path:
    """Where the embedded default is built: ``DDP_FT_CACHE``, else ``~/.cache/ddp_ft``."""
    return Path(os.environ.get("DDP_FT_CACHE", Path.home() / ".cache" / "ddp_ft"))


def resolve_model_and_tokenizer(model_name_or_path: str, info: DistInfo) -> tuple[str, str]:
    """Pass hub ids and folders through; build the embedded default once, on local rank 0."""
    if model_name_or_path != EMBEDDED_MODEL:
        check_model_source(model_name_or_path)  # also under other launchers
        return model_name_or_path, model_name_or_path
    tokenizer_dir = cache_dir() / "tiny-tokenizer"
    if info.local_rank == 0:
        build_tiny_tokenizer(tokenizer_dir)
    _barrier(info)
    tokenizer = load_tokenizer(str(tokenizer_dir))
    # Give the model's config the tokenizer's special tokens, as a hub model has.
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
    """Check the settings, then build tokenizer and data; every check before the model.

    Args:
        settings (RunSettings): the run's settings.
        info (DistInfo): this rank.
        resolved (Resolved | None): ``resolve_run``'s result, if the caller ran it. Default: run here

    Raises:
        ValueError: bad settings or data, or fewer samples than one effective batch, naming the fix.
    """
    t = settings.train
    resolved = resolved or resolve_run(settings, info)
    model_path, tokenizer_path = resolve_model_and_tokenizer(settings.model.model_name_or_path, info)
    tokenizer = load_tokenizer(tokenizer_path, settings.data.chat_template)
    raw = load_source(settings.data)
    train_set, truncation = tokenize_dataset(raw.splits["train"], tokenizer, settings.data)
    eval_set, _ = tokenize_dataset(raw.splits["eval"], tokenizer, settings.data)
    if info.is_main_process and truncation.advice():  # synthetic meetings are cut on purpose
        level = logging.INFO if settings.data.source_kind == "synthetic" else logging.WARNING
        logger.log(level, "%s", truncation.advice())
    if len(train_set) < t.effective_batch:
        least = resolved.micro_batch * info.world_size  # the smallest effective batch here
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
    lengths = partial(sample_lengths, train_set)  # read only where auto needs them
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
    """The QLoRA model on this rank's device, seeded, and checked against the tokenizer and the run's lengths."""
    seed_everything(settings.train.seed)
    resolved = {
        "model_name_or_path": parts.model_path,
        "gradient_checkpointing": parts.resolved.checkpointing,
        "attention": parts.resolved.attention or AUTO,
    }
    model_settings = type(settings.model)(**{**asdict(settings.model), **resolved})
    model = load_qlora_model(model_settings, settings.lora, parts.resolved.device_map, info.world_size)
    check_vocabulary(parts.tokenizer, model.get_input_embeddings().num_embeddings)
    check_lengths(model, settings, parts, info)
    if parts.resolved.packing:  # refuse attention that would mix packed sequences
        check_packed_model(model)
    parts.hooks.attach(model)
    return model


def check_lengths(model: torch.nn.Module, settings: RunSettings, parts: RunParts, info: DistInfo) -> None:
    """Refuse sequences past the model's table of positions, and warn past the rotary ones it was trained on.

    A micro-batch, packed or not, is padded to a multiple of 8 past ``--max-seq-len``; ``--predict`` writes after
    its eval prompts.

    Raises:
        ValueError: a training or prediction sequence past the table, naming the fix.
    """
    longest, t = settings.data.max_seq_len, settings.train

    def fix(limit: int) -> str:
        return f"Set --max-seq-len {limit // WIDTH_MULTIPLE * WIDTH_MULTIPLE} or less"  # pads no further

    said = [check_positions(model, longest, f"--max-seq-len {longest}", fix, padded=batch_width(longest))]
    if t.predict:
        prompts = first_prompts(parts.eval_rows, parts.tokenizer, settings.data, t.predict)
        prompt = max(len(p.input_ids) for p in prompts)
        said.append(check_generation(model, prompt, t.max_new_tokens, f"--predict {t.predict}"))
    for warning in filter(None, said):
        if info.is_main_process:
            logger.warning("%s", warning)


def build_training_model(settings: RunSettings, info: DistInfo, parts: RunParts) -> tuple[torch.nn.Module, Resolved]:
    """The plain loop's model as it trains, before the wrap: Liger, QLoRA, compiled layers, then the probe.

    Returns:
        tuple: the model, and the resolved settings with the probe's choice.
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
    """Seed Python's, NumPy's and torch's generators."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
