"""Restore by mapping chunk files copy-on-write: ``CheckpointManager.restore(mmap=True)``.

Why. A plain restore reads every chunk into fresh tensor memory: the kernel copies each
page out of the page cache into pages it must first fault in and zero. An uncompressed
chunk file is already its slice of the tensor's bytes, in order, at offset 0 of the file,
so it can *be* that slice: each array gets one reserved address range the size of its
tensor, and every chunk file is mapped ``MAP_PRIVATE | MAP_FIXED`` at its chunk's offset in
it (pages shared with the page cache until written; a write copies that page, the file
never changes). The tensor is a view of the range. Every chunk's crc32c is computed over
its mapping before restore returns — that pass is what brings the pages in — so every
byte is verified exactly as in a plain restore, and a mismatch makes the step corrupt
(restore falls back) the same way.

What is mapped: uncompressed arrays of at least :data:`MAP_MIN_BYTES` whose chunks start
on page boundaries (one chunk, or a chunk size that is a multiple of the page size, which
``plan_array`` chooses where that costs little). Compressed arrays (the file is not the
bytes), small arrays and unaligned chunks are read as usual, on the same threads; so are
the smallest mappable arrays past the process's mapping budget (``vm.max_map_count``). A file
system that cannot map a file gets that chunk read into anonymous memory at the same place
in the range, verified the same way.

The contract: a mapped tensor reads its checkpoint files for as long as it lives. ftrain
never writes into a committed step's files (a step is replaced by renaming, pruned by
unlinking, and an unlinked file stays readable through the mapping), so that holds for
every file ftrain manages. A file truncated or rewritten *in place* by something else
while its tensors live would change them (or raise ``SIGBUS`` past the new end); use the
plain restore where another program may edit checkpoint files in place, and on network
file systems whose mappings do not promise that.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from pathlib import Path

import crc32c
import torch
from tensordict import TensorDict

from ftrain.ckpt._threads import run_pools
from ftrain.ckpt.chunkio import (
    check_tail,
    open_sized,
    read_chunk,
    read_chunk_into,
    read_chunks_into,
)
from ftrain.ckpt.format import DIRECT_MIN_BYTES, ArraySpec, parse_dtype
from ftrain.ckpt.reader import (
    allocate_tree,
    byte_view,
    check_memory,
    check_no_links,
    check_sizes,
    chunk_files,
    prefetching,
    selected_specs,
)

__all__ = ["MAP_MIN_BYTES", "mappable", "mapped_bytes", "read_tree_mapped"]

MAP_MIN_BYTES = DIRECT_MIN_BYTES  # smaller arrays are read: a mapping costs ~2 syscalls
PAGE = mmap.PAGESIZE
MAP_FIXED = 0x10  # the same value on Linux, the BSDs and macOS; Python's mmap lacks it
PROT_NONE = 0  # likewise

_libc = ctypes.CDLL(None, use_errno=True)  # ctypes calls release the GIL: chunks map in parallel
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 3, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MAP_FAILED = ctypes.c_void_p(-1).value


def mappable(spec: ArraySpec) -> bool:
    """True when the array's chunk files can be mapped side by side as one tensor:
    uncompressed, at least :data:`MAP_MIN_BYTES`, every chunk starting on a page.

    Example:
        >>> from ftrain.ckpt.format import plan_array
        >>> mappable(plan_array("w", torch.zeros(256, 1024)))
        True
    """
    return (
        spec.n_chunks > 0
        and spec.compression is None
        and spec.nbytes >= MAP_MIN_BYTES
        and (spec.n_chunks == 1 or spec.chunk_nbytes % PAGE == 0)
    )


def read_tree_mapped(
    root: Path, manifest: dict, *, only: tuple[str, ...] | None, workers: int
) -> TensorDict:
    """:func:`ftrain.ckpt.reader.read_tree` with mappable arrays mapped copy-on-write.

    Raises:
        CorruptCheckpointError: any chunk fails verification (size, crc32c, a link).
    """
    specs = selected_specs(manifest, only)
    check_no_links(root)  # first: nothing is opened, not even for a hint, through a link
    with prefetching(chunk_files(root, specs)):
        check_sizes(root, specs, memory=False)
        regions = {k: _Region(specs[k].nbytes) for k in _to_map(specs)}
        # memory for the arrays read into it; a mapped one is the page cache's, not anew
        check_memory(root, {k: s for k, s in specs.items() if k not in regions})
        # destinations only for the arrays that are read: a mapped one is its region
        out, tensors = allocate_tree(
            manifest, {k: specs[k] for k in specs if k not in regions}, only
        )
        reads, maps = [], []
        for k, s in specs.items():
            if k in regions:  # each job holds its region: no range is freed while mapped into
                maps += [(regions[k], _chunk_path(root, s, i), s, i) for i in range(s.n_chunks)]
            elif s.n_chunks:
                reads += read_chunks_into(root, s, byte_view(tensors[k]))
        run_pools([(_map_chunk, maps, workers), (read_chunk, reads, max(1, workers // 2))])
    for k, region in regions.items():
        out[tuple(k.split("/"))] = region.tensor(specs[k])
    return out


def _to_map(specs: dict[str, ArraySpec]) -> list[str]:
    """The mappable arrays, largest first, as many as the process's mapping budget allows.

    Each mapped chunk is one kernel mapping (and may split the reservation into one more),
    and a process may hold only ``vm.max_map_count`` of them (65,530 by default), which
    torch's allocations share: at most half of what is left goes to this restore, and the
    arrays past it are read."""
    budget = (_max_map_count() - _map_count()) // 2
    chosen = []
    for k in sorted(
        (k for k, s in specs.items() if mappable(s)), key=lambda k: (-specs[k].nbytes, k)
    ):
        budget -= 2 * specs[k].n_chunks
        if budget < 0:
            break
        chosen.append(k)
    return chosen


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530  # Linux's default


def _map_count() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _chunk_path(root: Path, spec: ArraySpec, i: int) -> Path:
    return root.joinpath(*spec.key.split("/"), *spec.chunk_key(i).split("/"))


# base address -> size of every region alive (what mapped_bytes() recognises)
_LIVE: dict[int, int] = {}


def mapped_bytes(tensors) -> int:
    """Bytes of ``tensors`` that view a range a mapped restore made (their checkpoint
    files' pages, copy-on-write).

    Example:
        >>> mapped_bytes([torch.zeros(4)])
        0
    """
    return sum(t.nbytes for t in tensors if t.numel() and _region_of(t.data_ptr()) is not None)


def _region_of(addr: int) -> int | None:
    return next((b for b, n in list(_LIVE.items()) if b <= addr < b + n), None)


def _unmap(base: int, size: int) -> None:
    _LIVE.pop(base, None)
    _libc.munmap(base, size)


class _Region:
    """An address range reserved (``PROT_NONE``) for one tensor; chunk files are mapped
    into it in place. Unmapped when the last tensor viewing it is freed."""

    def __init__(self, nbytes: int) -> None:
        self.size = -(-nbytes // PAGE) * PAGE
        self.base = _mmap(0, self.size, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
        self.buffer = (ctypes.c_ubyte * nbytes).from_address(self.base)
        _LIVE[self.base] = self.size
        unmap = weakref.finalize(self.buffer, _unmap, self.base, self.size)
        # never at interpreter exit: a save still writing then may read these tensors, and
        # the process's mappings go with it anyway
        unmap.atexit = False

    def tensor(self, spec: ArraySpec) -> torch.Tensor:
        raw = torch.frombuffer(self.buffer, dtype=torch.uint8)  # keeps the range alive
        return raw.view(parse_dtype(spec.dtype)).view(spec.shape)


def _mmap(addr: int, length: int, prot: int, flags: int, fd: int) -> int:
    """``mmap(2)`` at file offset 0; raises OSError where it fails."""
    got = _libc.mmap(addr or None, length, prot, flags, fd, 0)
    if got == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return got


def _writable_reservation(addr: int, length: int) -> None:
    """Make this chunk's part of the (anonymous, ``PROT_NONE``) reservation writable, to
    read the chunk into. Not a second ``MAP_FIXED`` mapping: a ``MAP_FIXED`` that failed
    may have unmapped the range, and mapping over it again could clobber whatever another
    thread got there meanwhile; ``mprotect`` only ever touches a range that is mapped, and
    fails (``ENOMEM``) if any of it is not."""
    if _libc.mprotect(addr, length, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mapped restore: the reserved range was lost ({os.strerror(err)})")


def _map_chunk(job: tuple[_Region, Path, ArraySpec, int]) -> None:
    """Map chunk ``i`` at its place in the region and verify it over the mapping; a file
    that cannot be mapped is read into anonymous memory there instead, and verified."""
    region, path, spec, i = job
    start, stop = spec.chunk_span(i)
    addr, length, pad = region.base + start, stop - start, spec.chunk_nbytes - (stop - start)
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    view = memoryview(region.buffer)[start:stop]
    fd = open_sized(path, spec.chunk_nbytes + 4)
    try:
        try:
            _mmap(addr, length, rw, mmap.MAP_PRIVATE | MAP_FIXED, fd)
        except OSError:  # a file system that cannot map files: read this chunk instead
            _writable_reservation(addr, length)
            read_chunk_into(path, view, pad, spec.crc32c[i])
            return
        _libc.madvise(addr, length, mmap.MADV_WILLNEED)  # read ahead: the crc pass streams
        check_tail(fd, path, crc32c.crc32c(view), length, pad, spec.crc32c[i])
    finally:
        os.close(fd)
