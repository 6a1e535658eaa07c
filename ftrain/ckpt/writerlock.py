"""One writing :class:`~ftrain.ckpt.CheckpointManager` per local checkpoint directory.

Two managers saving into one directory (two processes of a library user, or two managers
in one process) replace each other's steps without a word: each commit of a step the
other wrote moves that copy aside as "another history", and ``restore()`` resumes
whichever wrote last. The CLI's run lock and location claims keep its runs apart; a
manager keeps itself apart by an exclusive ``flock`` on ``DIR/.writer.lock``, taken at its
first :meth:`~ftrain.ckpt.CheckpointManager.save` (a manager that only restores, lists or
verifies takes nothing) and held until :meth:`~ftrain.ckpt.CheckpointManager.close` or
until the manager is collected; the kernel drops it when the process dies. The file names
its holder. Sharded saves, where every rank writes its rows into one store by design, take
no lock; object stores cannot hold one (the CLI's location claim covers them).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

__all__ = ["LOCK_NAME", "CheckpointDirInUseError", "WriterLock"]

LOCK_NAME = ".writer.lock"


class CheckpointDirInUseError(RuntimeError):
    """Another :class:`~ftrain.ckpt.CheckpointManager` is saving into this directory."""


class WriterLock:
    """The writer locks of one manager, one per local directory it has saved into."""

    def __init__(self) -> None:
        self._held: dict[Path, int] = {}

    def claim(self, directory: Path, *, create: bool = True) -> None:
        """Hold ``directory``'s writer lock (idempotent), making the directory if ``create``
        (not a fallback's: it may sit on a volume that is not mounted). A directory that
        cannot hold the lock file (missing, read-only) is left to the save, whose error
        says why.

        Raises:
            CheckpointDirInUseError: another manager, in this process or another, holds it.
        """
        if directory in self._held:
            return
        path = directory / LOCK_NAME
        try:
            if create:
                directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise CheckpointDirInUseError(
                f"{directory} is being written by another CheckpointManager ({holder}): two "
                "writers in one directory replace each other's steps. Close the other manager "
                "first (close() or its with-block), or give each its own directory"
            ) from None
        except OSError:  # a file system without flock: nothing to hold
            os.close(fd)
            return
        _write_holder(fd)
        self._held[directory] = fd

    def release(self) -> None:
        """Empty each lock file (no holder) and drop its flock. Idempotent."""
        while self._held:
            _, fd = self._held.popitem()
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                # unlocked explicitly: a forked child (a DataLoader worker) shares this open
                # file, and closing our descriptor alone would leave the lock to it
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __del__(self) -> None:  # a manager collected without close(): free the directory
        self.release()


def _write_holder(fd: int) -> None:
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "argv": list(sys.argv),
    }
    with contextlib.suppress(OSError):  # who holds it is for the message only
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)


def _holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 65536, 0).decode("utf-8") or "{}")
    except (OSError, ValueError):
        record = {}
    if not isinstance(record, dict) or "pid" not in record:
        return "a holder that did not say who it is"
    if record["pid"] == os.getpid():
        return "one in this process"
    argv = " ".join(map(str, record.get("argv") or []))
    return f"pid {record['pid']} on host {record.get('host')}: {argv}"
