"""Graceful stop on preemption or Ctrl-C: one checkpoint after the step in flight, on every rank.

A signal may reach one rank, some, or all. The handler only records it, since saving needs every rank. The
flags travel in the all-gather after each step's last backward, so all ranks stop at the same step. A
second signal while saving interrupts nothing, except a second Ctrl-C to a lone process. torchrun kills
after ``--shutdown-timeout``; the atomic save keeps the previous checkpoint whole if that happens.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading

from ..distributed.console import write_console

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopSignal:
    """Records SIGTERM, SIGUSR1 and SIGINT instead of dying.

    ``install()`` also asks Linux for SIGTERM when the launcher dies, so an orphan stops gracefully.
    """

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        self._orphan_signal = False
        self._alone = False  # no launcher, one process

    def install(self) -> StopSignal:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("not on the main thread: SIGTERM/SIGUSR1/SIGINT will not stop this run gracefully")
            return self
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._orphan_signal = _launched() and _die_with_parent(signal.SIGTERM)
        self._alone = not _launched() and int(os.environ.get("WORLD_SIZE") or 1) <= 1
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._orphan_signal:
            _die_with_parent(0)
            self._orphan_signal = False

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None and signum == signal.SIGINT and self._alone:
            raise KeyboardInterrupt  # a second Ctrl-C from the user
        if self.received is None:
            again = " (Ctrl-C again interrupts)" if signum == signal.SIGINT and self._alone else ""
            # A signal handler must not take the logging lock: write directly.
            text = f"[pid {os.getpid()}] {name}: stopping after the step in flight, with a checkpoint{again}\n"
            write_console(2, text.encode())
        self.received = self.received or name

    @property
    def local_flag(self) -> float:
        """1.0 once this rank received a stop signal."""
        return 1.0 if self.received else 0.0

    def __enter__(self) -> StopSignal:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


def _launched() -> bool:
    """Whether a launcher started this process; other parents keep their own behaviour."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "ACCELERATE_USE_CPU" in os.environ


def _die_with_parent(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` on Linux; 0 clears it."""
    if not sys.platform.startswith("linux") or (sig and os.getppid() == 1):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        return libc.prctl(pr_set_pdeathsig, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # pragma: no cover - no libc prctl
        logger.debug("PR_SET_PDEATHSIG unavailable")
        return False
