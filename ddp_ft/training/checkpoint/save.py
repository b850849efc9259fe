"""Saving: :func:`save_checkpoint` gathers every rank's RNG state, writes the checkpoint on rank 0 and publishes it
atomically; the oldest of the loop's own checkpoints beyond ``save_total_limit`` are pruned.
"""

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
    """The loop's checkpoints in ``output_dir``, oldest step first: named ``ddp_ft-checkpoint-N`` and holding our
    state file. Anything else (the HF Trainer's ``checkpoint-N``, a user's folder) is never listed."""
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
    """Write ``output_dir/ddp_ft-checkpoint-<step>`` atomically (rank 0) and point ``latest`` at it.

    Call on every rank (the RNG states are gathered). ``model`` is the unwrapped peft model: the adapter
    is saved with ``save_pretrained``, never the DDP wrapper.

    Args:
        save_total_limit (int): keep at most this many of the loop's own checkpoints (0: all). Default: 0
        layout (DataLayout | None): how the run reads its data, checked on resume (the loop always gives it).
            Default: None
        before_publish (Callable[[int], None] | None): called with the step once every file is written, before
            the folder is published (the fault tests kill the process there). Default: None
        scaler (torch.amp.GradScaler | None): float16's loss scaler; its scale and growth tracker are saved as
            ``scaler.pt`` when it is enabled, so a resumed run skips the same steps. Default: None
        tokenizer (PreTrainedTokenizerBase | None): saved into ``adapter/`` with ``ddp_ft_data.json`` (``data``
            needed too), so any checkpoint's adapter merges and formats prompts on its own. Default: None
        data (DataSettings | None): the run's data settings. Default: None

    Returns:
        Path | None: the checkpoint folder on rank 0, None elsewhere.
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
    """Delete the oldest of the loop's own checkpoints beyond ``limit``; never ``keep`` nor what ``latest`` names."""
    if limit <= 0:
        return
    protected = {keep.name, latest_name(output_dir)}
    checkpoints = _own_checkpoints(output_dir)
    for old in [c for c in checkpoints if c.name not in protected][: max(0, len(checkpoints) - limit)]:
        remove_folder(old)
