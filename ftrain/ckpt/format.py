"""The on-disk format of one step: a plain Zarr v3 group written without zarr-python.

Layout of ``step_00000400/`` (see ``docs/checkpoint-format.md``)::

    zarr.json                     root group; attributes = step metadata (JSON)
    params/zarr.json              one group per nested TensorDict (empty ones included)
    params/w/zarr.json            one array per tensor
    params/w/c/0/0 ... c/3/0      chunks along dim 0, key encoding "default" with "/"
    manifest.json                 arrays, shapes, dtypes, chunk sizes and crc32c values
    COMMITTED                     written last (see :mod:`ftrain.ckpt.commit`)

Every array uses the codec chain ``bytes(little) -> crc32c``, so each chunk file is the
raw little-endian payload followed by its 4-byte crc32c: any Zarr v3 reader verifies
it, and we write it with ``os.writev`` straight from the tensor's memory (no copy) and
read it back with ``readinto`` straight into the result tensor.

Dtypes with a numpy equivalent keep their name. Dtypes without one (``bfloat16`` and the
float8 family) are stored as their raw bits in the unsigned integer of the same width
(``bfloat16`` -> ``uint16``) with ``attributes["ftrain"]["dtype"]`` naming the logical
dtype; a plain reader gets the exact bits, ``ftrain`` gets the tensor back bit-exact.

Chunking: an array is cut along dim 0 into ``n = ceil(nbytes / chunk_bytes)`` chunks of
``ceil(rows / n)`` rows, so the padded edge chunk (Zarr stores edge chunks full size)
wastes fewer than ``n`` rows. Chunk ``i`` covers rows ``[i*r, (i+1)*r)``: a rank can own
a row range and write only its chunks, and a reader can read only the rows it needs.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import torch

__all__ = [
    "FORMAT_VERSION",
    "ArraySpec",
    "CorruptCheckpointError",
    "array_zarr_json",
    "group_zarr_json",
    "plan_array",
    "read_chunks_into",
    "tensor_bytes",
    "write_chunk",
]

FORMAT_VERSION = 1
DEFAULT_CHUNK_BYTES = 32 << 20
_NATIVE = {
    torch.bool: "bool",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}
_RAW_BITS = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


class CorruptCheckpointError(RuntimeError):
    """A checkpoint failed verification: a bad checksum, a missing or truncated chunk, or
    unreadable metadata. The message names the path and the reason."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises ``CorruptCheckpointError`` if unknown."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


