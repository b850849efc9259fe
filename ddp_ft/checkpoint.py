"""Atomic checkpoints of the plain loop: adapter, optimizer, scheduler, data position and every rank's RNG state.

A checkpoint is ``output_dir/ddp_ft-checkpoint-N`` holding ``ddp_ft_state.json`` (with a ``format_version``),
never the Hugging Face Trainer's ``checkpoint-N``/``trainer_state.json``: both entry points can share an
output folder, and neither resumes nor prunes the other's checkpoints (the loop refuses a Trainer checkpoint
by name). Rank 0 writes everything into a hidden temporary folder, fsyncs every file and folder, and renames it
into place; ``latest`` is replaced atomically and names a complete checkpoint at every instant, also while a
same-step checkpoint is being replaced. A crash mid-save loses nothing already saved. Every rank contributes
its RNG state (gathered to rank 0), so dropout continues exactly on resume at the same world size; the data
position is a sample count in the epoch's global order, so the data continues exactly on any world size
(``ddp_ft.data.DataLayout``).

Loading executes no code from the checkpoint: every ``.pt`` file holds tensors and plain Python data only (the RNG
states too: Python's and numpy's Mersenne Twister keys are stored as int64 tensors, not pickled objects) and is
read with ``torch.load(weights_only=True)``; the adapter is safetensors. ``verify_checkpoint`` reads all of it
before the model is built and refuses a checkpoint holding anything else.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .data import DataLayout
from .distributed import DistInfo

logger = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
CHECKPOINT_PREFIX = "ddp_ft-checkpoint"
STATE_FILE = "ddp_ft_state.json"
FORMAT_VERSION = 2  # 2: RNG states as tensors and plain data; 1 held pickled numpy arrays
LATEST = "latest"
STAGING_DIR = ".staging"  # where BucketedTrainer's checkpoints are written before they are renamed into place
TRAINER_STATE_FILE = "trainer_state.json"  # the HF Trainer's; ddp_ft <= format 0 used the same name
# Files read by torch.load (weights_only=True), all of them written by save_checkpoint.
TENSOR_FILES = ("optimizer.pt", "scheduler.pt", "rng_states.pt")
SCALER_FILE = "scaler.pt"  # only from float16 runs
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # what peft's save_pretrained writes; its pickled form is .bin
_OWN_NAME = re.compile(rf"^{re.escape(CHECKPOINT_PREFIX)}-(\d+)$")


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
    """This process's RNG states as tensors and plain Python data, so ``torch.load(weights_only=True)`` reads them.

    ``random.getstate()`` is ``(version, 625 ints, gauss_next)``; ``np.random.get_state()`` holds a uint32 array,
    which only a pickle of numpy objects can store, so both keys become int64 tensors (every word fits).

    Returns:
        dict: ``python``, ``numpy``, ``torch`` and, with CUDA, ``cuda`` (this device's generator); ``set_rng_state``
        restores it.
    """
    version, words, gauss_next = random.getstate()
    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    if kind != "MT19937":  # np.random's legacy generator is always MT19937; a changed numpy would need a new format
        raise RuntimeError(f"np.random.get_state() returned a {kind} state; ddp_ft checkpoints store MT19937 only.")
    state = {
        "python": {"version": version, "state": torch.tensor(words, dtype=torch.int64), "gauss_next": gauss_next},
        "numpy": {
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned: the next draws of ``random``, ``np.random``, torch (and CUDA) continue
    exactly where they were when it was taken."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss_next"]))
    numpy = state["numpy"]
    key = numpy["key"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", key, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.random.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Every file and folder under ``root``, then ``root``: the contents are on disk before a rename publishes them."""
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        _fsync(path)
    _fsync(root)


def _write_latest(output_dir: Path, name: str) -> None:
    """Point ``latest`` at ``name`` atomically: readers see the old name or the new one, never a partial file."""
    tmp = output_dir / f".{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output_dir / LATEST)
    _fsync(output_dir)


def _latest_name(output_dir: Path) -> str | None:
    pointer = output_dir / LATEST
    return pointer.read_text().strip() if pointer.exists() else None


def _remove(path: Path) -> None:
    """Delete a folder atomically from a reader's view: renamed out of the way first, then removed."""
    if not path.exists():
        return
    trash = path.with_name(f".trash-{path.name.lstrip('.')}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:  # checkpoint files are never modified in place, so a hard link is a safe copy
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _publish(tmp: Path, final: Path) -> None:
    """Move the complete ``tmp`` to ``final`` and point ``latest`` at it; ``latest`` names a complete checkpoint
    throughout. Replacing ``final`` (same step saved again): ``latest`` moves to a linked copy of the old one
    while ``final`` is swapped, then back."""
    output_dir = final.parent
    if final.exists():
        backup = output_dir / f".old-{final.name}"
        if _latest_name(output_dir) == backup.name:  # left by a save that died mid-swap; final is complete
            _write_latest(output_dir, final.name)
        _remove(backup)
        shutil.copytree(final, backup, copy_function=_link_or_copy)
        _fsync_tree(backup)
        _write_latest(output_dir, backup.name)
        _remove(final)
    os.replace(tmp, final)
    _fsync(output_dir)
    _write_latest(output_dir, final.name)


def publish_folder(tmp: str | Path, final: str | Path) -> None:
    """Move the fully written ``tmp`` to ``final`` atomically (everything fsynced first), replacing ``final``."""
    tmp, final = Path(tmp), Path(final)
    _fsync_tree(tmp)
    _remove(final)
    os.replace(tmp, final)
    _fsync(final.parent)


def _own_checkpoints(output_dir: Path) -> list[Path]:
    """The loop's checkpoints in ``output_dir``, oldest step first: named ``ddp_ft-checkpoint-N`` and holding our
    state file. Anything else (the HF Trainer's ``checkpoint-N``, a user's folder) is never listed."""
    found = []
    for path in output_dir.iterdir():
        match = _OWN_NAME.match(path.name)
        if match and path.is_dir() and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def clean_partial_saves(output_dir: str | Path) -> list[str]:
    """Remove the hidden folders of saves that died half-way (a SIGKILL mid-write), except one ``latest`` still
    names; rank 0 calls it at the start of a run and after every save. Returns the names removed."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    latest = _latest_name(output_dir)
    removed = []
    for prefix in (".tmp-", ".old-", ".trash-"):
        for path in output_dir.glob(f"{prefix}*{CHECKPOINT_PREFIX}-*"):
            if path.name != latest:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
    staging = output_dir / STAGING_DIR
    if staging.is_dir():
        removed += [f"{STAGING_DIR}/{p.name}" for p in staging.iterdir()]
        shutil.rmtree(staging, ignore_errors=True)
    return removed


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
        _fsync_tree(tmp)
        _publish(tmp, final)
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
    protected = {keep.name, _latest_name(output_dir)}
    checkpoints = _own_checkpoints(output_dir)
    for old in [c for c in checkpoints if c.name not in protected][: max(0, len(checkpoints) - limit)]:
        _remove(old)


def checkpoint_to_resume(resume: str, output_dir: str | Path, restart_count: int = 0) -> Path | None:
    """What this run resumes: ``--resume`` (a folder or 'latest'), except after an elastic restart.

    torchrun restarts every rank with ``TORCHELASTIC_RESTART_COUNT`` > 0 and the same arguments; the restarted
    run continues from the newest checkpoint in ``output_dir`` (the one the failed attempt got to), with no flag.
    Before any checkpoint exists a restart starts from ``--resume`` (or from scratch), as the first attempt did.
    """
    if restart_count > 0 and _latest_name(Path(output_dir)) is not None:
        path = resolve_checkpoint("latest", output_dir)
        logger.info("elastic restart %d: resuming from %s", restart_count, path)
        return path
    return resolve_checkpoint(resume, output_dir) if resume else None


_OLD_FORMATS = {  # why this version cannot read a format it once wrote
    1: " (format_version 1 stores numpy's RNG state as pickled numpy objects, and this version loads checkpoints "
    "without executing code)",
}


def resolve_checkpoint(resume: str, output_dir: str | Path) -> Path:
    """Turn ``--resume`` (a folder, or 'latest') into one of the loop's checkpoint folders.

    Raises:
        FileNotFoundError: no such checkpoint, or one missing a file; naming what was looked for and where.
        ValueError: a checkpoint the loop cannot continue: the HF Trainer's, an older ddp_ft format, another
            format_version, a damaged one (state not JSON, a file cut short); naming the path and what it is.
    """
    if resume == "latest":
        name = _latest_name(Path(output_dir))
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
    """The header parses and the file holds every byte the header points to (a truncated copy does not)."""
    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return file.stat().st_size >= 8 + length + end
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        return False


def _check_intact(path: Path, resume: str) -> None:
    """What can be checked without loading anything: the position keys, every file present and not cut short
    (``torch.save`` writes zip archives, whose directory is at the end; safetensors declare their size).

    Raises:
        FileNotFoundError: a file missing. ValueError: a file damaged; both naming it.
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
    """A checkpoint's position and data layout, read without loading anything else (checks before the model)."""
    saved = json.loads((Path(path) / STATE_FILE).read_text())
    state = TrainState(**{k: saved[k] for k in ("global_step", "epoch", "sample_in_epoch", "samples_seen")})
    return state, DataLayout(**saved["layout"]) if saved.get("layout") else None


# What torch names when weights_only refuses a file, e.g. "Unsupported global: GLOBAL numpy...._reconstruct ..."
_REFUSED = re.compile(r"WeightsUnpickler error: ([^\n]*?)(?:\. Please|\.?\n|$)")


def _load_tensors(file: Path, mmap: bool = False) -> object:
    """``torch.load(file, weights_only=True)`` on CPU, turning torch's refusals into errors that name the file.

    Raises:
        ValueError: ``file`` holds something besides tensors and plain Python data (naming what), or is not a
            complete torch.save file.
    """
    damaged = (
        f"checkpoint file {file} cannot be read as a torch.save file ({{}}); the checkpoint is damaged or was "
        "not written by ddp_ft: resume from another checkpoint or start a new run in another --output-dir."
    )
    if not zipfile.is_zipfile(file):  # torch.save's format since torch 1.6; torch's own error would name no file
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


def verify_checkpoint(path: str | Path) -> None:
    """Read every tensor file of the loop's checkpoint ``path`` the way resuming will, before the model is built.

    Each ``.pt`` file is loaded with ``torch.load(weights_only=True)`` on CPU, memory-mapped (the optimizer state
    is not read into memory here): it unpickles tensors and plain Python data and refuses anything else without
    running it. The adapter must be safetensors. So a checkpoint that would need code execution to load fails
    here, naming the file, instead of after minutes of model loading.

    Args:
        path (str | Path): a checkpoint folder ``resolve_checkpoint`` accepted.

    Raises:
        FileNotFoundError: a file resuming needs is missing, naming it.
        ValueError: a file holds pickled objects (naming the file and what it holds), is unreadable, or the adapter
            is pickled (``adapter_model.bin``).
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
    """Restore adapter weights, optimizer, scheduler and this rank's RNG state; return the position.

    Check the data layout first (``saved_position``, ``ddp_ft.data.check_resume``) and the files
    (``verify_checkpoint``): this restores, it does not judge. Every file is read without executing code
    (safetensors, ``torch.load(weights_only=True)``).
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
        # Decided: the data continues exactly (a sample position); the per-rank RNG streams cannot, since there is
        # no way to split or merge them. Rank r continues rank (r % saved ranks)'s stream: dropout masks differ
        # from the uninterrupted run's from here on (with dropout 0 nothing else draws from them).
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
