"""Running out of memory, said in one line by every ftrain command.

torch's CPU allocator fails with a plain ``RuntimeError`` (``DefaultCPUAllocator: can't
allocate memory``), a thread that cannot be started with ``RuntimeError: can't start new
thread`` (glibc reserves address space per thread), C++ code with ``std::bad_alloc``: each
was a 25-110 line traceback under a memory or address-space limit (``ulimit -v``, a
container's), read as a crash of ftrain's own. Nothing committed is touched by any of them.
"""

from __future__ import annotations

import errno
import sys
import traceback

__all__ = ["MEMORY_RETRY", "out_of_memory", "said_out_of_memory", "threads_note"]

# what a read-only tool says after it
MEMORY_RETRY = (
    "Nothing was changed: run it again with more memory (a higher memory or address-space "
    "limit, fewer other processes)"
)

# the texts of the failures above; torch.OutOfMemoryError (a device's) says "out of memory"
_SIGNS = ("can't allocate memory", "std::bad_alloc", "can't start new thread", "out of memory")


def out_of_memory(err: BaseException) -> str | None:
    """``err`` (or an error it was raised from) as one line if it is memory running out:
    what ran out and where in ftrain it happened; else ``None``."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if _is_memory(e):
            what = "threads" if "can't start new thread" in str(e) else "memory"
            return f"out of {what}{_where(e)}: {_first_line(e)}"
        e = e.__cause__ or e.__context__
    return None


def _is_memory(e: BaseException) -> bool:
    if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno == errno.ENOMEM):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(sign.lower() in text for sign in _SIGNS)


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


def _where(e: BaseException) -> str:
    """`` in ftrain/x.py:N (function)``: the innermost frame of ftrain's own code."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/ftrain/" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f" in ftrain/{f.filename.rsplit('/ftrain/', 1)[1]}:{f.lineno} ({f.name})"


def said_out_of_memory(prog: str, err: BaseException, fix: str = MEMORY_RETRY) -> bool:
    """Print ``PROG: out of memory ... FIX`` on stderr if ``err`` is memory running out;
    whether it was (else the caller re-raises ``err``)."""
    said = out_of_memory(err)
    if said is None:
        return False
    print(f"{prog}: {said}. {fix}{threads_note(said)}", file=sys.stderr)
    return True


def threads_note(said: str) -> str:
    """For a thread that could not start: the other limit it meets (a user's process count
    counts threads), which "more memory" alone does not name."""
    if not said.startswith("out of threads"):
        return ""
    return (
        ". A thread that cannot start may be the process limit too: raise `ulimit -u` (or a "
        "container's pids limit)"
    )
