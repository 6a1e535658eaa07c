"""Stop signals that arrive while ``python -m ftrain`` is still importing torch.

The run's own handlers (:mod:`ftrain.signals`) exist only once the CLI runs, seconds after
the process started: a SIGTERM before then ended it with 143 instead of the documented
exit 3, and a Ctrl-C printed a ``KeyboardInterrupt`` traceback from inside the torch
import. For the training command only (never on a library ``import ftrain``), the package
records such signals first thing; the CLI takes them over: a SIGINT is its one-line exit
130, a SIGTERM/SIGUSR1/SIGHUP/SIGQUIT the stop request of the run's start-up. Nothing here imports more
than the standard library.
"""

from __future__ import annotations

import os
import signal
import sys

# ftrain.signals.STOP_SIGNALS and SIGINT (that module imports torch's neighbours; not this one)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT, signal.SIGINT)
_pending: list[int] = []
_previous: dict[int, object] = {}


def _record(signum: int, frame) -> None:
    _pending.append(signum)


def is_training_command(argv: list[str]) -> bool:
    """``python [-u ...] -m ftrain ...`` or the ``ftrain`` console script."""
    if "-m" in argv[1:]:
        i = argv.index("-m", 1)
        return argv[i + 1 : i + 2] == ["ftrain"]
    script = argv[1] if len(argv) > 1 else ""  # the console script sits beside python
    same_bin = os.path.dirname(script) == os.path.dirname(sys.executable)
    return os.path.basename(script) == "ftrain" and same_bin


def install() -> None:
    """Record stop signals from now on (the training command only; main thread)."""
    if _previous or not is_training_command(list(getattr(sys, "orig_argv", []))):
        return
    for sig in SIGNALS:
        _previous[sig] = signal.signal(sig, _record)
    if "FTRAIN_SWEEP_CARRIED" in os.environ:  # ftrain.cli.sweep blocked them across its exec
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def waiting(signals: tuple[int, ...]) -> str | None:
    """The name of the first pending signal of ``signals``, kept for :func:`take` (a sweep
    planning hundreds of jobs asks between them)."""
    first = next((s for s in _pending if s in signals), None)
    return None if first is None else signal.Signals(first).name


def take(signals: tuple[int, ...]) -> list[str]:
    """The names of pending ``signals`` (then forgotten) and their handlers back to what
    they were; the caller installs its own."""
    names = [signal.Signals(s).name for s in _pending if s in signals]
    _pending[:] = [s for s in _pending if s not in signals]
    for sig in signals:
        if sig in _previous:
            signal.signal(sig, _previous.pop(sig))
    return names


install()  # on import, first thing in ftrain/__init__.py
