"""The on-disk format of one step: a plain Zarr v3 group written without zarr-python.

Layout of ``step_00000400/`` (see ``docs/checkpoint-format.md``)::

    zarr.json                     root group; attributes = step metadata (JSON), and the
                                  consolidated metadata of every node (``documents``)
    params/zarr.json              one group per nested TensorDict (empty ones included)
    params/w/zarr.json            one array per tensor
    params/w/c/0/0 ... c/3/0      chunks along dim 0, key encoding "default" with "/"
    manifest.json                 arrays, shapes, dtypes, chunk sizes and crc32c values
    COMMITTED                     written last (see :mod:`ftrain.ckpt.commit`)

Every array uses the codec chain ``bytes(little) -> crc32c``, so each chunk file is the
raw little-endian payload followed by its 4-byte crc32c: any Zarr v3 reader verifies
it, and we write it with ``os.writev`` straight from the tensor's memory (no copy) and
read it back with ``readinto`` straight into the result tensor. With optional compression
(:mod:`ftrain.ckpt.codecs`) the chain is ``bytes -> zstd|blosc -> crc32c``: the file is the
compressed chunk plus the crc32c of the compressed bytes, and the manifest records the
codec and every chunk's stored size.

Dtypes with a numpy equivalent keep their name. ``bfloat16``, ``float8_e4m3fn`` and
``float8_e5m2`` use the data types tensorstore and Orbax write (zarr-extensions), which
:mod:`ftrain.ckpt.zdtype` teaches zarr-python (format 2). Format 1 stored them, and every
format stores the other dtypes numpy lacks (the float8 ``fnuz``/``e8m0`` variants,
``complex32``, ...), as their raw bits in the unsigned integer of the same width
(``bfloat16`` -> ``uint16``). ``attributes["ftrain"]["dtype"]`` names the logical dtype of
every array; the chunk bytes are the same either way.

Chunking: an array is cut along dim 0 into ``n = ceil(nbytes / chunk_bytes)`` chunks of
``ceil(rows / n)`` rows, so the padded edge chunk (Zarr stores edge chunks full size)
wastes fewer than ``n`` rows. Chunk ``i`` covers rows ``[i*r, (i+1)*r)``: a rank can own
a row range and write only its chunks, and a reader can read only the rows it needs.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import torch

from ftrain.ckpt._direct import direct_supported, write_direct
from ftrain.ckpt.codecs import Codec, parse_compression
from ftrain.ckpt.zdtype import ZDTYPES

__all__ = [
    "FORMAT_VERSION",
    "READABLE_FORMATS",
    "ArraySpec",
    "CheckpointFormatError",
    "CorruptCheckpointError",
    "array_zarr_json",
    "check_key",
    "decode_verified",
    "read_bytes_nofollow",
    "group_zarr_json",
    "plan_array",
    "read_chunk",
    "read_chunks_into",
    "tensor_bytes",
    "write_chunk",
]

FORMAT_VERSION = 2
# formats this ftrain restores; anything else is refused. 1: bf16/float8 as raw-bit integers
READABLE_FORMATS = frozenset({1, 2})
DEFAULT_CHUNK_BYTES = 32 << 20
DIRECT_MIN_BYTES = 256 << 10  # smaller chunks go through the page cache (one syncfs)
MAX_NDIM = 32
MAX_DIM = 1 << 50  # a bound on any count or byte size read from metadata (1 PiB)
MAX_LIST = 1 << 24  # a bound on any list in one manifest entry (chunks per array)
RESERVED_NAMES = frozenset({"zarr.json"})  # a node of this name would clash with the layout
MAX_JSON_BYTES = 256 << 20  # no metadata document is this large; refuse before reading it
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
# torch's names are the ml_dtypes / tensorstore names: bfloat16, float8_e4m3fn, float8_e5m2
_ML_FLOATS = {getattr(torch, z._zarr_v3_name): z._zarr_v3_name for z in ZDTYPES}


class CorruptCheckpointError(RuntimeError):
    """A checkpoint failed verification: a bad checksum, a missing or truncated chunk, or
    unreadable metadata. The message names the path and the reason."""


class CheckpointFormatError(RuntimeError):
    """A step was written in a format this ftrain cannot read (e.g. by a newer ftrain).

    Not a corruption: such a step is never skipped, set aside or deleted; the run stops
    and says which ftrain wrote it."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises ``CorruptCheckpointError`` if unknown."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


