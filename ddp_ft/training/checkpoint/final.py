"""The adapter a run ends with: ``output_dir/final`` holds it, its tokenizer and data settings.

Rank 0 writes it atomically. ``ddp-ft merge`` reads it.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ...distributed import DistInfo
from ..data import DataSettings
from .publish import publish_folder
from .state import DATA_FILE, FINAL_DIR

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def save_adapter_companions(folder: str | Path, tokenizer: PreTrainedTokenizerBase, data: DataSettings | dict) -> None:
    """Write the tokenizer and ``ddp_ft_data.json`` beside an adapter, so it formats prompts alone.

    Args:
        folder (str | Path): the adapter's folder.
        tokenizer (PreTrainedTokenizerBase): the run's tokenizer.
        data (DataSettings | dict): the run's data settings.
    """
    tokenizer.save_pretrained(folder)
    record = data if isinstance(data, dict) else asdict(data)
    # A Path becomes its string.
    Path(folder, DATA_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")


def save_final(
    output_dir: str | Path,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    data: DataSettings | dict,
    info: DistInfo,
) -> Path | None:
    """Write ``output_dir/final`` on rank 0, atomically, replacing any earlier one.

    Call on every rank; the others wait until it is published.

    Args:
        output_dir (str | Path): the run's folder.
        model (torch.nn.Module): the unwrapped peft model.
        tokenizer (PreTrainedTokenizerBase): the run's tokenizer.
        data (DataSettings | dict): the run's data settings.
        info (DistInfo): this process's rank.

    Returns:
        Path | None: the final folder on rank 0, None elsewhere.

    Example:
        >>> save_final("runs/demo", model, tokenizer, settings.data, info)
    """
    final = Path(output_dir) / FINAL_DIR
    if info.is_main_process:
        tmp = final.with_name(f".tmp-{FINAL_DIR}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        save_adapter_companions(tmp, tokenizer, data)
        publish_folder(tmp, final)
        logger.info("saved the final adapter, its tokenizer and data settings to %s", final)
    if info.is_distributed:
        dist.barrier()
    return final if info.is_main_process else None
