"""Hard links of an unchanged leaf's files from the step it was last committed in
(incremental saves, :mod:`ftrain.ckpt.incremental`), each checked before it is linked.

A linked file is one file shared by every step that holds it. A file damaged on disk (bit
rot, a stray write) and linked again was copied forward into every new step under its old
checksum: each save said it succeeded, and once retention had removed the older copies no
step restored. So before a link:

- every chunk file's size is compared with the manifest's (one ``lstat``; opening every
  reused file to read its trailer too cost a third of a LoRA save's time);
- the chunks the save's rotating audit picked (:data:`ftrain.ckpt.incremental.AUDIT_FRACTION`
  of the reused bytes per save) are read whole and hashed (trailer and body);
- a ``zarr.json`` is compared byte for byte with the document it stands for (they are
  small); one with other bytes is written afresh (without a warning: an older ftrain
  wrote the same document pretty-printed).

A file that fails is :data:`DAMAGED`: the writer writes it afresh from the caller's tensor
(or the document) and names it. The new step holds intact bytes; the older steps sharing
the file stay damaged (restore detects it by crc32c; ``python -m ftrain.ckpt verify``
names them).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

import crc32c

__all__ = ["DAMAGED", "LINKED", "UNLINKABLE", "link_chunk", "link_document"]

LINKED, UNLINKABLE, DAMAGED = "linked", "unlinkable", "damaged"
_BLOCK = 4 << 20  # bytes read at a time when a file is hashed whole
_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def link_chunk(src: str, dst: Path, size: int, crc: int, *, whole: bool) -> str:
    """Link the chunk file ``src`` (``size`` bytes with its trailer, crc32c ``crc`` in the
    manifest) to ``dst`` if it checks out: its size, or (``whole``) every byte.

    Returns:
        :data:`LINKED`; :data:`UNLINKABLE` where a link cannot work (another file system, no
        hard links, too many links, a source gone with its step): write it, nothing is
        wrong; :data:`DAMAGED`: the source is not the file the manifest describes.
    """

    if not whole:  # a stat only: opening every reused file cost a third of the save
        try:
            st = os.lstat(src)
        except OSError:
            return UNLINKABLE  # gone with its step (retention, another process)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return DAMAGED
        return _link(src, dst)

    def intact(fd: int, st: os.stat_result) -> bool:
        if st.st_size != size or int.from_bytes(os.pread(fd, 4, size - 4), "little") != crc:
            return False
        return _crc_of(fd, size - 4) == crc

    return _link_if_intact(src, dst, intact)


def link_document(src: str, dst: Path, data: bytes) -> str:
    """Link the ``zarr.json`` ``src`` to ``dst`` if it holds exactly ``data`` (see
    :func:`link_chunk` for what is returned; other bytes are :data:`UNLINKABLE`, not
    damaged: an older ftrain wrote the same document pretty-printed)."""
    got = _link_if_intact(src, dst, lambda fd, _st: os.pread(fd, len(data) + 1, 0) == data)
    return UNLINKABLE if got == DAMAGED else got


def _link_if_intact(src: str, dst: Path, intact: Callable[[int, os.stat_result], bool]) -> str:
    """Open ``src`` (never through a link, never blocking on a FIFO), judge the regular
    file with ``intact(fd, stat)``, and link it if it is."""
    try:
        fd = os.open(src, _FLAGS)
    except OSError as e:  # gone (its step removed meanwhile), or a link: ELOOP
        return DAMAGED if e.errno == errno.ELOOP else UNLINKABLE
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not intact(fd, st):
            return DAMAGED
    except OSError as e:
        return DAMAGED if e.errno == errno.EIO else UNLINKABLE
    finally:
        os.close(fd)
    return _link(src, dst)


def _crc_of(fd: int, n: int) -> int:
    """The crc32c of the first ``n`` bytes of ``fd``; -1 if the file is shorter."""
    crc, off, buf = 0, 0, bytearray(min(_BLOCK, n) or 1)
    view = memoryview(buf)
    while off < n:
        got = os.preadv(fd, [view[: min(_BLOCK, n - off)]], off)
        if got == 0:
            return -1
        crc = crc32c.crc32c(view[:got], value=crc)
        off += got
    return crc


def _link(src: str, dst: Path) -> str:
    """The link itself. Durability: the file's data is already durable (it is committed);
    the new name is made durable with the directory (``syncfs`` or the per-directory
    fsync). ``EXDEV`` (a save that went to the fallback directory), ``EPERM`` (no hard
    links), ``EMLINK`` (too many) and the like: written instead."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        return UNLINKABLE
    return LINKED