def zarr_dtype(dtype: torch.dtype, fmt: int = FORMAT_VERSION) -> str:
    """The Zarr v3 ``data_type`` that stores ``dtype`` bit-exact in format ``fmt`` (raw
    bits where zarr has no name for it, or format 1 had none).

    Example:
        >>> zarr_dtype(torch.bfloat16), zarr_dtype(torch.bfloat16, fmt=1)
        ('bfloat16', 'uint16')
    """
    if dtype in _NATIVE:
        return _NATIVE[dtype]
    if dtype in _ML_FLOATS and fmt > 1:
        return _ML_FLOATS[dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if itemsize not in _RAW_BITS:
        raise TypeError(f"cannot store dtype {dtype} (itemsize {itemsize}) in a checkpoint")
    return _RAW_BITS[itemsize]


@dataclass(frozen=True)
class ArraySpec:
    """Where and how one tensor is stored.

    ``chunk_nbytes`` is the payload size of one full chunk (without the 4-byte crc); an
    uncompressed chunk file is always ``chunk_nbytes + 4`` bytes long, a compressed one
    ``stored[i] + 4``. ``crc32c`` holds one checksum per chunk once written (empty in a
    plan); ``compression`` is the canonical codec spec (``"zstd:1"``) or ``None``.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    crc32c: tuple[int, ...] = field(default=())
    compression: str | None = None
    stored: tuple[int, ...] = field(default=())
    separator: str = "/"

    @property
    def codec(self) -> Codec | None:
        return parse_compression(self.compression)

    @property
    def itemsize(self) -> int:
        return parse_dtype(self.dtype).itemsize

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
        """``"c.3.0.0"`` for chunk 3 of a 3-d array (``"c/3/0/0"`` with separator ``/``,
        as written before ``"."`` saved a directory level); ``"c"`` for a 0-d array."""
        parts = ["c", str(i)] + ["0"] * (len(self.shape) - 1)
        return self.separator.join(parts) if self.shape else "c"

    def chunk_span(self, i: int) -> tuple[int, int]:
        """Byte range ``[start, stop)`` of chunk ``i``'s real payload in the flat tensor."""
        if not self.shape:
            return 0, self.nbytes
        row = self.nbytes // self.shape[0]
        start = i * self.chunk_shape[0] * row
        return start, min(start + self.chunk_nbytes, self.nbytes)

    def to_json(self) -> dict:
        doc = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunk_shape": list(self.chunk_shape),
            "crc32c": list(self.crc32c),
        }
        if self.compression is not None:
            doc |= {"compression": self.compression, "stored_nbytes": list(self.stored)}
        if self.separator != "/":
            doc["chunk_key_separator"] = self.separator
        return doc

    @classmethod
    def from_json(cls, key: str, d: object) -> ArraySpec:
        """Parse and validate one manifest entry; every field is checked before use.

        Raises:
            CorruptCheckpointError: a bad key, type, dtype, shape, chunk shape, checksum
                list or codec — the message names the entry and the field.
        """
        check_key(key)
        if not isinstance(d, dict):
            raise CorruptCheckpointError(f"manifest entry for {key!r} is not an object")
        try:
            spec = cls(
                key,
                _str_field(d, "dtype"),
                _int_list(d, "shape", 0, MAX_DIM),
                _int_list(d, "chunk_shape", 1, MAX_DIM),
                _int_list(d, "crc32c", 0, 0xFFFFFFFF),
                d.get("compression"),
                _int_list(d, "stored_nbytes", 0, MAX_DIM, default=[]),
                d.get("chunk_key_separator", "/"),
            )
            spec.codec  # noqa: B018 - raises ValueError for an unknown codec
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptCheckpointError(f"bad manifest entry for {key!r}: {e!r}") from e
        spec._check_geometry(d)
        return spec

    def _check_geometry(self, d: dict) -> None:
        key = self.key
        dtype = parse_dtype(self.dtype)
        zarr_dtype(dtype)  # a dtype the format cannot hold is not ours
        if len(self.shape) > MAX_NDIM or len(self.chunk_shape) != len(self.shape):
            raise CorruptCheckpointError(f"inconsistent manifest entry for {key!r}: {d}")
        if math.prod(self.shape) * self.itemsize > MAX_DIM or self.chunk_nbytes > MAX_DIM:
            raise CorruptCheckpointError(f"manifest entry for {key!r} declares an absurd size")
        if (
            self.shape
            and math.prod(self.shape)
            and (self.chunk_shape[0] > self.shape[0] or self.chunk_shape[1:] != self.shape[1:])
        ):
            raise CorruptCheckpointError(f"chunk shape of {key!r} does not fit its shape: {d}")
        n = self.n_chunks
        stored_ok = len(self.stored) == (n if self.compression else 0)
        if len(self.crc32c) != n or not stored_ok:
            raise CorruptCheckpointError(f"inconsistent manifest entry for {key!r}: {d}")
        if self.separator not in ("/", "."):
            raise CorruptCheckpointError(f"bad chunk key separator for {key!r}: {self.separator!r}")


