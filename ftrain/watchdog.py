"""A hang watchdog: if the loop makes no progress in time, dump stacks, save, exit.

A hung process (a data source blocked on a dead file system, a collective waiting for a
rank that died, a deadlock) never raises, so nothing else ends it. :class:`Watchdog` runs
a daemon thread that the loop *feeds*:

- ``phase(name, state, metrics, safe)`` says where the loop is now (``data``, ``step``,
  ``eval``, ``save``, ...) and which completed state it holds; it does not reset the clock;
- ``beat()`` resets the clock: the loop calls it when a step completed, an evaluation
  returned or a save returned.

So ``timeout_s`` bounds the wait for one batch plus one step, one evaluation and one
blocking save call. Before the first beat the allowance is ``first_timeout_s`` (default
5 x ``timeout_s``): the first step includes CUDA initialisation, ``torch.compile``
warm-up and the loader's first read; so does a wait during which a compile of a new
layout began (:func:`compile_started`: a new batch shape, mid-run).

When the allowance runs out the watchdog

1. writes every thread's stack to ``RUN_DIR/hang-<UTC time>-pid<PID>.txt`` (named
   threads from ``sys._current_frames``, then ``faulthandler``'s raw dump);
2. saves the newest completed state, only if it is consistent: not while a ``donate=True``
   step may be rewriting it in place (``safe=False``), and not while the main thread is
   inside a save itself (a second save beside it could mix or block on it); the state is
   pinned while it is saved (a loop that wakes up meanwhile steps out of place). The save and
   the wait for in-flight commits run in a helper thread bounded by ``save_timeout_s``
   (default ``timeout_s``): a save may hang on the same dead file system;
3. exits the process with :data:`ftrain.signals.EXIT_HUNG` through ``os._exit`` (the main
   thread is stuck, so a normal exit would wait for it forever).

A supervisor (torchrun ``--max-restarts``, systemd, SLURM) restarts the run, which resumes
from the newest committed step. Limitation: the watchdog is a Python thread, so a hang in
C code that holds the GIL also stops the watchdog; ``heartbeat.json`` (rewritten every
step) lets an external supervisor catch that case (see ``docs/fault-tolerance.md``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from tensordict import TensorDictBase

from ftrain.signals import EXIT_HUNG
from ftrain.state.init import pin, unpin

__all__ = ["Watchdog", "compile_started", "dump_stacks", "watch_dynamo_compiles"]

# a poll this much later than asked: the process was stopped, not the loop hung
_POLL_SLACK_S = 2.0
_compiles = [0]  # compiles started in this process; a watchdog compares it at each beat


def compile_started() -> None:
    """A ``torch.compile`` of a new layout begins (:mod:`ftrain.compiled` calls this): the
    wait for the current beat gets ``first_timeout_s``, as the first step's does. A new
    batch shape compiled mid-run took tens of seconds, and a watchdog sized for steps
    called it a hang."""
    _compiles[0] += 1


def _dynamo_compile_started(*_args) -> None:  # older torch calls it with no arguments
    compile_started()


def watch_dynamo_compiles() -> None:
    """Make every Dynamo compile, recompiles included (a guard that failed mid-run: a
    schedule's Python value, a cache filled late), count as :func:`compile_started`, not
    only the compiles :class:`ftrain.compiled.CompiledCore` starts itself.

    Idempotent, and called again at each :meth:`Watchdog.start` and compiled step:
    ``torch._dynamo.reset()`` (user code, a library, a test) clears every registered
    callback, and a recompile after it would otherwise be timed as a hang."""
    from torch._dynamo.callback import callback_handler

    if _dynamo_compile_started not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_dynamo_compile_started)


def dump_stacks(path: str | os.PathLike, header: str = "") -> Path:
    """Write every thread's Python stack to ``path`` (named threads, then faulthandler's).

    Args:
        path: the file to write (its directory is created).
        header: text written first (what was hung, for how long).

    Returns:
        The path written.

    Example:
        >>> import tempfile, pathlib
        >>> p = dump_stacks(pathlib.Path(tempfile.mkdtemp()) / "stacks.txt", "demo")
        >>> "dump_stacks" in p.read_text()
        True
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = {t.ident: t.name for t in threading.enumerate()}
    with open(path, "w", encoding="utf-8") as f:
        f.write(header.rstrip() + "\n\n" if header else "")
        for ident, frame in sys._current_frames().items():
            f.write(f"--- thread {names.get(ident, '?')} (ident {ident}) ---\n")
            f.write("".join(traceback.format_stack(frame)) + "\n")
        f.write("--- faulthandler (all threads, most recent call first) ---\n")
        f.flush()
        # faulthandler writes straight to the descriptor and works even if the
        # interpreter's state is odd; it is the dump to trust if the one above failed
        faulthandler.dump_traceback(file=f, all_threads=True)
    return path


