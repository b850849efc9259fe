"""Atomic publishing: write under a hidden name, fsync, then rename into place.

``latest`` is replaced atomically, so it always names a complete checkpoint.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .state import CHECKPOINT_PREFIX, FINAL_DIR

LATEST = "latest"
STAGING_DIR = ".staging"  # BucketedTrainer's saves, before the rename


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Fsync everything under ``root``, then ``root``, before a rename publishes it."""
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        _fsync(path)
    _fsync(root)


def _write_latest(output_dir: Path, name: str) -> None:
    """Point ``latest`` at ``name`` atomically."""
    tmp = output_dir / f".{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output_dir / LATEST)
    _fsync(output_dir)


def latest_name(output_dir: Path) -> str | None:
    """The checkpoint ``latest`` names; None before the first save."""
    pointer = output_dir / LATEST
    return pointer.read_text().strip() if pointer.exists() else None


def remove_folder(path: Path) -> None:
    """Delete a folder atomically for readers: rename it away, then remove it."""
    if not path.exists():
        return
    trash = path.with_name(f".trash-{path.name.lstrip('.')}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:  # files are never modified in place, so a hard link is safe
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def publish_checkpoint(tmp: Path, final: Path) -> None:
    """Move the complete ``tmp`` to ``final`` and point ``latest`` at it.

    When ``final`` is replaced, ``latest`` names a linked copy of the old one during the swap.
    """
    output_dir = final.parent
    if final.exists():
        backup = output_dir / f".old-{final.name}"
        if latest_name(output_dir) == backup.name:  # left by a save that died mid-swap
            _write_latest(output_dir, final.name)
        remove_folder(backup)
        shutil.copytree(final, backup, copy_function=_link_or_copy)
        fsync_tree(backup)
        _write_latest(output_dir, backup.name)
        remove_folder(final)
    os.replace(tmp, final)
    _fsync(output_dir)
    _write_latest(output_dir, final.name)


def publish_folder(tmp: str | Path, final: str | Path) -> None:
    """Move the fully written ``tmp`` to ``final`` atomically, replacing ``final``."""
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    remove_folder(final)
    os.replace(tmp, final)
    _fsync(final.parent)


def clean_partial_saves(output_dir: str | Path) -> list[str]:
    """Remove hidden folders of saves that died half-way, except one ``latest`` names.

    Returns:
        list[str]: the names removed.
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    latest = latest_name(output_dir)
    removed = []
    for prefix in (".tmp-", ".old-", ".trash-"):
        for path in output_dir.glob(f"{prefix}*{CHECKPOINT_PREFIX}-*"):
            if path.name != latest:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
    for path in (output_dir / f".tmp-{FINAL_DIR}", output_dir / f".trash-{FINAL_DIR}"):  # save_final's
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    staging = output_dir / STAGING_DIR
    if staging.is_dir():
        removed += [f"{STAGING_DIR}/{p.name}" for p in staging.iterdir()]
        shutil.rmtree(staging, ignore_errors=True)
    return removed
