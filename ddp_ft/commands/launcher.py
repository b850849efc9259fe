"""``ddp-ft NAME --nproc N``'s launcher: torch's elastic agent (what ``torchrun --standalone`` runs) in this process.

ddp-ft is the agent, so it owns its workers: there is no torchrun in between that a signal could orphan.

- **Signals.** The agent handles SIGTERM, SIGHUP, SIGQUIT and SIGUSR1 (``--signals-to-handle``; torchrun's default
  leaves out SIGUSR1, SLURM's warning): it sends the signal it received to every worker once and waits
  ``--shutdown-timeout`` (30 s) for them, then SIGKILLs what is left; a second signal while it waits cuts that wait
  and sends SIGTERM, again with 30 s before SIGKILL, as torchrun does. A Ctrl-C (SIGINT) goes the same way, sent on
  as SIGTERM: a worker still importing or joining the group ends quietly of it, where SIGINT would print a
  ``KeyboardInterrupt`` traceback per rank, and a training worker stops after the step in flight with one checkpoint
  (``ddp_ft.training.preemption``), as for SIGTERM. The workers run in sessions of their own (torch starts them with
  ``start_new_session``), so a terminal's Ctrl-C reaches this process only, and each worker gets one signal. ddp-ft
  then prints one line instead of torchrun's ``SignalException`` traceback and exits with 128 + the signal's number
  (130 for Ctrl-C, 143 for SIGTERM), as a process ended by that signal would.
- **A console that goes away.** ``ddp-ft train ... | tee`` and a Ctrl-C end ``tee`` too; ddp-ft and its workers then
  write to ``<output_dir>/logs/console.log`` instead (``ddp_ft.distributed.console``), and the stop goes on.
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

from torch.distributed.elastic.multiprocessing.api import SignalException

from ..distributed import FAILURE_DIR_ENV, traceback_file
from ..distributed.console import console_or_log

SIGNALS_TO_HANDLE = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1")  # torch's agent sends each on as it is

logger = logging.getLogger(__name__)


class CtrlC(SignalException):
    """A Ctrl-C to ddp-ft while the agent runs, which sends it on to the workers as SIGTERM (its ``sigval``)."""


def _ctrl_c_as_sigterm(signum: int, frame) -> None:
    """SIGINT's handler while the agent runs: torch's agent takes it as SIGTERM (sends it, escalates on a repeat)."""
    raise CtrlC(f"Process {os.getpid()} got signal: SIGINT (sent on as SIGTERM)", sigval=signal.SIGTERM)


def console() -> logging.Logger:
    """ddp-ft's own lines on stderr, plain: the launcher has no rank, and torch's loggers keep their own format."""
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
    temporary = failure_dir is None
    if temporary:
        import tempfile

        failure_dir = tempfile.mkdtemp(prefix="ddp-ft-failures-")
    try:
        # A console gone mid-run (`| tee` ended by Ctrl-C) must not end the agent while its workers stop.
        with console_or_log(None if temporary else failure_dir):
            return _run_agent(prog, module, nproc, argv, Path(failure_dir))
    finally:
        if temporary and not any(Path(failure_dir).iterdir()):  # kept when it holds a traceback
            os.rmdir(failure_dir)


def _run_agent(prog: str, module: str, nproc: int, argv: list[str], failure_dir: Path) -> int:
    """``launch``'s body: torch's agent with ddp-ft's Ctrl-C handler and its one last line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    say = console()
    previous = {name: signal.getsignal(getattr(signal, name)) for name in (*SIGNALS_TO_HANDLE, "SIGINT")}
    started = time.time()
    os.environ[FAILURE_DIR_ENV] = str(failure_dir)  # the workers inherit the agent's environment
    try:
        # a job started with Ctrl-C ignored (`cmd &` in a script) keeps it ignored
        if previous["SIGINT"] is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, _ctrl_c_as_sigterm)
        run(parse_args(torchrun_args(module, nproc, argv)))
        return 0
    except SignalException as stop:
        sig = signal.SIGINT if isinstance(stop, CtrlC) else signal.Signals(stop.sigval)
        sent = "" if sig == stop.sigval else f" as {signal.Signals(stop.sigval).name}"
        say.warning("%s: stopped by %s (sent once to every worker%s); exit status %d", prog, sig.name, sent, 128 + sig)
        return 128 + sig
    except ChildFailedError as failed:
        say.error("%s", failure_line(prog, failed, failure_dir, started))
        return 1
    finally:
        os.environ.pop(FAILURE_DIR_ENV, None)
        for name, handler in previous.items():  # the agent's handlers raise SignalException: not after it is done
            signal.signal(getattr(signal, name), handler)


def failure_line(prog: str, failed, failure_dir: Path, since: float) -> str:
    """One line for a failed launch: the first rank that failed, its error's first line, where its traceback is.

    Args:
        failed (ChildFailedError): torch's error, holding every failed worker's ``ProcessFailure``.
        failure_dir (Path): where the workers write their tracebacks.
        since (float): when the launch started (``time.time()``): an older traceback file is a previous run's.

    Returns:
        str: ``PROG: rank R failed: ERROR'S FIRST LINE (full traceback: FILE; N ranks failed, rank R first)``.
    """
    rank, failure = failed.get_first_failure()
    message = failure.message
    if isinstance(message, dict):  # read from the worker's error file: {"message": "Type: text", "extraInfo": ...}
        message = message.get("message", "")
    elif not os.path.isfile(failure.error_file) and failure.exitcode >= 0:
        message = ""  # torch's placeholder ("To enable traceback see: ..."): a worker that exited non-zero itself
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