def _str_field(d: dict, name: str) -> str:
    v = d[name]
    if not isinstance(v, str):
        raise TypeError(f"{name} must be a string, got {v!r}")
    return v


def _int_list(d: dict, name: str, lo: int, hi: int, default: list | None = None) -> tuple[int, ...]:
    v = d.get(name, default) if default is not None else d[name]
    if not isinstance(v, list) or len(v) > MAX_LIST:
        raise TypeError(f"{name} must be a list of integers, got {type(v).__name__}")
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
            raise ValueError(f"{name} holds {x!r}; expected integers in [{lo}, {hi}]")
    return tuple(v)


NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")  # used with fullmatch


def check_key(key: object) -> str:
    """Refuse a node path that could leave the step directory or is not a plain name.

    Each ``/``-separated component must be a plain name: letters, digits, ``_``, ``-``,
    ``.`` (not first), at most 255 bytes — so no ``..``, no absolute path, no empty part.

    Raises:
        CorruptCheckpointError: the path and why it is refused.
    """
    if not isinstance(key, str) or not key or len(key) > 4096:
        raise CorruptCheckpointError(f"bad node path {key!r} in checkpoint metadata")
    for part in key.split("/"):
        if not NAME_RE.fullmatch(part) or len(part) > 255 or part in RESERVED_NAMES:
            raise CorruptCheckpointError(
                f"node path {key!r} has a component {part!r} that is not a plain name"
            )
    return key


