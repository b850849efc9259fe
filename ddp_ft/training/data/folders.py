"""A folder as a source: the data files it holds, by split, each read once and all in one format."""

from __future__ import annotations

import csv
import hashlib
import json
import re
from pathlib import Path

from .settings import FILE_BUILDERS

SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}


def folder_files(folder: Path) -> dict[str, list[Path]]:
    """The folder's data files by split, named by a word of their path (``train``, ``validation``, ``test``).

    Files and sub-folders whose names start with a dot are skipped. Without any named file, every file is
    ``train``.

    Raises:
        ValueError: no data file, files of several types, the same content twice, files named by no split beside
            named ones, or no training file; naming the files.
    """
    files = sorted(
        path
        for path in folder.rglob("*")
        if path.is_file()
        and path.suffix.lower() in FILE_BUILDERS
        and not any(part.startswith(".") for part in path.relative_to(folder).parts)
    )
    if not files:
        raise ValueError(f"--source {folder}: the folder holds no {', '.join(FILE_BUILDERS)} file.")
    builders = {FILE_BUILDERS[path.suffix.lower()] for path in files}
    if len(builders) > 1:
        raise ValueError(
            f"--source {folder}: files of several types ({_names(folder, files)}); keep one type, or give one file."
        )
    _refuse_duplicates(folder, files)
    named = {path: _split_of(path.relative_to(folder)) for path in files}
    if not any(named.values()):
        return {"train": files}
    unnamed = [path for path, split in named.items() if split is None]
    if unnamed:
        raise ValueError(
            f"--source {folder}: {_names(folder, unnamed)} belong to no split, beside files that do. Put train, "
            "validation or test in each file's name, or move the others out."
        )
    splits = {split: [path for path in files if named[path] == split] for split in SPLIT_WORDS}
    if not splits["train"]:
        raise ValueError(f"--source {folder}: no training file; name one train.jsonl (or .csv, .json, .parquet).")
    return {split: paths for split, paths in splits.items() if paths}


def _split_of(relative: Path) -> str | None:
    words = [word for part in (*relative.parent.parts, relative.stem) for word in re.split(r"[^a-z0-9]+", part.lower())]
    for word in words:
        for split, names in SPLIT_WORDS.items():
            if word in names:
                return split
    return None


def _refuse_duplicates(folder: Path, files: list[Path]) -> None:
    """Refuse two files of the same content; only files of the same size are read and hashed."""
    by_size: dict[int, list[Path]] = {}
    for path in files:
        by_size.setdefault(path.stat().st_size, []).append(path)
    seen: dict[str, Path] = {}
    for path in (p for same in by_size.values() if len(same) > 1 for p in same):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest in seen:
            raise ValueError(
                f"--source {folder}: {_names(folder, [seen[digest], path])} hold the same data; every row would be "
                "trained twice. Remove one."
            )
        seen[digest] = path


def _names(folder: Path, paths: list[Path]) -> str:
    return ", ".join(str(path.relative_to(folder)) for path in paths)


def file_columns(path: Path) -> list[str]:
    """A data file's columns, read from its first row or header without loading it."""
    builder = FILE_BUILDERS[path.suffix.lower()]
    if builder == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    with path.open(newline="") as f:
        if builder == "csv":
            return next(csv.reader(f), [])
        first = next((line for line in f if line.strip()), "{}")
    try:
        row = json.loads(first)  # JSON lines, in a .jsonl or a .json file
    except json.JSONDecodeError:
        row = json.loads(path.read_text())
    if isinstance(row, list):
        row = row[0] if row else {}
    return list(row) if isinstance(row, dict) else []
