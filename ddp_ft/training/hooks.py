"""A hook point in every run, inert unless a harness installs one.

The fault tests install hooks that break a real run at fixed points. The library never installs any.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class RunHooks:
    """The points a run calls; each does nothing here."""

    def start(self, global_step: int, accumulation: int) -> None:
        """Training starts after ``global_step`` optimizer steps."""

    def wrap_collate(self, collate: Callable) -> Callable:
        """The collator to use instead of ``collate``."""
        return collate

    def attach(self, model: torch.nn.Module) -> None:
        """Called once on the built model, before it is wrapped."""

    def checkpoint_writing(self, step: int) -> None:
        """Called on every rank before this rank writes a checkpoint."""

    def checkpoint_partly_written(self, step: int) -> None:
        """Called between writing a checkpoint's files and publishing them."""


_installed: RunHooks | None = None


def install_run_hooks(hooks: RunHooks | None) -> None:
    """Make ``hooks`` the ones later runs in this process call; None removes them.

    Args:
        hooks (RunHooks | None): the harness's hooks.
    """
    global _installed
    _installed = hooks


def run_hooks() -> RunHooks:
    """The installed hooks, else ones that do nothing."""
    return _installed if _installed is not None else RunHooks()


def run_hooks_installed() -> bool:
    """Whether a harness installed hooks."""
    return _installed is not None
