"""Chunk files: written from a tensor's memory, read back into the result, verified.

A chunk file is the raw little-endian payload (plus the padding of an edge chunk) and its
4-byte crc32c, or, compressed, the codec's bytes and their crc32c (the codec chain of
:mod:`ftrain.ckpt.format`). Writes go out with ``os.writev`` straight from the tensor
(``O_DIRECT`` for large raw chunks where the file system allows it); reads go
``readinto`` the destination tensor's bytes and are checked against the manifest's crc
before anything is returned.
"""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import torch

from ftrain.ckpt._direct import direct_supported, write_direct
from ftrain.ckpt.codecs import Codec
from ftrain.ckpt.format import (
    DIRECT_MIN_BYTES,
    ArraySpec,
    CorruptCheckpointError,
    unreadable,
    write_all,
)

__all__ = [
    "check_tail",
    "decode_verified",
    "encode_chunk",
    "open_sized",
    "read_chunk",
    "read_chunk_into",
    "read_chunks_into",
    "tensor_bytes",
    "write_chunk",
]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy little-endian byte view of a CPU tensor (copies only if non-contiguous,
    or to the host if the tensor is on another device)."""
    t = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def encode_chunk(payload: memoryview, pad: int, codec: Codec | None, itemsize: int) -> list:
    """The parts of a chunk file before the crc: raw payload + padding, or compressed."""
    if codec is None:
        return [payload, bytes(pad)] if pad else [payload]
    full = bytes(payload) + bytes(pad) if pad else payload
    return [codec.encode(full, itemsize)]


def write_chunk(
    path: Path,
    payload: memoryview,
    pad: int,
    *,
    durable: bool = True,
    codec: Codec | None = None,
    itemsize: int = 1,
    direct: bool = False,
) -> tuple[int, int]:
    """Write one chunk file: payload and ``pad`` zero bytes (compressed if ``codec``), crc32c.

    Args:
        path: the chunk file (must not exist; created with ``O_EXCL``).
        payload: the real bytes of the chunk.
        pad: zero bytes that fill the edge chunk up to the full chunk size.
        durable: fsync the file before returning.
        codec: compress the full-size chunk with this codec.
        itemsize: element size (blosc shuffles by it).
        direct: write through :func:`ftrain.ckpt._direct.write_direct` (O_DIRECT) where the
            file system allows it; the file is the same either way.

    Returns:
        ``(crc, stored)``: the crc32c in the trailer (of the bytes before it) and the
        number of bytes before it.

    Raises:
        OSError: from the file system (ENOSPC, EIO, EACCES, ...).
    """
    parts = encode_chunk(payload, pad, codec, itemsize)
    size = sum(len(p) for p in parts)
    if direct and size >= DIRECT_MIN_BYTES and direct_supported(path.parent):
        crc = write_direct(path, parts, durable=durable)
        if crc is not None:
            return crc, size
    crc = 0
    for part in parts:
        crc = crc32c.crc32c(part, value=crc)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        write_all(fd, [*parts, crc.to_bytes(4, "little")])
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    return crc, size


def open_sized(path: Path, want: int) -> int:
    """Open a chunk file for reading (never through a link; a FIFO planted in its place
    does not block the open, ``O_NONBLOCK``, and then fails the size check) and check its
    size.

    Raises:
        CorruptCheckpointError: missing, a link, unreadable, or not ``want`` bytes long.
        CheckpointReadError: the machine's limits (:func:`~ftrain.ckpt.format.unreadable`).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:  # missing, a symbolic link (ELOOP), a directory, unreadable
        raise unreadable(path, e, "chunk file cannot be opened") from e
    size = os.fstat(fd).st_size
    if size != want:
        os.close(fd)
        raise CorruptCheckpointError(f"{path}: chunk is {size} bytes, expected {want}")
    return fd


def _read_exact(fd: int, path: Path, dest: memoryview) -> None:
    got = 0
    while got < len(dest):
        try:
            n = os.readv(fd, [dest[got:]])
        except OSError as e:  # EIO, EISDIR
            raise unreadable(path, e, "chunk unreadable") from e
        if n == 0:
            raise CorruptCheckpointError(f"{path}: chunk truncated while reading")
        got += n


