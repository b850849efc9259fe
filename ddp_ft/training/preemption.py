"""Graceful stop on preemption or Ctrl-C: a signal becomes one checkpoint after the step in flight, on every rank.

SIGTERM (what torchrun, Kubernetes and SLURM send), SIGUSR1 (SLURM's ``--signal`` warning) and SIGINT (Ctrl-C, which
torchrun sends on to every rank; ``ddp-ft --nproc`` sends it on as SIGTERM) may reach one rank, some, or all. The
handler only records the signal: a rank cannot save alone, since saving gathers RNG states from every rank. After
the last backward of the step in flight the ranks share their flags in a collective that already happens there (the
loop's and the Trainer's all-gather of loss and compute time), so they all see the same verdict at the same step,
save one checkpoint and stop. A second signal while saving only sets the flag again: nothing is interrupted
half-way. The one exception is a second Ctrl-C to a process that runs alone (no launcher, one process): the user
insists, and it interrupts.

The launcher's own grace period bounds all this: torchrun sends SIGKILL ``--shutdown-timeout`` seconds (default
30) after forwarding the signal. A step plus one save must fit in it; the checkpoint is atomic, so a SIGKILL mid-save
still leaves the previous one whole.
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
    """Records SIGTERM / SIGUSR1 / SIGINT instead of dying; ``install()`` and ``uninstall()`` pair around training.

    Installing also asks Linux to send this process SIGTERM if its launcher dies (``PR_SET_PDEATHSIG``): a
    launcher that exits without forwarding a signal (``accelerate launch`` of one process does not forward one;
    a killed torchrun cannot) still turns into a graceful stop instead of an orphan training on.
    """

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        self._orphan_signal = False
        self._alone = False  # no launcher and one process: a second Ctrl-C interrupts

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
            raise KeyboardInterrupt  # Ctrl-C twice: no launcher forwards a repeat here, the user pressed it again
        if self.received is None:
            again = " (Ctrl-C again interrupts)" if signum == signal.SIGINT and self._alone else ""
            # A signal handler must not take the logging lock (the interrupted code may hold it): write directly,
            # to the run's log file when the console is gone.
            text = f"[pid {os.getpid()}] {name}: stopping after the step in flight, with a checkpoint{again}\n"
            write_console(2, text.encode())
        self.received = self.received or name

    @property
    def local_flag(self) -> float:
        """1.0 once this rank received a stop signal, for the flag summed over ranks."""
        return 1.0 if self.received else 0.0

    def __enter__(self) -> StopSignal:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


def _launched() -> bool:
    """Started by torchrun / ``accelerate launch`` (whose single-process launcher sets ``ACCELERATE_USE_CPU``), so the
    parent is a launcher: a script run directly, a notebook or a test keeps its own parent-death behaviour."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "ACCELERATE_USE_CPU" in os.environ


def _die_with_parent(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` on Linux (0 clears it); False elsewhere or when the parent already died."""
    if not sys.platform.startswith("linux") or (sig and os.getppid() == 1):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        return libc.prctl(pr_set_pdeathsig, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # pragma: no cover - no libc prctl
        logger.debug("PR_SET_PDEATHSIG unavailable")
        return False
