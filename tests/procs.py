"""Child-process helpers shared by the tests."""

from __future__ import annotations

import select
import subprocess


def first_line(proc: subprocess.Popen, timeout: float = 120.0) -> str:
    """The first line a child prints on its (text) stdout, waiting at most ``timeout``
    seconds: a child that hangs before its handshake is killed and fails the test instead
    of blocking the suite (call it before anything else reads that pipe)."""
    if not select.select([proc.stdout], [], [], timeout)[0]:
        proc.kill()
        proc.wait()
        raise subprocess.TimeoutExpired(proc.args, timeout)
    return proc.stdout.readline()
