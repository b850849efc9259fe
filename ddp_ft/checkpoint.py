"""Atomic checkpoints: adapter, optimizer, scheduler, data position and every rank's RNG state.

Rank 0 writes everything into a hidden temporary folder and renames it into place, so a crash mid-save
never leaves a half-written ``checkpoint-N`` and never touches the checkpoints already there. Every rank
contributes its RNG state (gathered to rank 0), so dropout and data order continue exactly on resume.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .data import DataLayout
from .distributed import DistInfo

logger = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
STATE_FILE = "trainer_state.json"


@dataclass
class TrainState:
    """Where training stands; enough to continue exactly.

    Args:
        global_step (int): optimizer steps done.
        epoch (int): current epoch (the sampler's ``set_epoch`` value).
        sample_in_epoch (int): samples of ``epoch``'s global order already trained, over all ranks (a multiple of
            the effective batch; the same number on any world size).
        samples_seen (int): samples consumed over all ranks (the x axis shared by all world sizes).
    """

    global_step: int = 0
    epoch: int = 0
    sample_in_epoch: int = 0
    samples_seen: int = 0


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(
    output_dir: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: object,
    state: TrainState,
    info: DistInfo,
    save_total_limit: int = 0,
    layout: DataLayout | None = None,
) -> Path | None:
    """Write ``output_dir/checkpoint-<step>`` atomically (rank 0) and point ``latest`` at it.

    Call on every rank (the RNG states are gathered). ``model`` is the unwrapped peft model: the adapter
    is saved with ``save_pretrained``, never the DDP wrapper.

    Args:
        layout (DataLayout | None): how the run reads its data, checked on resume (the loop always gives it).
            Default: None

    Returns:
        Path | None: the checkpoint folder on rank 0, None elsewhere.
    """
    states = [None] * info.world_size
    if info.is_distributed:
        dist.all_gather_object(states, rng_state())
    else:
        states = [rng_state()]
    final = Path(output_dir) / f"checkpoint-{state.global_step}"
    if info.is_main_process:
        tmp = final.with_name(f".tmp-{final.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp / ADAPTER_DIR)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(states, tmp / "rng_states.pt")
        saved = {**asdict(state), "world_size": info.world_size, "layout": asdict(layout) if layout else None}
        (tmp / STATE_FILE).write_text(json.dumps(saved, indent=2))
        if final.exists():  # same step saved before (e.g. a resumed run): replace it, the new one is complete
            old = final.with_name(f".old-{final.name}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _atomic_write_text(Path(output_dir) / "latest", final.name)
        _prune(Path(output_dir), save_total_limit, keep=final)
        logger.info("saved %s", final)
    if info.is_distributed:
        dist.barrier()
    return final if info.is_main_process else None


def _prune(output_dir: Path, limit: int, keep: Path) -> None:
    if limit <= 0:
        return
    checkpoints = sorted(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    for old in [c for c in checkpoints if c != keep][: max(0, len(checkpoints) - limit)]:
        shutil.rmtree(old, ignore_errors=True)


def resolve_checkpoint(resume: str, output_dir: str | Path) -> Path:
    """Turn ``--resume`` (a folder, or 'latest') into a checkpoint folder.

    Raises:
        FileNotFoundError: naming what was looked for and where.
    """
    if resume == "latest":
        pointer = Path(output_dir) / "latest"
        if not pointer.exists():
            raise FileNotFoundError(f"--resume latest: no checkpoint in {output_dir} (no 'latest' file).")
        path = Path(output_dir) / pointer.read_text().strip()
    else:
        path = Path(resume)
    if not (path / STATE_FILE).exists() or not (path / ADAPTER_DIR).exists():
        raise FileNotFoundError(
            f"--resume {resume}: {path} is not a ddp_ft checkpoint (no {STATE_FILE}/{ADAPTER_DIR})."
        )
    return path


def saved_position(path: str | Path) -> tuple[TrainState, DataLayout | None]:
    """A checkpoint's position and data layout, read without loading anything else (checks before the model)."""
    saved = json.loads((Path(path) / STATE_FILE).read_text())
    state = TrainState(**{k: saved[k] for k in ("global_step", "epoch", "sample_in_epoch", "samples_seen")})
    return state, DataLayout(**saved["layout"]) if saved.get("layout") else None


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: object, info: DistInfo
) -> TrainState:
    """Restore adapter weights, optimizer, scheduler and this rank's RNG state; return the position.

    Check the data layout first (``saved_position``, ``ddp_ft.data.check_resume``): this restores, it does not judge.
    """
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    path = Path(path)
    adapter = load_peft_weights(str(path / ADAPTER_DIR), device=str(next(model.parameters()).device))
    result = set_peft_model_state_dict(model, adapter)
    if getattr(result, "unexpected_keys", None):
        raise RuntimeError(f"checkpoint {path} holds adapter weights this model lacks: {result.unexpected_keys[:5]}")
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    states = torch.load(path / "rng_states.pt", weights_only=False)
    if len(states) != info.world_size:
        # Decided: the data continues exactly (a sample position); the per-rank RNG streams cannot, since there is
        # no way to split or merge them. Rank r continues rank (r % saved ranks)'s stream: dropout masks differ
        # from the uninterrupted run's from here on (with dropout 0 nothing else draws from them).
        logger.warning(
            "checkpoint was written by %d ranks, resuming on %d: the data continues exactly, the RNG streams "
            "(dropout masks) cannot; rank r continues saved rank r %% %d's",
            len(states), info.world_size, len(states),
        )  # fmt: skip
    set_rng_state(states[info.rank % len(states)])
    state, _ = saved_position(path)
    return state