class Watchdog:
    """Ends a run whose loop makes no progress for ``timeout_s`` (see the module docstring).

    Args:
        timeout_s: the longest time allowed between two beats (> 0).
        run_dir: where the stack dump ``hang-<time>-pid<pid>.txt`` goes.
        save: ``save(state, metrics) -> bool``: the final save (commit included), called
            from a helper thread (a string instead of ``False``: why it saved nothing);
            ``None``: never save.
        drain: ``drain()``: wait for saves already in flight (``None``: nothing to wait for);
            called, bounded, even when the final save is skipped.
        on_hang: ``on_hang(info)`` with a dict of what happened, before the exit (a record).
        first_timeout_s: the allowance before the first beat (default ``5 * timeout_s``).
        save_timeout_s: bound on ``save`` + ``drain`` (default ``timeout_s``).
        exit: called with :data:`EXIT_HUNG` at the end (default ``os._exit``; tests replace it).

    Example:
        >>> import tempfile
        >>> wd = Watchdog(60.0, run_dir=tempfile.mkdtemp())
        >>> with wd:
        ...     wd.phase("step", None, {}, safe=True)
        ...     wd.beat()
        >>> wd.fired
        False
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        run_dir: str | os.PathLike,
        save: Callable[[object, dict], bool | str] | None = None,
        drain: Callable[[], object] | None = None,
        on_hang: Callable[[dict], None] | None = None,
        first_timeout_s: float | None = None,
        save_timeout_s: float | None = None,
        exit: Callable[[int], object] = os._exit,
        exit_note: str = "so a supervisor restarts the run",
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.first_timeout_s = float(first_timeout_s or 5 * timeout_s)
        self.save_timeout_s = float(save_timeout_s or timeout_s)
        self.run_dir = Path(run_dir)
        self._save, self._drain, self._on_hang, self._exit = save, drain, on_hang, exit
        self.exit_note = exit_note  # what follows the exit, for its line (a sweep goes on)
        # one tuple, replaced whole: the watchdog thread reads it without a lock
        self._where: tuple[str, object, dict, bool] = ("start", None, {}, False)
        self._last = time.monotonic()
        self._beats = 0
        self._compiles_seen = _compiles[0]
        self._until_beat: float | None = None  # start(allowance_s=...): until the next beat
        self._where_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False
        self.dump_path: Path | None = None

    # -- fed by the loop (cheap: a few attribute stores) ------------------------------
    def phase(self, name: str, state, metrics: dict, *, safe: bool) -> None:
        """The loop enters ``name`` holding ``state`` (saveable now only if ``safe``)."""
        with self._where_lock:
            self._where = (name, state, metrics, safe)

    def beat(self) -> None:
        """Progress: a step completed, or an evaluation or a save returned."""
        self._until_beat = None
        self._last = time.monotonic()
        self._beats += 1
        self._compiles_seen = _compiles[0]

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, allowance_s: float | None = None) -> Watchdog:
        """Start the watchdog thread (the clock starts now) and return self.

        ``allowance_s``: the allowance until the next beat instead of ``timeout_s`` (e.g. a
        whole background write awaited at the end of a run, not one blocking call)."""
        watch_dynamo_compiles()
        self._until_beat = allowance_s
        self._last = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="ftrain-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the loop ended); idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the watchdog thread ------------------------------------------------------------
    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        polled = (time.monotonic(), time.process_time())
        while not self._stop.wait(poll):
            polled = self._discount_unobserved(polled, poll)
            compiling = _compiles[0] != self._compiles_seen  # since the last beat
            allowed = self.timeout_s if self._beats and not compiling else self.first_timeout_s
            allowed = self._until_beat or allowed
            idle = time.monotonic() - self._last
            if idle > allowed:
                try:
                    self._fire(idle, allowed)
                except BaseException as err:  # a failed dump or record must not cancel the exit
                    _say(f"ftrain: hang watchdog: {err!r}; exiting with code {EXIT_HUNG}")
                    self._exit(EXIT_HUNG)
                return

    def _discount_unobserved(self, polled: tuple[float, float], poll: float) -> tuple[float, float]:
        """Time the process was stopped is not counted as idle; returns this poll's (wall,
        CPU) times.

        A poll much later than asked, with the process's CPU clock standing still meanwhile,
        means the whole process was stopped (SIGSTOP/SIGCONT: Ctrl-Z then ``fg``, ``scontrol
        suspend``, a paused VM): the loop could not run either, and it may go on now.
        Counted, such a pause was a hang (exit 4) the moment the process continued. A late
        poll while the CPU clock ran (a C call holding the GIL, busy) counts as before."""
        now, cpu = time.monotonic(), time.process_time()
        unobserved = now - polled[0] - poll
        if unobserved > _POLL_SLACK_S and cpu - polled[1] < unobserved / 2:
            self._last = min(now, self._last + unobserved)
        return now, cpu

    def _fire(self, idle: float, allowed: float) -> None:
        self.fired = True
        with self._where_lock:  # the loop cannot enter a donating step between look and pin
            phase, state, metrics, safe = self._where
            can_save = self._save is not None and state is not None and safe and phase != "save"
            pinned = can_save and isinstance(state, TensorDictBase)
            if pinned:  # a loop that wakes up meanwhile steps out of place, as for an async save
                pin(state)
        step = _step_of(state)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        header = (
            f"ftrain hang watchdog: no progress for {idle:.1f} s (allowed {allowed:g} s) "
            f"at step {step}, phase {phase!r}, pid {os.getpid()}"
        )
        self.dump_path = dump_stacks(self.run_dir / f"hang-{stamp}-pid{os.getpid()}.txt", header)
        _say(f"{header}; stacks in {self.dump_path}")  # the header says "ftrain" once
        saved, error = self._final_save(state, metrics, can_save, pinned)
        info = {
            "step": step,
            "phase": phase,
            "idle_s": round(idle, 3),
            "timeout_s": allowed,
            "dump": str(self.dump_path),
            "saved": saved,
            "save_error": error,
        }
        if self._on_hang is not None:
            _quietly(self._on_hang, info)
        _say(f"{_exit_message(step, phase, saved, error, can_save)} {self.exit_note}")
        self._exit(EXIT_HUNG)

    def _final_save(
        self, state, metrics: dict, can_save: bool, pinned: bool
    ) -> tuple[bool, str | None]:
        """Save (if ``can_save``) and drain in a helper thread, bounded by ``save_timeout_s``."""
        out: dict = {"saved": False, "error": None}

        def work() -> None:
            try:
                if can_save:
                    try:
                        got = self._save(state, metrics)
                        # a string: why nothing was saved (said in the exit line)
                        out["saved"], out["error"] = (
                            (False, got) if isinstance(got, str) else (bool(got), None)
                        )
                    finally:
                        if pinned:
                            unpin(state)
                if self._drain is not None:
                    self._drain()
            except BaseException as err:  # report it; the exit must still happen
                out["saved"], out["error"] = False, repr(err)

        helper = threading.Thread(target=work, name="ftrain-watchdog-save", daemon=True)
        helper.start()
        helper.join(self.save_timeout_s)
        if helper.is_alive():
            return False, f"the final save did not finish within {self.save_timeout_s:g} s"
        return out["saved"], out["error"]


def _step_of(state) -> int | None:
    try:
        return int(state["step"]) if state is not None else None
    except Exception:  # a donated or odd state: the dump still matters more
        return None


def _exit_message(step, phase: str, saved: bool, error: str | None, tried: bool) -> str:
    if saved:
        done = f"saved step {step}"
    elif error:
        done = f"no final save ({error})"
    elif not tried and phase == "save":
        done = "no second save (hung inside a save; the newest committed step stands)"
    elif not tried:
        done = f"no final save (the state is not consistent during {phase!r})"
    else:
        done = (
            f"no new save of step {step} (nothing trained since the run began or restored "
            "it, it is already committed, or another rank writes it)"
        )
    return f"ftrain: {done}; exiting with code {EXIT_HUNG} (hung)"


def _quietly(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except Exception as err:
        _say(f"ftrain: watchdog callback failed: {err!r}")


def _say(message: str) -> None:
    # os.write: the main thread may hold sys.stderr's buffer lock while it hangs
    with contextlib.suppress(OSError):
        os.write(2, (message + "\n").encode())
