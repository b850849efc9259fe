"""Saving: gather every rank's RNG state, write on rank 0, publish atomically, prune old checkpoints."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ...distributed import DistInfo
from ..data import DataLayout, DataSettings
from .final import save_adapter_companions
from .publish import clean_partial_saves, fsync_tree, latest_name, publish_checkpoint, remove_folder
from .state import ADAPTER_DIR, CHECKPOINT_PREFIX, FORMAT_VERSION, SCALER_FILE, STATE_FILE, TrainState, rng_state

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_OWN_NAME = re.compile(rf"^{re.escape(CHECKPOINT_PREFIX)}-(\d+)$")


def _own_checkpoints(output_dir: Path) -> list[Path]:
    """The loop's own checkpoints in ``output_dir``, oldest first; never the Trainer's."""
    found = []
    for path in output_dir.iterdir():
        match = _OWN_NAME.match(path.name)
        if match and path.is_dir() and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def save_checkpoint(
    output_dir: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: object,
    state: TrainState,
    info: DistInfo,
    save_total_limit: int = 0,
    layout: DataLayout | None = None,
    before_publish: Callable[[int], None] | None = None,
    scaler: torch.amp.GradScaler | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    data: DataSettings | dict | None = None,
) -> Path | None:
    """Write ``output_dir/ddp_ft-checkpoint-<step>`` atomically on rank 0 and point ``latest`` at it.

    Call on every rank, since the RNG states are gathered. ``model`` is the unwrapped peft model.

    Args:
        save_total_limit (int): keep at most this many checkpoints; 0 keeps all. Default: 0
        layout (DataLayout | None): the run's data layout, checked on resume. Default: None
        before_publish (Callable[[int], None] | None): called once files are written, before publishing. Default: None
        scaler (torch.amp.GradScaler | None): float16's loss scaler, saved when enabled. Default: None
        tokenizer (PreTrainedTokenizerBase | None): saved beside the adapter, with ``data``. Default: None
        data (DataSettings | None): the run's data settings. Default: None

    Returns:
        Path | None: the checkpoint folder on rank 0, None elsewhere.

    Example:
        >>> save_checkpoint("runs/demo", model, optimizer, scheduler, state, info, save_total_limit=2)
    """
    states = [None] * info.world_size
    if info.is_distributed:
        dist.all_gather_object(states, rng_state())
    else:
        states = [rng_state()]
    output_dir = Path(output_dir)
    final = output_dir / f"{CHECKPOINT_PREFIX}-{state.global_step}"
    if info.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        tmp = output_dir / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        model.save_pretrained(tmp / ADAPTER_DIR)
        if tokenizer is not None and data is not None:
            save_adapter_companions(tmp / ADAPTER_DIR, tokenizer, data)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(states, tmp / "rng_states.pt")
        if scaler is not None and scaler.is_enabled():
            torch.save(scaler.state_dict(), tmp / SCALER_FILE)
        saved = {
            "format_version": FORMAT_VERSION,
            **asdict(state),
            "world_size": info.world_size,
            "layout": asdict(layout) if layout else None,
        }
        (tmp / STATE_FILE).write_text(json.dumps(saved, indent=2))
        if before_publish is not None:
            before_publish(state.global_step)
        fsync_tree(tmp)
        publish_checkpoint(tmp, final)
        _prune(output_dir, save_total_limit, keep=final)
        clean_partial_saves(output_dir)
        logger.info("saved %s", final)
    if info.is_distributed:
        dist.barrier()
    return final if info.is_main_process else None


def _prune(output_dir: Path, limit: int, keep: Path) -> None:
    """Delete the oldest own checkpoints beyond ``limit``, never ``keep`` nor ``latest``."""
    if limit <= 0:
        return
    protected = {keep.name, latest_name(output_dir)}
    checkpoints = _own_checkpoints(output_dir)
    for old in [c for c in checkpoints if c.name not in protected][: max(0, len(checkpoints) - limit)]:
        remove_folder(old)
