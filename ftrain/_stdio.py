"""Standard streams a command can always write to. Nothing here imports more than the
standard library.

- A closed descriptor 0, 1 or 2 (``python -m ftrain ... >&-``, ``2>&-``, a supervisor that
  closes them) is given ``/dev/null``: otherwise the next file ftrain opens takes that
  number (the run lock became descriptor 2, and what torch or C code wrote to stderr went
  into the lock file), and Python's ``sys.stdout`` is ``None``, which the progress line
  wrote to (an ``AttributeError`` at step 1 of every start).
- Text a stream cannot encode (``PYTHONIOENCODING=ascii``, a C locale, with a run
  directory named ``ü``) is written escaped (``\\xfc``) instead of raising
  ``UnicodeEncodeError`` out of a resume, an export or a listing.
- A tool whose standard output goes away (``... | head``) or cannot be written (``>
  /dev/full``, a full disk) ends with exit 1: silently for a reader that left, as ``cat``
  does, else one line on stderr; before, a 15-line traceback (:func:`run_tool`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Callable

__all__ = ["printable_streams", "reopen_closed_descriptors", "run_tool"]


def reopen_closed_descriptors() -> None:
    """Open ``/dev/null`` on each of descriptors 0, 1, 2 that is closed (the lowest free
    number is the one taken, so this fills them in order)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError as err:
            if err.errno != errno.EBADF:
                continue
            with contextlib.suppress(OSError):
                got = os.open(os.devnull, os.O_RDWR)
                if got != fd:  # a lower one was free after all: leave things as they were
                    os.close(got)


def printable_streams() -> None:
    """For a command's ``main``: ``sys.stdout``/``sys.stderr`` that are ``None`` write to
    ``/dev/null``; the others escape what their encoding cannot hold."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115
            continue
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(errors="backslashreplace")


class _OutputGone(OSError):
    """Standard output could not be written (the ``OSError`` is the cause). An ``OSError``
    still, so a tool's own ``except OSError`` around a line it prints (the drill's
    interrupt message) goes on as before; :func:`run_tool` tells it apart by type."""


class _Guarded:
    """A stream whose write and flush errors are :class:`_OutputGone`, told apart from an
    ``OSError`` of the tool's own work (an unreadable checkpoint file) by type."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def _guard(self, name: str, *args):
        try:
            return getattr(self._stream, name)(*args)
        except _OutputGone:
            raise
        except OSError as err:
            raise _OutputGone(err.errno, err.strerror) from err

    def write(self, data):
        return self._guard("write", data)

    def writelines(self, lines):
        return self._guard("writelines", lines)

    def flush(self):
        return self._guard("flush")

    @property
    def buffer(self):  # bytes written straight to it (a path printed as its bytes)
        return _Guarded(self._stream.buffer)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def run_tool(main: Callable[[], int], name: str) -> int:
    """``main()`` of the command ``name`` with :func:`printable_streams`, and its exit
    status; 1 if its standard output went away or could not be written (a status of its
    own that says more, say an interrupted drill's 130, is kept)."""
    printable_streams()
    stdout = sys.stdout
    sys.stdout = _Guarded(stdout)
    status = 1
    try:
        status = main()
        sys.stdout.flush()
        return status
    except _OutputGone as gone:
        _output_gone(gone, name, stdout)
        return status or 1
    finally:
        sys.stdout = stdout


def _output_gone(gone: _OutputGone, name: str, stdout) -> None:
    # what is still buffered would fail again at exit: let it go to /dev/null
    os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
    err = gone.__cause__
    if not isinstance(err, BrokenPipeError):  # a reader that left is no error to report
        with contextlib.suppress(OSError):  # stderr gone with it (a hung-up terminal)
            print(f"{name}: cannot write the output: {err.strerror or err}", file=sys.stderr)


reopen_closed_descriptors()  # on import: ``import ftrain`` does it before torch's import
