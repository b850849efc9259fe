"""``ddp-ft NAME --nproc N``'s launcher: torch's elastic agent, run in this process.

ddp-ft is the agent, so no torchrun in between can orphan its workers.

- Signals go once to every worker, and Ctrl-C goes on as SIGTERM.
  The exit status is 128 plus the signal's number.
- A console that goes away sends the output to ``<output_dir>/logs/console.log``.
- A failed worker's traceback goes to a file; ddp-ft prints one line and exits 1.

See docs/failures.md.
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

SIGNALS_TO_HANDLE = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1")  # sent on unchanged

logger = logging.getLogger(__name__)


class CtrlC(SignalException):
    """A Ctrl-C while the agent runs, sent on as SIGTERM."""


def _ctrl_c_as_sigterm(signum: int, frame) -> None:
    """Turn SIGINT into SIGTERM for torch's agent."""
    raise CtrlC(f"Process {os.getpid()} got signal: SIGINT (sent on as SIGTERM)", sigval=signal.SIGTERM)


def console() -> logging.Logger:
    """ddp-ft's own plain lines on stderr."""
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def torchrun_args(module: str, nproc: int, argv: list[str]) -> list[str]:
    """torchrun's arguments to run ``module`` on ``nproc`` local workers."""
    handled = ",".join(SIGNALS_TO_HANDLE)
    return ["--standalone", f"--nproc_per_node={nproc}", f"--signals-to-handle={handled}", "-m", module, *argv]


def launch(prog: str, module: str, nproc: int, argv: list[str], failure_dir: str | Path | None = None) -> int:
    """Run ``module`` on ``nproc`` workers under torch's elastic agent.

    Args:
        prog (str): the command named in ddp-ft's lines.
        module (str): the workers' module.
        nproc (int): workers on this machine.
        argv (list[str]): the workers' arguments.
        failure_dir (str | Path | None): where tracebacks go. Default: a temporary folder.

    Returns:
        int: 0, 1 on a failure, or 128 plus the stopping signal.

    Example:
        >>> launch("ddp-ft train", "ddp_ft.commands.train", 2, ["--preset", "tiny"])
    """
    temporary = failure_dir is None
    if temporary:
        import tempfile

        failure_dir = tempfile.mkdtemp(prefix="ddp-ft-failures-")
    try:
        # A lost console must not end the agent while its workers stop.
        with console_or_log(None if temporary else failure_dir):
            return _run_agent(prog, module, nproc, argv, Path(failure_dir))
    finally:
        if temporary and not any(Path(failure_dir).iterdir()):
            os.rmdir(failure_dir)


def _run_agent(prog: str, module: str, nproc: int, argv: list[str], failure_dir: Path) -> int:
    """Run torch's agent with ddp-ft's Ctrl-C handler and last line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    say = console()
    previous = {name: signal.getsignal(getattr(signal, name)) for name in (*SIGNALS_TO_HANDLE, "SIGINT")}
    started = time.time()
    os.environ[FAILURE_DIR_ENV] = str(failure_dir)  # workers inherit it
    try:
        # a job started with Ctrl-C ignored keeps it ignored
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
        for name, handler in previous.items():  # the agent's handlers must not outlive it
            signal.signal(getattr(signal, name), handler)


def failure_line(prog: str, failed, failure_dir: Path, since: float) -> str:
    """One line for a failed launch: the first failed rank, its error, its traceback file.

    Args:
        prog (str): the command named in the line.
        failed (ChildFailedError): torch's error.
        failure_dir (Path): where the workers write tracebacks.
        since (float): the launch's start; older files are ignored.

    Returns:
        str: the line.
    """
    rank, failure = failed.get_first_failure()
    message = failure.message
    if isinstance(message, dict):  # read from the worker's error file
        message = message.get("message", "")
    elif not os.path.isfile(failure.error_file) and failure.exitcode >= 0:
        message = ""  # torch's placeholder for a worker that exited non-zero
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
