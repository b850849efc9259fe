"""A hook point in every run, inert unless a harness installs one.

Both training paths call the installed ``RunHooks`` at fixed points: when training starts or resumes, around the data
collator, on the model, and while a checkpoint is written. The fault tests install hooks that break a real run there
(``tests/helpers/faults.py``); the library itself never installs any, and importing it installs nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class RunHooks:
    """The points a run calls; each does nothing here.

    A harness subclasses it and passes an instance to :func:`install_run_hooks` in every process that trains.
    """

    def start(self, global_step: int, accumulation: int) -> None:
        """Training starts after ``global_step`` optimizer steps of ``accumulation`` micro-batches each."""

    def wrap_collate(self, collate: Callable) -> Callable:
        """The collator the run's data loader uses instead of ``collate``."""
        return collate

    def attach(self, model: torch.nn.Module) -> None:
        """Called once on the built model, before it is wrapped."""

    def checkpoint_writing(self, step: int) -> None:
        """Called by ``BucketedTrainer`` on every rank after the ranks meet to save, before this rank writes."""

    def checkpoint_partly_written(self, step: int) -> None:
        """Called by the savers between writing a checkpoint's files and publishing them."""


_installed: RunHooks | None = None


def install_run_hooks(hooks: RunHooks | None) -> None:
    """Make ``hooks`` the ones every later run in this process calls; ``None`` removes them.

    Args:
        hooks (RunHooks | None): the harness's hooks.
    """
    global _installed
    _installed = hooks


def run_hooks() -> RunHooks:
    """The installed hooks, else ones that do nothing."""
    return _installed if _installed is not None else RunHooks()


def run_hooks_installed() -> bool:
    """Whether a harness installed hooks in this process."""
    return _installed is not None
