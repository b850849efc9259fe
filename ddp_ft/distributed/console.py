"""stdout and stderr that outlive their console: ``console_or_log(log_dir)`` around a run.

When ``tee`` or the terminal dies, Python's ignored SIGPIPE makes every later write raise.
Inside ``console_or_log`` the first failed write points the dead descriptor at ``<log_dir>/console.log``.
Later writes, children's too, go there.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CONSOLE_LOG = "console.log"

_log_file: Path | None = None  # where a dead console's output goes; set by console_or_log
_diverted: set[int] = set()  # descriptors already pointed at it


def write_console(fd: int, data: bytes) -> None:
    """Write ``data`` whole to ``fd`` without raising; lock-free, so signal handlers may call it."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except OSError as error:
            if not _divert(fd, error):
                return


def _divert(fd: int, error: OSError) -> bool:
    """Point ``fd`` at the log file or ``/dev/null``, once; False if already done."""
    if fd in _diverted:
        return False
    _diverted.add(fd)
    new = None
    if _log_file is not None:
        try:
            _log_file.parent.mkdir(parents=True, exist_ok=True)
            new = os.open(_log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError:  # an unwritable folder: dropped, as without one
            pass
    logged = new is not None
    new = new if logged else os.open(os.devnull, os.O_WRONLY)
    os.dup2(new, fd)
    os.close(new)
    if logged:
        name = {1: "stdout", 2: "stderr"}.get(fd, f"descriptor {fd}")
        write_console(fd, f"[pid {os.getpid()}] {name} is gone ({error.strerror}): its output goes on here\n".encode())
    return True


class _ConsoleRaw(io.RawIOBase):
    """A console descriptor written through ``write_console``; closing it leaves the descriptor open."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def write(self, data) -> int:
        write_console(self._fd, bytes(data))
        return len(data)


def _guarded(stream):
    """``stream`` as a line-buffered text stream over ``_ConsoleRaw``; one without a descriptor is returned as is."""
    try:
        fd = stream.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # None, closed, or in memory
        return stream
    try:
        stream.flush()
    except OSError as error:  # already gone: what it holds goes to the log file
        _divert(fd, error)
        try:
            stream.flush()
        except OSError:
            pass
    buffered = io.BufferedWriter(_ConsoleRaw(fd))
    return io.TextIOWrapper(buffered, encoding=stream.encoding, errors=stream.errors, line_buffering=True)


@contextmanager
def console_or_log(log_dir: str | os.PathLike | None) -> Iterator[None]:
    """Make ``sys.stdout``, ``sys.stderr`` and their logging handlers write to ``<log_dir>/console.log`` once dead.

    Enter it before a progress bar takes ``sys.stderr``.

    Args:
        log_dir (str | os.PathLike | None): the run's log folder; None drops a dead console's output.

    Example:
        >>> with console_or_log("runs/demo"):
        ...     train()
    """
    global _log_file, _diverted
    previous = sys.stdout, sys.stderr, _log_file, _diverted
    _log_file, _diverted = Path(log_dir) / CONSOLE_LOG if log_dir is not None else None, set()
    sys.stdout, sys.stderr = guarded = _guarded(sys.stdout), _guarded(sys.stderr)
    handlers = _repoint_handlers(dict(zip(map(id, previous[:2]), guarded, strict=True)))
    try:
        yield
    finally:
        for stream, before in zip(guarded, previous, strict=False):
            if stream is not before:
                stream.flush()  # a guarded stream never raises
        for handler, stream in handlers:
            handler.stream = stream
        sys.stdout, sys.stderr, _log_file, _diverted = previous


def _repoint_handlers(replacements: dict[int, object]) -> list[tuple[logging.StreamHandler, object]]:
    """Point logging handlers holding a replaced stream, such as torch's, at its replacement; return the old pairs."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    handlers = {h for lg in loggers if isinstance(lg, logging.Logger) for h in lg.handlers}
    changed = []
    for handler in handlers:
        if isinstance(handler, logging.StreamHandler) and id(handler.stream) in replacements:
            changed.append((handler, handler.stream))
            handler.stream = replacements[id(handler.stream)]
    return changed
