"""Resuming: which checkpoint, whether it is intact and safe, its position, and restoring it.

Nothing here executes code from the checkpoint's files.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import shlex
import zipfile
from pathlib import Path

import torch
import yaml

from ...distributed import DistInfo
from ...report.records import METRICS_FILE, TRAIN
from ..config import RUN_CONFIG, RunSettings, settings_as_config
from ..data import DataLayout, check_resume
from .publish import LATEST, latest_name
from .state import (
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    CHECKPOINT_PREFIX,
    FINAL_DIR,
    FORMAT_VERSION,
    SCALER_FILE,
    STATE_FILE,
    TENSOR_FILES,
    TRAINER_STATE_FILE,
    TrainState,
    set_rng_state,
)

logger = logging.getLogger(__name__)


def checkpoint_to_resume(resume: str, output_dir: str | Path, restart_count: int = 0) -> Path | None:
    """What this run resumes: ``--resume``, or the newest checkpoint after an elastic restart.

    torchrun restarts every rank with the same arguments, so a restart continues from ``latest`` when one exists.

    Args:
        resume (str): ``--resume``: a folder, ``latest`` or empty.
        output_dir (str | Path): the run's folder.
        restart_count (int): torchrun's ``TORCHELASTIC_RESTART_COUNT``. Default: 0

    Returns:
        Path | None: the checkpoint, or None to start fresh.
    """
    if restart_count > 0 and latest_name(Path(output_dir)) is not None:
        path = resolve_checkpoint("latest", output_dir)
        logger.info("elastic restart %d: resuming from %s", restart_count, path)
        return path
    return resolve_checkpoint(resume, output_dir) if resume else None


def refuse_earlier_run(output_dir: str | Path) -> None:
    """Refuse a new run in a folder an earlier run filled: its ``final/``, checkpoints and ``metrics.jsonl`` would be
    replaced, rotated away and mixed with the new run's. A run stopped before its first step left nothing to lose.

    Raises:
        ValueError: naming what the folder holds and the fixes (``--resume latest``, another ``--output-dir``).
    """
    folder = Path(output_dir)
    prefixes = (f"{CHECKPOINT_PREFIX}-", "checkpoint-")  # the loop's and the Trainer's
    found = sorted(p.name for p in folder.glob("*") if p.name == FINAL_DIR or p.name.startswith(prefixes))
    if _trained(folder / METRICS_FILE):
        found.append(METRICS_FILE)
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ValueError(
            f"--output-dir {output_dir} holds an earlier run ({shown}): a new run there would replace its "
            f"{FINAL_DIR}/ adapter, delete its oldest checkpoints and mix its {METRICS_FILE} with its own. "
            "Continue that run with --resume latest, or give a new --output-dir (or remove that folder)."
        )


def _trained(metrics: Path) -> bool:
    """Whether ``metrics`` records a training step."""
    if not metrics.is_file():
        return False
    with metrics.open() as lines:
        return any(f'"type": "{TRAIN}"' in line for line in lines)


# What a resumed run keeps from the run it continues: the model, its adapter, the data's formatting and the
# optimizer's settings. A change would be dropped (the optimizer's saved learning rate and weight decay win) or would
# change the run half-way. The effective batch and seed are the data layout's (check_resume_position).
RESUME_FIXED = {
    "model": ("model_name_or_path", "load_in_4bit", "double_quant", "compute_dtype", "upcast_frozen_weights"),
    "lora": ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"),
    "data": ("format", "dialogue_column", "summary_column", "max_seq_len", "data_seed", "instruction", "chat_template"),
    "train": ("learning_rate", "min_learning_rate", "warmup_ratio", "weight_decay", "max_grad_norm"),
}


def check_resume_settings(path: str | Path, settings: RunSettings, info: DistInfo) -> None:
    """Refuse resuming ``path`` with a setting of ``RESUME_FIXED`` changed from the run that wrote it; warn on rank 0
    when the run's length changed (its learning-rate schedule is recomputed).

    That run's settings are its ``run_config.yaml``, beside the checkpoint; a checkpoint moved away alone is not
    checked.

    Raises:
        ValueError: naming each changed flag, its value in that run, and the fixes.
    """
    written = Path(path).parent / RUN_CONFIG
    if not written.is_file():
        return
    before, now = yaml.safe_load(written.read_text()) or {}, settings_as_config(settings)
    changed = [
        (f"--{name.replace('_', '-')}", before[section][name], now[section][name])
        for section, names in RESUME_FIXED.items()
        for name in names
        if name in (before.get(section) or {}) and before[section][name] != now[section][name]
    ]
    if changed:
        given = ", ".join(f"{flag} {_shown(new)}" for flag, _, new in changed)
        was = " ".join(f"{flag} {_shown(old)}" for flag, old, _ in changed)
        raise ValueError(
            f"--resume {path}: {given}, but the run it continues trained with {was} ({written}). A resumed run "
            f"continues that run exactly, so these cannot change: resume with {was}, or start a new run in another "
            "--output-dir."
        )
    planned, asked = _length(before.get("train") or {}), _length(now["train"])
    if info.is_main_process and planned is not None and planned != asked:
        logger.warning(
            "--resume %s: the run it continues was planned for %s, this one for %s, so its learning-rate schedule "
            "(warmup, then the decay to --min-learning-rate) is recomputed for the new length: the resumed steps "
            "follow neither the curve the run was on nor that of a run planned for %s from its start.",
            path,
            planned,
            asked,
            asked,
        )


def _length(train: dict) -> str | None:
    """A run's planned length, as its settings give it: steps, else epochs."""
    if "max_steps" not in train:
        return None
    return f"{train['max_steps']} optimizer steps" if train["max_steps"] > 0 else f"{train.get('epochs')} epoch(s)"


