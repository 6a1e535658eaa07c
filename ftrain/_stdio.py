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
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys

__all__ = ["printable_streams", "reopen_closed_descriptors"]


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


reopen_closed_descriptors()  # on import: ``import ftrain`` does it before torch's import
