"""Chunk files written with ``O_DIRECT`` from a page-aligned, per-thread staging buffer.

Direct I/O skips the page cache: no dirty pages to write back at ``syncfs`` time and no
cache pollution, which roughly halves the durable write time of a large state on a
virtio disk (``shared/notes/zarr-io-findings.md``). Tensor memory is not page aligned,
so each thread copies ``BLOCK`` bytes at a time into its aligned buffer (``np.copyto``
releases the GIL), checksums them there while they are cache-hot, and writes them. The
last block is rounded up to the alignment and the file truncated to its real length.

File systems that refuse ``O_DIRECT`` (tmpfs, some FUSE and network mounts: ``EINVAL``
on open or on the first write) are remembered by device id and get buffered writes.
The file contents are identical either way; durability still comes from the caller's
``syncfs`` / ``fsync``.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from pathlib import Path

import crc32c
import numpy as np

__all__ = ["BLOCK", "direct_supported", "write_direct"]

ALIGN = 4096
BLOCK = 8 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_local = threading.local()
_refused: set[int] = set()  # st_dev of file systems that refused O_DIRECT


def direct_supported(directory: Path) -> bool:
    """False where O_DIRECT is unavailable or already refused on this file system."""
    return bool(_O_DIRECT) and os.stat(directory).st_dev not in _refused


def _staging() -> np.ndarray:
    buf = getattr(_local, "buf", None)
    if buf is None:
        m = mmap.mmap(-1, BLOCK + ALIGN)  # anonymous mappings are page aligned
        buf = _local.buf = np.frombuffer(m, dtype=np.uint8)
    return buf


def _stream(fd: int, parts: list, buf: np.ndarray) -> tuple[int, int]:
    """Copy ``parts`` through ``buf`` into ``fd`` in full blocks; return (crc, fill)."""
    crc, fill = 0, 0
    for part in parts:
        src = np.frombuffer(part, dtype=np.uint8)
        while len(src):
            n = min(len(src), BLOCK - fill)
            np.copyto(buf[fill : fill + n], src[:n])
            crc = crc32c.crc32c(buf[fill : fill + n], value=crc)
            fill, src = fill + n, src[n:]
            if fill == BLOCK:
                _write_full(fd, buf[:BLOCK])
                fill = 0
    return crc, fill


def _write_full(fd: int, view: np.ndarray) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


def write_direct(path: Path, parts: list, *, durable: bool = False) -> int | None:
    """Write ``parts`` then their crc32c (little-endian) to the new file ``path``
    (fsync'd if ``durable``).

    Returns:
        The crc32c, or ``None`` if the file system refuses O_DIRECT (no file is left
        behind; the caller writes it buffered).

    Raises:
        OSError: any other file system error (ENOSPC, EIO, EEXIST, ...).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        # Linux creates the file before it refuses O_DIRECT (tmpfs before 6.6, ramfs, some
        # FUSE mounts): the buffered retry's O_EXCL open would then fail with EEXIST
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        _refused.add(os.stat(path.parent).st_dev)
        return None
    try:
        buf = _staging()
        crc, fill = _stream(fd, parts, buf)
        total = os.lseek(fd, 0, os.SEEK_CUR) + fill + 4
        buf[fill : fill + 4] = np.frombuffer(crc.to_bytes(4, "little"), dtype=np.uint8)
        end = -(-(fill + 4) // ALIGN) * ALIGN
        buf[fill + 4 : end] = 0
        _write_full(fd, buf[:end])
        os.ftruncate(fd, total)
        if durable:
            os.fsync(fd)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        if e.errno != errno.EINVAL:
            raise
        _refused.add(os.stat(path.parent).st_dev)
        return None
    os.close(fd)
    return crc