def _shown(value: object) -> str:
    """A setting's value as a flag takes it."""
    return " ".join(map(str, value)) if isinstance(value, list) else shlex.quote(str(value))


_OLD_FORMATS = {  # why this version cannot read a format it once wrote
    1: " (format_version 1 stores numpy's RNG state as pickled numpy objects, and this version loads checkpoints "
    "without executing code)",
}


def resolve_checkpoint(resume: str, output_dir: str | Path) -> Path:
    """Turn ``--resume``, a folder or ``latest``, into one of the loop's checkpoint folders.

    Raises:
        FileNotFoundError: no such checkpoint, or one missing a file.
        ValueError: a Trainer checkpoint, another format version, or a damaged one.
    """
    if resume == "latest":
        name = latest_name(Path(output_dir))
        if name is None:
            raise FileNotFoundError(f"--resume latest: no checkpoint in {output_dir} (no '{LATEST}' file).")
        path = Path(output_dir) / name
    else:
        path = Path(resume)
    if (path / STATE_FILE).is_file():
        try:
            version = json.loads((path / STATE_FILE).read_text()).get("format_version")
        except (ValueError, AttributeError) as err:  # cut short, overwritten, not an object
            raise ValueError(_damaged(resume, path, f"{STATE_FILE} is not a JSON object ({err})")) from None
        if version != FORMAT_VERSION:
            raise ValueError(
                f"--resume {resume}: checkpoint format_version {version}, but this ddp_ft reads format_version "
                f"{FORMAT_VERSION} only: {path} was written by another ddp_ft version{_OLD_FORMATS.get(version, '')}; "
                "resume it with that version or start a new run in another --output-dir."
            )
        if not (path / ADAPTER_DIR).is_dir():
            raise FileNotFoundError(
                f"--resume {resume}: {path} is an incomplete ddp_ft checkpoint (no {ADAPTER_DIR}/)."
            )
        _check_intact(path, resume)
        return path
    if (path / TRAINER_STATE_FILE).is_file():
        if "batch_in_epoch" in json.loads((path / TRAINER_STATE_FILE).read_text()):
            raise ValueError(
                f"--resume {resume}: {path} is a checkpoint of an older ddp_ft (format_version 0, {TRAINER_STATE_FILE} "
                "with a per-rank batch position, which another world size or micro-batch cannot continue exactly); "
                "this version cannot resume it: start a new run in another --output-dir."
            )
        raise ValueError(
            f"--resume {resume}: {path} is a Hugging Face Trainer checkpoint ({TRAINER_STATE_FILE} in the Trainer's "
            "layout, written by `accelerate launch recipes/qwen_ami.py`), not one of scripts/train.py's: resume it "
            f"with recipes/qwen_ami.py --resume {path}. scripts/train.py resumes its own {CHECKPOINT_PREFIX}-N "
            f"folders (holding {STATE_FILE})."
        )
    raise FileNotFoundError(
        f"--resume {resume}: {path} is not a ddp_ft checkpoint (no {STATE_FILE}); scripts/train.py writes "
        f"{CHECKPOINT_PREFIX}-N folders."
    )