def check_crc(path: Path, crc: int, stored: int, expected: int) -> None:
    """Raise CorruptCheckpointError unless the computed, stored and manifest crcs agree."""
    if crc != stored or crc != expected:
        raise CorruptCheckpointError(
            f"{path}: crc32c mismatch (computed {crc:#010x}, stored {stored:#010x}, "
            f"manifest {expected:#010x})"
        )


def read_chunk_into(path: Path, dest: memoryview, pad: int, expected_crc: int) -> None:
    """Read one uncompressed chunk file into ``dest`` and verify its size and crc32c.

    Raises:
        CorruptCheckpointError: missing, truncated or oversized file, or a crc mismatch.
    """
    fd = open_sized(path, len(dest) + pad + 4)
    try:
        _read_exact(fd, path, dest)
        check_tail(fd, path, crc32c.crc32c(dest), len(dest), pad, expected_crc)
    finally:
        os.close(fd)


def check_tail(fd: int, path: Path, crc: int, offset: int, pad: int, expected_crc: int) -> None:
    """Finish verifying an uncompressed chunk whose payload (``offset`` bytes, crc32c
    ``crc``) is checked already: read its ``pad`` bytes and stored crc from ``fd``.

    Raises:
        CorruptCheckpointError: unreadable, short, or a crc mismatch.
    """
    try:
        tail = os.pread(fd, pad + 4, offset)
    except OSError as e:
        raise unreadable(path, e, "chunk unreadable") from e
    crc = crc32c.crc32c(tail[:-4], value=crc) if pad else crc
    stored = int.from_bytes(tail[-4:], "little") if len(tail) == pad + 4 else -1
    check_crc(path, crc, stored, expected_crc)


def read_compressed_into(
    path: Path, dest: memoryview, pad: int, expected_crc: int, stored: int, spec: ArraySpec
) -> None:
    """Read one compressed chunk (``stored`` bytes + crc), verify it, decode into ``dest``.

    Raises:
        CorruptCheckpointError: missing or wrongly sized file, a crc mismatch, or a frame
            that does not decode to the full chunk.
    """
    fd = open_sized(path, stored + 4)
    buf = bytearray(stored + 4)
    try:
        _read_exact(fd, path, memoryview(buf))
    finally:
        os.close(fd)
    decode_verified(path, buf, stored, dest, pad, expected_crc, spec)


def decode_verified(
    where: object,
    raw: bytes | bytearray,
    stored: int,
    dest: memoryview,
    pad: int,
    expected_crc: int,
    spec: ArraySpec,
) -> None:
    """Check the crc32c trailer of one chunk's bytes (``stored`` bytes + 4) against the
    manifest and put its payload into ``dest``: copied when raw, decoded when compressed.
    Shared by the local reader and the object-store reader.

    Raises:
        CorruptCheckpointError: a crc mismatch, or a frame that does not decode in full.
    """
    body = memoryview(raw)[:stored]
    check_crc(where, crc32c.crc32c(body), int.from_bytes(raw[stored:], "little"), expected_crc)
    if spec.compression is None:
        dest[:] = body[: len(dest)]
        return
    full = dest if not pad else memoryview(bytearray(len(dest) + pad))
    try:
        spec.codec.decode_into(body, full, spec.itemsize)  # type: ignore[union-attr]
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from e
    if pad:
        dest[:] = full[: len(dest)]


def read_chunk(job: tuple) -> None:
    """Run one job from :func:`read_chunks_into`."""
    path, dest, pad, crc, stored, spec = job
    if spec.compression is None:
        read_chunk_into(path, dest, pad, crc)
    else:
        read_compressed_into(path, dest, pad, crc, stored, spec)


def read_chunks_into(root: Path, spec: ArraySpec, dest: memoryview) -> list[tuple]:
    """The jobs for :func:`read_chunk` that fill ``dest`` with ``spec``."""
    jobs = []
    for i in range(spec.n_chunks):
        start, stop = spec.chunk_span(i)
        pad = spec.chunk_nbytes - (stop - start)
        path = root.joinpath(*spec.key.split("/"), *spec.chunk_key(i).split("/"))
        stored = spec.stored[i] if spec.compression else None
        jobs.append((path, dest[start:stop], pad, spec.crc32c[i], stored, spec))
    return jobs
