"""Multi-node runs need ``--output-dir`` on a filesystem every node shares; checked at start.

Only global rank 0 writes checkpoints. A node that cannot see them would resume from another position, or
none. So rank 0 writes a random token that every rank reads back, and on resume every rank must reach rank
0's checkpoint. Outcomes are gathered, so every rank raises the same error and none hangs in a collective.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import secrets
import socket
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from ...distributed import DistInfo, restart_count
from .load import refuse_earlier_run

logger = logging.getLogger(__name__)

MARKER_PREFIX = ".ddp_ft-shared-check-"
FIX = (
    "scripts/train.py and recipes/qwen_ami.py need --output-dir (and a --resume folder) on a filesystem shared by "
    "every node (NFS, Lustre, a mounted bucket), at the same path on each: only global rank 0 writes checkpoints, so "
    "a node that cannot see them could not resume."
)


class SharedFilesystemError(RuntimeError):
    """Some ranks cannot see what rank 0 wrote; raised on every rank."""


def node_of(info: DistInfo) -> str:
    """This rank's node rank and hostname, for error messages."""
    group = os.environ.get("GROUP_RANK", "")
    node = int(group) if group.strip() else info.rank // max(1, info.local_world_size)
    return f"node {node} (host {socket.gethostname()})"


def _gather(value: object, info: DistInfo) -> list:
    values = [None] * info.world_size
    dist.all_gather_object(values, value)
    return values


def _describe(rank: int, node: str, problem: str) -> str:
    return f"rank {rank} on {node}: {problem.rstrip('.')}"


def _outcome(action: Callable[[], object]) -> tuple[object, BaseException | None]:
    """(result, None) or (None, the exception), so a failure travels in the gather."""
    try:
        return action(), None
    except Exception as err:  # every rank learns of it through the gather
        return None, err


def check_shared_output_dir(output_dir: str | Path, info: DistInfo) -> None:
    """Refuse a multi-process run whose ranks do not all see ``output_dir`` as rank 0 does.

    Call on every rank, after the process group starts and before the model loads. The token is random per call,
    so a stale file cannot pass.

    Raises:
        SharedFilesystemError: on every rank, naming each rank that failed, or rank 0's write error.
    """
    if not info.is_distributed:
        return
    output_dir = Path(output_dir)
    holder = [secrets.token_hex(16) if info.is_main_process else None]
    dist.broadcast_object_list(holder, src=0)
    token = holder[0]
    marker = output_dir / f"{MARKER_PREFIX}{token}"

    written: BaseException | None = None
    if info.is_main_process:
        _, written = _outcome(lambda: _write_marker(marker, token))
    dist.barrier()  # rank 0's file is fsynced before anyone looks
    seen, error = _outcome(marker.read_text)
    if error is not None:
        problem = f"cannot see it ({type(error).__name__})"
    else:
        problem = None if seen == token else "reads other contents in it"
    written_text = None if written is None else f"{type(written).__name__}: {written}"
    outcomes = _gather((problem, node_of(info), written_text), info)  # after it, rank 0 may remove the file
    if info.is_main_process:
        try:
            marker.unlink(missing_ok=True)
        except OSError as err:  # never fail rank 0 alone
            logger.warning("could not remove %s: %s", marker, err)
    rank0_node, rank0_write_error = outcomes[0][1], outcomes[0][2]
    if rank0_write_error is not None:
        raise SharedFilesystemError(
            f"--output-dir {output_dir}: rank 0 on {rank0_node} could not write a file there ({rank0_write_error})."
        )
    failed = [_describe(rank, node, problem) for rank, (problem, node, _) in enumerate(outcomes) if problem]
    if failed:
        raise SharedFilesystemError(
            f"--output-dir {output_dir} is not the same folder on every rank: rank 0 on {rank0_node} wrote "
            f"{marker.name} there, and {'; '.join(failed)}. {FIX}"
        )


def _write_marker(marker: Path, token: str) -> None:
    marker.parent.mkdir(parents=True, exist_ok=True)
    with open(marker, "w") as f:
        f.write(token)
        f.flush()
        os.fsync(f.fileno())


