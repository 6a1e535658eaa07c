"""Stop requests from signals, honoured at the next step boundary.

SIGTERM, SIGUSR1, SIGHUP, SIGQUIT and SIGINT set a flag; the loop finishes the step it is in, saves a
committed checkpoint, and exits with :data:`EXIT_PREEMPTED`. A *second* SIGINT exits at
once with :data:`EXIT_FORCED`: nothing is corrupted by that, because a checkpoint only
counts once its commit marker is renamed into place (an interrupted save leaves a
``*.tmp-*`` directory that the next start sweeps away).

Exit codes of ``python -m ftrain``:

====  =====================================================================
0     finished ``trainer.max_steps``
1     an error (after an emergency save of the last completed step), or a non-finite
      loss/grad norm with ``trainer.on_nonfinite=stop`` (then *nothing* is saved: the
      newest committed step is the last finite one)
2     bad config or command line (nothing was trained)
3     stopped by SIGTERM/SIGINT/SIGUSR1/SIGHUP/SIGQUIT after a committed save: re-run to
      resume
4     hung: no progress for ``trainer.hang_timeout_s`` (:mod:`ftrain.watchdog`); stacks
      dumped to ``RUN_DIR/hang-*.txt``, the last consistent step saved if possible
130   second SIGINT: immediate exit (the newest *committed* step is intact); also a
      SIGINT during start-up or after the loop (one line, nothing saved by this run)
====  =====================================================================
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType

from ftrain import _early_signals

__all__ = [
    "EXIT_CONFIG",
    "EXIT_ERROR",
    "EXIT_FORCED",
    "EXIT_HUNG",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "STOP_SIGNALS",
    "StopFlag",
    "received",
    "take_received",
]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_PREEMPTED = 3
EXIT_HUNG = 4
EXIT_FORCED = 130

# stop requests: a scheduler's preemption notice (SIGTERM, SIGUSR1), a lost terminal or ssh
# session (SIGHUP), and what torchrun forwards to the ranks when it is itself stopped
# (SIGTERM, SIGHUP, SIGQUIT); their default action killed the run without a save
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT)
_HANDLED = (*STOP_SIGNALS, signal.SIGINT)


_RECEIVED: list[str] = []  # stop signals handled in this process, until taken


def take_received() -> str | None:
    """The first stop signal a :class:`StopFlag` handled since the last call (then
    forgotten), else None. A sweep asks after each job: a SIGTERM during a job's last
    step or final save ends that job normally (exit 0), and the sweep must still stop."""
    first = _RECEIVED[0] if _RECEIVED else None
    _RECEIVED.clear()
    return first


def received() -> str | None:
    """The first stop signal handled since the last :func:`take_received` (kept)."""
    return _RECEIVED[0] if _RECEIVED else None


class StopFlag:
    """Set by a handled signal (or by code); read by the loop at each step boundary.

    Example:
        >>> flag = StopFlag()
        >>> flag.request("test")
        >>> flag.reason
        'test'
    """

    def __init__(self, meaning: str = "finishing this step, saving, then exiting") -> None:
        self.meaning = meaning  # what the run does about it, said when a signal comes
        self._event = threading.Event()
        self.reason: str | None = None
        self._previous: dict[int, object] = {}
        self._interrupted = False  # a SIGINT came (a SIGTERM before it is not a first SIGINT)

    def request(self, reason: str) -> None:
        self.reason = self.reason or reason
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # os.write, not sys.stderr: a handler may interrupt a buffered write to stderr
        if signum == signal.SIGINT and self._interrupted:
            _say("second SIGINT: exiting now; the newest committed checkpoint is intact")
            os._exit(EXIT_FORCED)
        self._interrupted |= signum == signal.SIGINT
        name = signal.Signals(signum).name
        _RECEIVED.append(name)  # for a sweep: the stop outlives this flag (take_received)
        # flag first: a second signal can run its handler in the middle of this one
        if self.requested:  # a second notice, or one while the stop save runs
            _say(f"{name} received: already stopping ({self.reason})")
            return
        self.request(name)
        _say(f"{name} received: {self.meaning}")

    def install(self, signals: tuple[int, ...] = _HANDLED) -> StopFlag:
        """Install handlers for ``signals`` (default SIGTERM, SIGUSR1, SIGHUP, SIGQUIT and
        SIGINT; main thread only, elsewhere a no-op) and return self."""
        if threading.current_thread() is threading.main_thread():
            for name in _early_signals.take(signals):  # came while `python -m ftrain` imported
                _RECEIVED.append(name)  # as if handled here: a sweep stops before its jobs
                self.request(name)
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> StopFlag:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def _say(line: str) -> None:
    """One line to stderr from a signal handler: ``os.write`` (a handler may interrupt a
    buffered write to ``sys.stderr``), and a console gone (a closed terminal's EIO, a dead
    ``| tee``'s EPIPE, a full disk) is ignored: raised from the handler into whatever the
    main thread was doing, it turned a stop into an error (exit 1) or a failed start."""
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())