def plan_array(
    key: str,
    tensor: torch.Tensor,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    compression: str | None = None,
) -> ArraySpec:
    """Choose the chunk shape for ``tensor`` (see the module docstring); ``compression``
    is a canonical codec spec or ``None``.

    Example:
        >>> plan_array("w", torch.zeros(10, 4), chunk_bytes=64).chunk_shape
        (4, 4)
    """
    shape = tuple(tensor.shape)
    name = dtype_name(tensor.dtype)
    zarr_dtype(tensor.dtype)  # raises early for dtypes we cannot store
    kw = {"compression": compression, "separator": "."}
    if not shape:
        return ArraySpec(key, name, shape, (), **kw)
    if tensor.numel() == 0:
        return ArraySpec(key, name, shape, tuple(max(1, d) for d in shape), **kw)
    nbytes = tensor.numel() * tensor.element_size()
    n = max(1, min(shape[0], math.ceil(nbytes / chunk_bytes)))
    rows = _page_rows(math.ceil(shape[0] / n), nbytes // shape[0], shape[0])
    return ArraySpec(key, name, shape, (rows, *shape[1:]), **kw)


def _page_rows(rows: int, row_bytes: int, total: int) -> int:
    """``rows`` rounded up so a chunk is whole 4 KiB pages (a mapped restore can then map
    the chunk files side by side as one tensor), unless that adds more than an eighth or
    the chunks are small enough to be read through the page cache anyway."""
    step = 4096 // math.gcd(row_bytes, 4096)
    aligned = -(-rows // step) * step
    if rows >= total or rows * row_bytes < DIRECT_MIN_BYTES or (aligned - rows) * 8 > rows:
        return rows
    return min(aligned, total)


def _fill_value(zdtype: str) -> bool | int | float | list[float]:
    if zdtype == "bool":
        return False
    if zdtype.startswith("complex"):
        return [0.0, 0.0]
    return 0.0 if zdtype.startswith(("float", "bfloat")) else 0


def array_zarr_json(spec: ArraySpec, fmt: int = FORMAT_VERSION) -> dict:
    """The ``zarr.json`` document of one array (valid Zarr v3 array metadata) as format
    ``fmt`` writes it (an older format only to check the documents of an older step)."""
    zdtype = zarr_dtype(parse_dtype(spec.dtype), fmt)
    attrs: dict = {"ftrain": {"dtype": spec.dtype}}
    codec = spec.codec
    if zdtype != spec.dtype:  # the Zarr name of every other dtype is torch's
        attrs["ftrain"]["encoding"] = f"raw bits of {spec.dtype} stored as {zdtype}"
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(spec.shape),
        "data_type": zdtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(spec.chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": spec.separator}},
        "fill_value": _fill_value(zdtype),
        "codecs": [
            {"name": "bytes", "configuration": {"endian": "little"}},
            *([codec.zarr_codec(spec.itemsize)] if codec else []),
            {"name": "crc32c"},
        ],
        "attributes": attrs,
        "storage_transformers": [],
    }


def group_zarr_json(attributes: dict | None = None) -> dict:
    """The ``zarr.json`` document of one group."""
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy little-endian byte view of a CPU tensor (copies only if non-contiguous,
    or to the host if the tensor is on another device)."""
    t = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
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


def _encode(payload: memoryview, pad: int, codec: Codec | None, itemsize: int) -> list:
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
    parts = _encode(payload, pad, codec, itemsize)
    size = sum(len(p) for p in parts)
    if direct and size >= DIRECT_MIN_BYTES and direct_supported(path.parent):
        crc = write_direct(path, parts, durable=durable)
        if crc is not None:
            return crc, size
    crc = 0
    for part in parts:
        crc = crc32c.crc32c(part, value=crc)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _write_all(fd, [*parts, crc.to_bytes(4, "little")])
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
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:  # missing, a symbolic link (ELOOP), a directory, unreadable
        raise CorruptCheckpointError(f"{path}: chunk file cannot be opened ({e})") from e
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
            raise CorruptCheckpointError(f"{path}: chunk unreadable ({e})") from e
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
        raise CorruptCheckpointError(f"{path}: chunk unreadable ({e})") from e
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


def json_bytes(doc: dict) -> bytes:
    """The bytes ftrain writes for a JSON document (every backend writes the same ones).

    Compact: ``indent`` would switch ``json`` to its pure-Python encoder, 5x slower (63 vs
    13 ms for the 653 documents of a GPT-2 step, whose root consolidates all the others)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def write_json(path: Path, doc: dict, *, durable: bool = True) -> tuple[int, int]:
    """Write a JSON document (new file, ``O_EXCL``), fsync'd when ``durable``.

    Returns:
        ``(crc32c, length)`` of the bytes written (the manifest records them).
    """
    data = json_bytes(doc)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _write_all(fd, [data])
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    return crc32c.crc32c(data), len(data)


def read_bytes_nofollow(path: Path) -> bytes:
    """A file's bytes, never through a symbolic link (a link inside a step is corruption)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: unreadable metadata ({e})") from e
    try:
        if os.fstat(fd).st_size > MAX_JSON_BYTES:
            raise CorruptCheckpointError(f"{path}: metadata larger than {MAX_JSON_BYTES} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: unreadable metadata ({e})") from e
    finally:
        os.close(fd)


def read_json(path: Path, *, checksum: list | None = None) -> dict:
    """Read a JSON object; ``CorruptCheckpointError`` if missing, unparseable or not a dict.

    Args:
        path: the document.
        checksum: ``[crc32c, length]`` recorded in the manifest; the bytes must match.
    """
    return parse_json(read_bytes_nofollow(path), path, checksum=checksum)


def parse_json(raw: bytes | None, where: object, *, checksum: list | None = None) -> dict:
    """Parse a metadata document read by any backend (``None``: it is missing).

    Raises:
        CorruptCheckpointError: missing, too large, not matching ``checksum``, unparseable
            or not a JSON object; the message names ``where``.
    """
    if raw is None:
        raise CorruptCheckpointError(f"{where}: metadata is missing")
    if len(raw) > MAX_JSON_BYTES:
        raise CorruptCheckpointError(f"{where}: metadata larger than {MAX_JSON_BYTES} bytes")
    if checksum is not None and [crc32c.crc32c(raw), len(raw)] != list(checksum):
        raise CorruptCheckpointError(f"{where}: does not match its checksum in the manifest")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: unreadable metadata ({e})") from e
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: metadata is not a JSON object")
    return doc