def _fingerprint(path: Path) -> str:
    """A cheap fingerprint of a checkpoint: file names and sizes, and its JSON files' bytes."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        size = file.stat().st_size
        digest.update(f"{file.relative_to(path)}:{size}\n".encode())
        if file.suffix == ".json" and size < 1 << 20:
            digest.update(file.read_bytes())
    return digest.hexdigest()


def check_shared_resume(resolve: Callable[[], Path | str | None], info: DistInfo) -> Path | None:
    """Resolve the checkpoint to resume on every rank; all must reach rank 0's.

    Args:
        resolve (Callable): finds the checkpoint on this rank's filesystem.
        info (DistInfo): this rank.

    Returns:
        Path | None: the checkpoint, or None.

    Raises:
        Exception: what rank 0's ``resolve`` raised, on every rank.
        SharedFilesystemError: another rank resolved something else, or failed.
    """
    if not info.is_distributed:
        result = resolve()
        return Path(result) if result is not None else None
    found, error = _outcome(lambda: _resolve_with_fingerprint(resolve))
    outcomes = _gather((found, _portable(error), node_of(info)), info)
    first_found, first_error, first_node = outcomes[0]
    if first_error is not None:  # every rank raises rank 0's error
        raise error if info.is_main_process else _rebuild(first_error)
    path = first_found[0] if first_found else None
    failed = []
    for rank, (theirs, their_error, node) in enumerate(outcomes[1:], start=1):
        if their_error is not None:
            failed.append(_describe(rank, node, f"{their_error[1]}: {their_error[2]}"))
        elif theirs is None or path is None:
            if theirs != first_found:
                failed.append(_describe(rank, node, f"resolved {theirs[0] if theirs else 'no checkpoint'}"))
        elif theirs[0] != path:
            failed.append(_describe(rank, node, f"resolved another checkpoint, {theirs[0]}"))
        elif theirs[1] != first_found[1]:
            failed.append(_describe(rank, node, f"sees other files in {path} (names, sizes or state differ)"))
    if failed:
        raise SharedFilesystemError(
            f"the checkpoint to resume is not the same on every rank: rank 0 on {first_node} resumes "
            f"{path or 'nothing'}, but {'; '.join(failed)}. {FIX}"
        )
    return Path(path) if path is not None else None


def _resolve_with_fingerprint(resolve: Callable[[], Path | str | None]) -> tuple[str, str] | None:
    result = resolve()
    if result is None:
        return None
    path = Path(result)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint folder {path}")
    return str(path), _fingerprint(path)


def _portable(error: BaseException | None) -> tuple[str, str, str] | None:
    """An exception as (module, class name, message), safe to gather."""
    return None if error is None else (type(error).__module__, type(error).__qualname__, str(error))


def _rebuild(error: tuple[str, str, str]) -> BaseException:
    """The same exception class and message where possible, else a RuntimeError."""
    module, name, message = error
    try:
        cls = getattr(importlib.import_module(module), name)
        return cls(message)
    except Exception:  # a local class, or other constructor arguments
        return RuntimeError(f"{name}: {message}")


def check_new_run(output_dir: str | Path, resume_from: Path | str | None, info: DistInfo) -> None:
    """A new run (nothing resumed, no torchrun restart): refuse a folder an earlier run filled, on every rank at once,
    so that none writes before all have looked (``load.refuse_earlier_run``)."""
    if resume_from is None and restart_count() == 0:
        check_shared_resume(lambda: refuse_earlier_run(output_dir), info)


def check_output_dir(output_dir: str | Path) -> None:
    """Refuse an ``output_dir`` that is a file or that this user cannot write.

    Raises:
        ValueError: naming ``--output-dir``, what is in the way, and the fix.
    """
    path = Path(output_dir).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    fix = "Give --output-dir a folder you can write to (it is created if missing)."
    if not existing.is_dir():
        where = "is a file" if existing == path else f"cannot be created: {existing} is a file"
        raise ValueError(f"--output-dir {output_dir} {where}. {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" (it would be created in {existing}, which this user cannot write)"
        raise ValueError(f"--output-dir {output_dir}: this user cannot write it{where}. {fix}")


def prepare_output_dir(output_dir: str | Path, info: DistInfo) -> None:
    """Check ``output_dir`` is writable and shared, then clean half-finished saves on rank 0."""
    from . import clean_partial_saves

    check_output_dir(output_dir)
    check_shared_output_dir(output_dir, info)
    if info.is_main_process:
        for name in clean_partial_saves(output_dir):
            logger.warning("removed %s: a checkpoint whose save did not finish", Path(output_dir) / name)