def zarr_dtype(dtype: torch.dtype) -> str:
    """The Zarr v3 ``data_type`` that stores ``dtype`` bit-exact (raw bits if no native)."""
    if dtype in _NATIVE:
        return _NATIVE[dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if itemsize not in _RAW_BITS:
        raise TypeError(f"cannot store dtype {dtype} (itemsize {itemsize}) in a checkpoint")
    return _RAW_BITS[itemsize]


@dataclass(frozen=True)
class ArraySpec:
    """Where and how one tensor is stored.

    ``chunk_nbytes`` is the payload size of one full chunk (without the 4-byte crc); a
    chunk file is always ``chunk_nbytes + 4`` bytes long. ``crc32c`` holds one checksum
    per chunk once written (empty in a plan).
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    crc32c: tuple[int, ...] = field(default=())

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=parse_dtype(self.dtype)).element_size()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunk_shape) * self.itemsize

    @property
    def n_chunks(self) -> int:
        if math.prod(self.shape) == 0:
            return 0
        return 1 if not self.shape else math.ceil(self.shape[0] / self.chunk_shape[0])

    def chunk_key(self, i: int) -> str:
        """``"c/3/0/0"`` for chunk 3 of a 3-d array; ``"c"`` for a 0-d array."""
        return "/".join(["c", str(i)] + ["0"] * (len(self.shape) - 1)) if self.shape else "c"

    def chunk_span(self, i: int) -> tuple[int, int]:
        """Byte range ``[start, stop)`` of chunk ``i``'s real payload in the flat tensor."""
        if not self.shape:
            return 0, self.nbytes
        row = self.nbytes // self.shape[0]
        start = i * self.chunk_shape[0] * row
        return start, min(start + self.chunk_nbytes, self.nbytes)

    def to_json(self) -> dict:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunk_shape": list(self.chunk_shape),
            "crc32c": list(self.crc32c),
        }

    @classmethod
    def from_json(cls, key: str, d: dict) -> ArraySpec:
        try:
            spec = cls(
                key,
                str(d["dtype"]),
                tuple(int(x) for x in d["shape"]),
                tuple(int(x) for x in d["chunk_shape"]),
                tuple(int(x) for x in d["crc32c"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"bad manifest entry for {key!r}: {e!r}") from e
        parse_dtype(spec.dtype)
        if len(spec.crc32c) != spec.n_chunks or len(spec.chunk_shape) != len(spec.shape):
            raise CorruptCheckpointError(f"inconsistent manifest entry for {key!r}: {d}")
        return spec


def plan_array(key: str, tensor: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ArraySpec:
    """Choose the chunk shape for ``tensor`` (see the module docstring).

    Example:
        >>> plan_array("w", torch.zeros(10, 4), chunk_bytes=64).chunk_shape
        (4, 4)
    """
    shape = tuple(tensor.shape)
    name = dtype_name(tensor.dtype)
    zarr_dtype(tensor.dtype)  # raises early for dtypes we cannot store
    if not shape:
        return ArraySpec(key, name, shape, ())
    if tensor.numel() == 0:
        return ArraySpec(key, name, shape, tuple(max(1, d) for d in shape))
    nbytes = tensor.numel() * tensor.element_size()
    n = max(1, min(shape[0], math.ceil(nbytes / chunk_bytes)))
    rows = math.ceil(shape[0] / n)
    return ArraySpec(key, name, shape, (rows, *shape[1:]))


def _fill_value(zdtype: str) -> bool | int | float | list[float]:
    if zdtype == "bool":
        return False
    if zdtype.startswith("complex"):
        return [0.0, 0.0]
    return 0.0 if zdtype.startswith("float") else 0


def array_zarr_json(spec: ArraySpec) -> dict:
    """The ``zarr.json`` document of one array (valid Zarr v3 array metadata)."""
    dtype = parse_dtype(spec.dtype)
    zdtype = zarr_dtype(dtype)
    attrs: dict = {"ftrain": {"dtype": spec.dtype}}
    if dtype not in _NATIVE:
        attrs["ftrain"]["encoding"] = f"raw bits of {spec.dtype} stored as {zdtype}"
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(spec.shape),
        "data_type": zdtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(spec.chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": _fill_value(zdtype),
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        "attributes": attrs,
        "storage_transformers": [],
    }


def group_zarr_json(attributes: dict | None = None) -> dict:
    """The ``zarr.json`` document of one group."""
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy little-endian byte view of a CPU tensor (copies only if non-contiguous)."""
    t = tensor.detach().resolve_conj().resolve_neg().contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_all(fd: int, parts: list) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def write_chunk(path: Path, payload: memoryview, pad: int, *, durable: bool = True) -> int:
    """Write one chunk file: payload, ``pad`` zero bytes, crc32c; return the crc.

    Args:
        path: the chunk file (must not exist; created with ``O_EXCL``).
        payload: the real bytes of the chunk.
        pad: zero bytes that fill the edge chunk up to the full chunk size.
        durable: fsync the file before returning.

    Returns:
        The crc32c of payload + padding, as stored in the trailer.

    Raises:
        OSError: from the file system (ENOSPC, EIO, EACCES, ...).
    """
    zeros = bytes(pad)
    crc = crc32c.crc32c(zeros, value=crc32c.crc32c(payload)) if pad else crc32c.crc32c(payload)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _write_all(fd, [payload, zeros, crc.to_bytes(4, "little")])
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    return crc


def read_chunk_into(path: Path, dest: memoryview, pad: int, expected_crc: int) -> None:
    """Read one chunk file into ``dest`` and verify its size and crc32c.

    Raises:
        CorruptCheckpointError: missing, truncated or oversized file, or a crc mismatch.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{path}: chunk file is missing") from e
    try:
        size = os.fstat(fd).st_size
        want = len(dest) + pad + 4
        if size != want:
            raise CorruptCheckpointError(f"{path}: chunk is {size} bytes, expected {want}")
        got = 0
        while got < len(dest):
            n = os.readv(fd, [dest[got:]])
            if n == 0:
                raise CorruptCheckpointError(f"{path}: chunk truncated while reading")
            got += n
        tail = os.pread(fd, pad + 4, len(dest))
    finally:
        os.close(fd)
    crc = crc32c.crc32c(tail[:-4], value=crc32c.crc32c(dest)) if pad else crc32c.crc32c(dest)
    stored = int.from_bytes(tail[-4:], "little") if len(tail) == pad + 4 else -1
    if crc != stored or crc != expected_crc:
        raise CorruptCheckpointError(
            f"{path}: crc32c mismatch (computed {crc:#010x}, stored {stored:#010x}, "
            f"manifest {expected_crc:#010x})"
        )


def read_chunks_into(root: Path, spec: ArraySpec, dest: memoryview) -> list[tuple]:
    """The read jobs ``(path, dest_slice, pad, crc)`` that fill ``dest`` with ``spec``."""
    jobs = []
    for i in range(spec.n_chunks):
        start, stop = spec.chunk_span(i)
        pad = spec.chunk_nbytes - (stop - start)
        path = root.joinpath(*spec.key.split("/"), *spec.chunk_key(i).split("/"))
        jobs.append((path, dest[start:stop], pad, spec.crc32c[i]))
    return jobs


def write_json(path: Path, doc: dict, *, durable: bool = True) -> None:
    """Write a JSON document (new file, ``O_EXCL``), fsync'd when ``durable``."""
    data = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _write_all(fd, [data])
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: Path) -> dict:
    """Read a JSON object; ``CorruptCheckpointError`` if missing, unparseable or not a dict."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: unreadable metadata ({e})") from e
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path}: metadata is not a JSON object")
    return doc
