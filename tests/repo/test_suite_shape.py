"""The suite's own layout: each test file lives in the folder of the room of the package it tests (``tests/ddp/``,
``tests/training/``, ...), or in ``tests/e2e/`` (whole launched runs) or ``tests/repo/`` (checks of the repository);
a file's basename says what it tests without its folder, and a test's name fits a line of a report."""

import ast
from collections import Counter
from pathlib import Path

from .test_layering import ROOMS

TESTS = Path(__file__).resolve().parents[1]
FOLDERS = {*(room for room in ROOMS if not room.startswith("_")), "e2e", "repo"}
LONGEST_NAME = 50


def _test_names(path: Path) -> list[str]:
    """What pytest collects by its default rules: ``test*`` functions, and ``test*`` methods of ``Test*`` classes."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            names.append(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names += [
                f"{node.name}::{item.name}"
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test")
            ]
    return names


def test_test_files_foldered_unique_and_short_named():
    files = sorted(TESTS.rglob("test_*.py"))
    assert files, f"no test files under {TESTS}: the test would pass on nothing"
    misplaced = [f"not directly in a room's folder: {f.relative_to(TESTS)}" for f in files if f.parent.parent != TESTS]
    misplaced += [
        f"in a folder named for no room: {f.relative_to(TESTS)}"
        for f in files
        if f.parent.parent == TESTS and f.parent.name not in FOLDERS
    ]
    twins = [f"basename used twice: {name}" for name, n in Counter(f.name for f in files).items() if n > 1]
    long_names = [
        f"name over {LONGEST_NAME} characters: {f.relative_to(TESTS)}::{name}"
        for f in files
        for name in _test_names(f)
        if len(name.rpartition("::")[2]) > LONGEST_NAME
    ]
    problems = misplaced + twins + long_names
    assert not problems, f"{len(problems)} problems (folders: {sorted(FOLDERS)}):\n" + "\n".join(problems)
