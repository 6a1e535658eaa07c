"""The file mode a plain ``open`` would give: ``0o666`` less the process's umask.

Files ftrain writes through ``tempfile.mkstemp`` (always 0600) or a library that picks its
own mode (safetensors) get this mode instead, so another user who shares the directory (a
serving process reading an export, a second user of one data cache) can read them as the
umask intends.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["plain_file_mode", "process_umask"]


def process_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``os.umask``
    must set one to read it: another thread creating a file meanwhile got mode 0666)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)  # elsewhere: a safe value for the instant it is set
    os.umask(umask)
    return umask


def plain_file_mode() -> int:
    """``0o666 & ~umask``: what ``open(path, "w")`` creates."""
    return 0o666 & ~process_umask()