_TORCH_FILES = ("optimizer.pt", "scheduler.pt", "rng_states.pt")
_POSITION_KEYS = ("global_step", "epoch", "sample_in_epoch", "samples_seen")


def _damaged(resume: str, path: Path, what: str) -> str:
    return (
        f"--resume {resume}: {path} is damaged: {what}. Resume an earlier checkpoint ({CHECKPOINT_PREFIX}-N in "
        f"{path.parent}) or start a new run in another --output-dir."
    )


def _safetensors_intact(file: Path) -> bool:
    """Whether the header parses and the file holds every byte it points to."""
    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return file.stat().st_size >= 8 + length + end
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        return False


def _check_intact(path: Path, resume: str) -> None:
    """Check the position keys and that no file is missing or cut short, loading nothing.

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a file is damaged.
    """
    state = json.loads((path / STATE_FILE).read_text())
    missing = [k for k in _POSITION_KEYS if not isinstance(state.get(k), int)]
    if missing:
        raise ValueError(_damaged(resume, path, f"{STATE_FILE} lacks the position {missing}"))
    absent = [name for name in _TORCH_FILES if not (path / name).is_file()]
    if absent:
        raise FileNotFoundError(f"--resume {resume}: {path} is an incomplete ddp_ft checkpoint (no {absent}).")
    for name in _TORCH_FILES:
        if not zipfile.is_zipfile(path / name):
            raise ValueError(_damaged(resume, path, f"{name} is cut short or not a torch.save file"))
    for file in sorted((path / ADAPTER_DIR).glob("*.safetensors")):
        if not _safetensors_intact(file):
            raise ValueError(_damaged(resume, path, f"{ADAPTER_DIR}/{file.name} is cut short or not safetensors"))


def saved_position(path: str | Path) -> tuple[TrainState, DataLayout | None]:
    """A checkpoint's position and data layout, read without loading anything else."""
    saved = json.loads((Path(path) / STATE_FILE).read_text())
    state = TrainState(**{k: saved[k] for k in ("global_step", "epoch", "sample_in_epoch", "samples_seen")})
    return state, DataLayout(**saved["layout"]) if saved.get("layout") else None


# What torch names when weights_only refuses a file.
_REFUSED = re.compile(r"WeightsUnpickler error: ([^\n]*?)(?:\. Please|\.?\n|$)")


def _load_tensors(file: Path, mmap: bool = False) -> object:
    """``torch.load(weights_only=True)`` on CPU, naming the file in any refusal.

    Raises:
        ValueError: the file holds pickled objects, or is not a complete torch.save file.
    """
    damaged = (
        f"checkpoint file {file} cannot be read as a torch.save file ({{}}); the checkpoint is damaged or was "
        "not written by ddp_ft: resume from another checkpoint or start a new run in another --output-dir."
    )
    if not zipfile.is_zipfile(file):  # torch's own error would name no file
        raise ValueError(damaged.format("not the zip archive torch.save writes"))
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        found = _REFUSED.search(str(err))
        raise ValueError(
            f"checkpoint file {file} holds pickled objects ({found.group(1) if found else str(err).strip()}); ddp_ft "
            "loads checkpoints without executing code (torch.load(weights_only=True): tensors and plain Python data "
            "only), so it refuses this one. Start a new run in another --output-dir, or, if you trust the file, "
            "resume it with the ddp_ft version that wrote it; checkpoints this version writes hold no pickled objects."
        ) from None
    except (RuntimeError, EOFError) as err:  # a truncated archive
        raise ValueError(damaged.format(err)) from None


