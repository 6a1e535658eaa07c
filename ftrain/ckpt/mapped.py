"""Restore by mapping chunk files copy-on-write: ``CheckpointManager.restore(mmap=True)``.

Why. A plain restore reads every chunk into fresh tensor memory: the kernel copies each
page out of the page cache into pages it must first fault in and zero. An array stored as
one uncompressed chunk is already its tensor's bytes, in order, at offset 0 of its file,
so it can be the tensor: the file is mapped ``MAP_PRIVATE`` (pages shared with the page
cache until written; a write copies that page, the file never changes) and the tensor is a
view of the mapping. The chunk's crc32c is computed over the mapping before restore
returns — that pass is what brings the pages in — so every byte is verified exactly as in
a plain restore, and a mismatch makes the step corrupt (restore falls back) the same way.

What is mapped: uncompressed arrays of one chunk, without padding, of at least
:data:`MAP_MIN_BYTES`. Multi-chunk arrays (a tensor must be one contiguous range),
compressed arrays (the file is not the bytes) and small arrays are read as usual, on the
same threads.

The contract: a mapped tensor reads its checkpoint file for as long as it lives. ftrain
never writes into a committed step's files (a step is replaced by renaming, pruned by
unlinking, and an unlinked file stays readable through the mapping), so that holds for
every file ftrain manages. A file truncated or rewritten *in place* by something else
while its tensors live would change them (or raise ``SIGBUS`` past the new end); use the
plain restore where another program may edit checkpoint files in place, and on network
file systems whose mappings do not promise that.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import crc32c
import torch
from tensordict import TensorDict

from ftrain.ckpt._threads import run_pools
from ftrain.ckpt.format import (
    DIRECT_MIN_BYTES,
    ArraySpec,
    check_crc,
    open_sized,
    parse_dtype,
    read_chunk,
    read_chunk_into,
    read_chunks_into,
)
from ftrain.ckpt.store import allocate_tree, byte_view, check_no_links, check_sizes, selected_specs

__all__ = ["MAP_MIN_BYTES", "mappable", "read_tree_mapped"]

MAP_MIN_BYTES = DIRECT_MIN_BYTES  # smaller arrays are read: a mapping costs ~2 syscalls


def mappable(spec: ArraySpec) -> bool:
    """True when the array's one chunk file holds exactly its bytes (then a tensor can map it).

    Example:
        >>> from ftrain.ckpt.format import plan_array
        >>> mappable(plan_array("w", torch.zeros(256, 1024)))
        True
    """
    return (
        spec.n_chunks == 1
        and spec.compression is None
        and spec.chunk_nbytes == spec.nbytes
        and spec.nbytes >= MAP_MIN_BYTES
    )


def read_tree_mapped(
    root: Path, manifest: dict, *, only: tuple[str, ...] | None, workers: int
) -> TensorDict:
    """:func:`ftrain.ckpt.store.read_tree` with mappable arrays mapped copy-on-write.

    Raises:
        CorruptCheckpointError: any chunk fails verification (size, crc32c, a link).
    """
    specs = selected_specs(manifest, only)
    check_no_links(root)
    check_sizes(root, specs)
    out, tensors = allocate_tree(manifest, specs, only)
    mapped = [k for k, s in specs.items() if mappable(s)]
    reads = []
    for k, s in specs.items():
        if s.n_chunks and k not in mapped:
            reads += read_chunks_into(root, s, byte_view(tensors[k]))
    jobs = [
        (root.joinpath(*k.split("/"), *specs[k].chunk_key(0).split("/")), specs[k]) for k in mapped
    ]
    views, _ = run_pools([(_map_chunk, jobs, workers), (read_chunk, reads, max(1, workers // 2))])
    for k, view in zip(mapped, views, strict=True):
        out[tuple(k.split("/"))] = view
    return out


def _map_chunk(job: tuple[Path, ArraySpec]) -> torch.Tensor:
    """Map one chunk file copy-on-write, verify it, and return the tensor over it."""
    path, spec = job
    n = spec.nbytes
    fd = open_sized(path, n + 4)
    try:
        m = mmap.mmap(fd, n + 4, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:  # a file system that cannot map files: read it like any other chunk
        m = None
    finally:
        os.close(fd)
    if m is None:
        out = torch.empty(spec.shape, dtype=parse_dtype(spec.dtype))
        read_chunk_into(path, byte_view(out), 0, spec.crc32c[0])
        return out
    m.madvise(mmap.MADV_WILLNEED)  # read ahead the whole file: the crc pass then streams
    with memoryview(m) as view:
        crc = crc32c.crc32c(view[:n])
        check_crc(path, crc, int.from_bytes(view[n:], "little"), spec.crc32c[0])
    raw = torch.frombuffer(m, dtype=torch.uint8, count=n)  # keeps the mapping alive
    return raw.view(parse_dtype(spec.dtype)).view(spec.shape)
