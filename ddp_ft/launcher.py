"""``ddp-ft NAME --nproc N``'s launcher: torch's elastic agent (what ``torchrun --standalone`` runs) in this process.

ddp-ft is the agent, so it owns its workers: there is no torchrun in between that a signal could orphan.

- **Signals.** The agent handles SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGUSR1 (``--signals-to-handle``; torchrun's
  default leaves out SIGUSR1, SLURM's warning). It sends the signal it received to every worker once and waits
  ``--shutdown-timeout`` (30 s) for them, then SIGKILLs what is left; a second signal while it waits cuts that wait
  and sends SIGTERM, again with 30 s before SIGKILL, as torchrun does. The workers run in sessions of their own
  (torch starts them with ``start_new_session``), so a Ctrl-C in the terminal reaches this process only and the
  ranks get one SIGINT, from the agent: they stop after the step in flight with one checkpoint
  (``ddp_ft.preemption``). ddp-ft then prints one line instead of torchrun's ``SignalException`` traceback and exits
  with 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM), as a process ended by that signal would.
- **Failures.** A worker that fails writes its traceback to ``<failure_dir>/rank<R>-traceback.txt`` instead of the
  console (``ddp_ft.distributed.failure_recorded``), and ddp-ft ends with one line: the first rank that failed, its
  error's first line and that file (or torch's error file, when the worker could not write its own). Exit status 1.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

from .distributed import FAILURE_DIR_ENV, traceback_file

SIGNALS_TO_HANDLE = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")

logger = logging.getLogger(__name__)


def _own_logger() -> logging.Logger:
    """This process's lines on stderr, plain: the launcher has no rank and torch's loggers keep their own format."""
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def torchrun_args(module: str, nproc: int, argv: list[str]) -> list[str]:
    """torchrun's command line (after ``torchrun``) that runs ``module`` on ``nproc`` local workers with ``argv``."""
    handled = ",".join(SIGNALS_TO_HANDLE)
    return ["--standalone", f"--nproc_per_node={nproc}", f"--signals-to-handle={handled}", "-m", module, *argv]


def launch(prog: str, module: str, nproc: int, argv: list[str], failure_dir: str | Path | None = None) -> int:
    """Run ``module`` on ``nproc`` workers under torch's elastic agent, in this process; the exit status.

    Args:
        prog (str): the command named in ddp-ft's lines (``ddp-ft train``).
        module (str): the workers' module (``python -m``).
        nproc (int): workers on this machine.
        argv (list[str]): the workers' arguments.
        failure_dir (str | Path | None): where a failing worker writes its traceback. Default: a new temporary folder,
            removed again when it stays empty.

    Returns:
        int: 0 when every worker succeeded, 1 when one failed, 128 + the signal's number when a signal stopped the run.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    say = _own_logger()
    temporary = failure_dir is None
    if temporary:
        import tempfile

        failure_dir = tempfile.mkdtemp(prefix="ddp-ft-failures-")
    previous = {name: signal.getsignal(getattr(signal, name)) for name in SIGNALS_TO_HANDLE}
    started = time.time()
    os.environ[FAILURE_DIR_ENV] = str(failure_dir)  # the workers inherit the agent's environment
    try:
        run(parse_args(torchrun_args(module, nproc, argv)))
        return 0
    except SignalException as stop:
        name = signal.Signals(stop.sigval).name
        say.warning("%s: stopped by %s (sent once to every worker); exit status %d", prog, name, 128 + stop.sigval)
        return 128 + stop.sigval
    except KeyboardInterrupt:  # Ctrl-C before the agent's handlers were installed: no worker had started
        say.warning("%s: interrupted before the workers started; exit status 130", prog)
        return 130
    except ChildFailedError as failed:
        say.error("%s", failure_line(prog, failed, Path(failure_dir), started))
        return 1
    finally:
        os.environ.pop(FAILURE_DIR_ENV, None)
        for name, handler in previous.items():  # the agent's handlers raise SignalException: not after it is done
            signal.signal(getattr(signal, name), handler)
        if temporary and not any(Path(failure_dir).iterdir()):  # kept when it holds a traceback
            os.rmdir(failure_dir)


def failure_line(prog: str, failed, failure_dir: Path, since: float) -> str:
    """One line for a failed launch: the first rank that failed, its error's first line, where its traceback is.

    Args:
        failed (ChildFailedError): torch's error, holding every failed worker's ``ProcessFailure``.
        failure_dir (Path): where the workers write their tracebacks.
        since (float): when the launch started (``time.time()``): an older traceback file is a previous run's.
    """
    rank, failure = failed.get_first_failure()
    message = failure.message
    if isinstance(message, dict):  # read from the worker's error file: {"message": "Type: text", "extraInfo": ...}
        message = message.get("message", "")
    first = next((line.strip() for line in str(message).splitlines() if line.strip()), "")
    own = traceback_file(failure_dir, rank)
    if own.is_file() and own.stat().st_mtime >= since - 1:
        where = f"full traceback: {own}"
    elif failure.error_file and os.path.isfile(failure.error_file):
        where = f"full traceback in torch's error file {failure.error_file}"
    else:
        where = "no traceback recorded: see the output above"
    count = len(failed.failures)
    also = f"; {count} ranks failed, rank {rank} first" if count > 1 else ""
    return f"{prog}: rank {rank} failed: {first or f'exit status {failure.exitcode}'} ({where}{also})"
