"""The training command's stdout and stderr are advisory: losing them never stops training.

``python -m ftrain ... | tee log`` whose ``tee`` dies with its ssh session, or output
redirected to a file on a disk that fills: the next progress line raised
``BrokenPipeError`` (or ``OSError(ENOSPC)``) from deep inside the loop, which made an
emergency save and exited 1, and a print during that save recorded a committed save as
failed. The run records (``metrics.jsonl``), the loggers and the checkpoints are where a
run's results live; the console only shows them. :func:`tolerate_lost_console` wraps both
streams while the command runs so that a write or flush that fails is dropped: the first failure is said once on
the other stream (if that one still works), and later output to that stream is discarded.

The wrapper also hands its stream whole lines: ``print`` writes the text and its newline
in two calls, so under torchrun, where the ranks share one terminal or pipe, two ranks'
lines ran together (``...in 0.05s[rank=1][step=5] resumed ...``) and a line-by-line reader
missed both. A partial line waits for its newline or the next ``flush``; whole lines are
flushed through at once, so a block-buffered pipe does not cut one at its 8 KiB boundary.
The prefetch and save threads print too: each thread's partial line is held apart, under a
lock (a re-entrant one: a signal handler's print runs on the thread it interrupted), and the
loss of a stream is announced on the other outside it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

__all__ = ["TolerantStream", "tolerate_lost_console"]

_LONGEST_PARTIAL = 1 << 16  # characters of a line held back for its newline at most


class TolerantStream:
    """A text stream whose writes and flushes never raise ``OSError``: after the first
    failure it drops everything, having said so once on ``other`` (a callable returning
    the other console stream, read when needed)."""

    def __init__(self, inner: TextIO, name: str, other=None) -> None:
        self._inner, self._name, self._other = inner, name, other
        self.lost: OSError | None = None
        # each thread's text after its last newline, not yet handed on: print writes the
        # text and the newline in two calls, and another thread's line may come between
        self._partial: dict[int, str] = {}
        self._lock = threading.RLock()
        self._said = False  # the loss announced on the other stream

    def write(self, text: str) -> int:
        me = threading.get_ident()
        with self._lock:
            if self.lost is None:
                whole, newline, rest = (self._partial.pop(me, "") + text).rpartition("\n")
                if len(rest) > _LONGEST_PARTIAL:  # no newline coming: do not hold it all
                    whole, newline, rest = whole + newline + rest, "", ""
                if rest:
                    self._partial[me] = rest
                if whole or newline:
                    self._hand_on(whole + newline)
        self._announce_loss()
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:  # through write: whole lines, and a lost stream tolerated
            self.write(line)

    def flush(self) -> None:
        with self._lock:
            held, self._partial = "".join(self._partial.values()), {}
            if held:
                self._hand_on(held)
            elif self.lost is None:
                try:
                    self._inner.flush()
                except OSError as err:
                    self.lost = err
        self._announce_loss()

    def _hand_on(self, text: str) -> None:
        """``text`` to the stream and through its buffer (lines whole on the descriptor)."""
        if self.lost is None:
            try:
                self._inner.write(text)
                self._inner.flush()
            except OSError as err:
                self.lost = err

    def _announce_loss(self) -> None:
        """The first failure, said once on the other stream: outside this stream's lock (the
        other stream's write takes its own; both failing at once in two threads would
        otherwise wait on each other)."""
        with self._lock:
            if self.lost is None or self._said:
                return
            self._said, err = True, self.lost
        other = self._other() if self._other is not None else None
        try:
            if other is not None and not getattr(other, "lost", None):
                other.write(
                    f"ftrain: {self._name} is gone ({err.strerror or repr(err)}); training goes on, "
                    f"its output is dropped (metrics.jsonl and the checkpoints are unaffected)\n"
                )
                other.flush()
        except OSError:
            pass

    def isatty(self) -> bool:
        try:
            return self.lost is None and self._inner.isatty()
        except (OSError, ValueError):
            return False

    def __getattr__(self, name: str):  # fileno, encoding, buffer...: the real stream's
        return getattr(self._inner, name)


@contextlib.contextmanager
def tolerate_lost_console() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` wrapped in :class:`TolerantStream` meanwhile (the
    streams found are put back after; nested: once)."""
    if isinstance(sys.stdout, TolerantStream) or sys.stdout is None or sys.stderr is None:
        yield
        return
    saved = sys.stdout, sys.stderr
    sys.stdout = TolerantStream(saved[0], "stdout", lambda: sys.stderr)
    sys.stderr = TolerantStream(saved[1], "stderr", lambda: sys.stdout)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, TolerantStream):
                stream.flush()  # a partial line (a print(..., end="")) is not lost
        sys.stdout, sys.stderr = saved
