"""A console whose reader is gone (``| tee`` ended by Ctrl-C) raises BrokenPipeError at every write. Inside
``console_or_log`` nothing raises: the signal handler's line, log lines, prints and the progress bar go to
``<log_dir>/console.log``."""

import logging
import os
import signal
import sys

import pytest
from tqdm.auto import tqdm

from ddp_ft.distributed.console import console_or_log
from ddp_ft.training.preemption import StopSignal

pytestmark = pytest.mark.faults


def _dead_pipe() -> int:
    """The write end of a pipe whose reader is gone."""
    read, write = os.pipe()
    os.close(read)
    return write


def test_dead_console_writes_go_on_into_the_log_file(tmp_path, monkeypatch):
    dead = open(_dead_pipe(), "w")  # noqa: SIM115 - closed below
    monkeypatch.setattr(sys, "stderr", dead)
    logger = logging.getLogger("test_console")
    handler = logging.StreamHandler(dead)  # made before the block, as torch's are at import
    logger.addHandler(handler)
    try:
        with console_or_log(tmp_path / "logs"):
            logger.warning("a log line")
            print("a print", file=sys.stderr)
            for _ in tqdm(range(2), desc="a bar"):
                pass
        assert sys.stderr is dead and handler.stream is dead
    finally:
        logger.removeHandler(handler)
        dead.close()
    log = (tmp_path / "logs" / "console.log").read_text()
    for line in ("(Broken pipe): its output goes on here", "a log line", "a print", "a bar: 100%"):
        assert line in log, log


def test_signal_with_stderr_gone_recorded_and_logged(tmp_path):
    """The handler writes to fd 2 itself (it must not take a lock). A BrokenPipeError there would surface in the
    middle of the step, and the rank would die without a checkpoint."""
    saved = os.dup(2)
    dead = _dead_pipe()
    os.dup2(dead, 2)
    os.close(dead)
    try:
        with console_or_log(tmp_path / "logs"), StopSignal() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    assert stop.received == "SIGTERM"
    log = (tmp_path / "logs" / "console.log").read_text()
    assert "stderr is gone (Broken pipe)" in log and "SIGTERM: stopping after the step in flight" in log, log
