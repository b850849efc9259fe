"""The adapter a run ends with, ready to use: ``output_dir/final`` holds the adapter, the tokenizer it was trained with
(its chat template included) and ``ddp_ft_data.json``, the data settings that format a prompt the way training did.

Both entry points write it with :func:`save_final`, rank 0 only, atomically: everything goes into a hidden folder,
is fsynced, then renamed into place. ``ddp-ft merge`` reads it (``ddp_ft.training.model.merge``).
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
    """Write the tokenizer and ``ddp_ft_data.json`` beside an adapter, so the folder formats prompts on its own.

    Args:
        folder (str | Path): the adapter's folder.
        tokenizer (PreTrainedTokenizerBase): the run's tokenizer, with the chat template it trained with.
        data (DataSettings | dict): the run's data settings, written whole; a dict as ``RawData.record`` makes it,
            with the format found and its shape.
    """
    tokenizer.save_pretrained(folder)
    record = data if isinstance(data, dict) else asdict(data)
    # A value JSON cannot write (a Path) becomes its string.
    Path(folder, DATA_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")


def save_final(
    output_dir: str | Path,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    data: DataSettings | dict,
    info: DistInfo,
) -> Path | None:
    """Write ``output_dir/final`` on rank 0, atomically: the adapter, its tokenizer and ``ddp_ft_data.json``.

    Call on every rank: the others wait until it is published. A final folder already there (a resumed run that
    finished again) is replaced whole.

    Args:
        output_dir (str | Path): the run's folder.
        model (torch.nn.Module): the unwrapped peft model; its adapter is saved with ``save_pretrained``.
        tokenizer (PreTrainedTokenizerBase): the run's tokenizer.
        data (DataSettings | dict): the run's data settings (``save_adapter_companions``).
        info (DistInfo): this process's rank.

    Returns:
        Path | None: the final folder on rank 0, None elsewhere.
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