def check_resume_position(path: str | Path, layout: DataLayout) -> None:
    """Refuse a checkpoint whose data position this run's ``layout`` cannot continue exactly."""

    verify_checkpoint(path)
    state, saved = saved_position(path)
    if saved is None:
        raise ValueError(
            f"--resume {path}: the checkpoint records no data layout; start a new run in another --output-dir."
        )
    try:
        check_resume(saved, layout, state.sample_in_epoch)
    except ValueError as err:
        raise ValueError(f"--resume {path}: {err}") from None


def verify_checkpoint(path: str | Path) -> None:
    """Read every tensor file of a checkpoint the way resuming will, before the model is built.

    Files load memory-mapped with ``weights_only=True``, so a checkpoint needing code execution fails here, early.

    Args:
        path (str | Path): a checkpoint folder ``resolve_checkpoint`` accepted.

    Raises:
        FileNotFoundError: a file resuming needs is missing.
        ValueError: a file holds pickled objects or is unreadable.
    """
    path = Path(path)
    adapter = path / ADAPTER_DIR
    pickled = sorted(adapter.glob("*.bin"))
    if pickled:
        raise ValueError(
            f"checkpoint adapter {pickled[0]} is a pickled file; ddp_ft loads checkpoints without executing code and "
            f"reads the adapter from {ADAPTER_WEIGHTS} only (what peft's save_pretrained writes by default). Start a "
            "new run in another --output-dir, or re-save the adapter with save_pretrained(safe_serialization=True)."
        )
    if not (adapter / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(
            f"checkpoint {path} has no {ADAPTER_DIR}/{ADAPTER_WEIGHTS}; it is incomplete: resume "
            "from another checkpoint or start a new run in another --output-dir."
        )
    for name in TENSOR_FILES:
        if not (path / name).is_file():
            raise FileNotFoundError(
                f"checkpoint {path} has no {name}; it is incomplete: resume from another "
                "checkpoint or start a new run in another --output-dir."
            )
    for file in sorted([*path.rglob("*.pt"), *path.rglob("*.pth")]):
        _load_tensors(file, mmap=True)


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: object,
    info: DistInfo,
    scaler: torch.amp.GradScaler | None = None,
) -> TrainState:
    """Restore adapter, optimizer, scheduler and this rank's RNG state; return the position.

    It restores without judging: check the layout and files first.

    Example:
        >>> state = load_checkpoint(path, model, optimizer, scheduler, info)
    """
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    path = Path(path)
    adapter = load_peft_weights(str(path / ADAPTER_DIR), device=str(next(model.parameters()).device))
    result = set_peft_model_state_dict(model, adapter)
    if getattr(result, "unexpected_keys", None):
        raise RuntimeError(f"checkpoint {path} holds adapter weights this model lacks: {result.unexpected_keys[:5]}")
    optimizer.load_state_dict(_load_tensors(path / "optimizer.pt"))
    scheduler.load_state_dict(_load_tensors(path / "scheduler.pt"))
    if scaler is not None and scaler.is_enabled():
        if (path / SCALER_FILE).is_file():
            scaler.load_state_dict(_load_tensors(path / SCALER_FILE))
        else:
            logger.warning("checkpoint %s was not trained in float16: the loss scale starts afresh", path)
    states = _load_tensors(path / "rng_states.pt")
    if len(states) != info.world_size:
        # The data continues exactly; per-rank RNG streams cannot be split or merged, so dropout masks differ.
        logger.warning(
            "checkpoint was written by %d ranks, resuming on %d: the data continues exactly, the RNG streams "
            "(dropout masks) cannot; rank r continues saved rank r %% %d's",
            len(states),
            info.world_size,
            len(states),
        )
    set_rng_state(states[info.rank % len(states)])
    state, _ = saved_position(path)
    return state
