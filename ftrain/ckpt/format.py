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

import errno
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import torch

from ftrain import _json
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
    "read_bytes_nofollow",
    "group_zarr_json",
    "plan_array",
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
# Stored as raw bits of their itemsize: dtypes whose every element is itemsize whole bytes.
_RAW_DTYPES = (
    "complex32", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
    "bits8", "bits16",
)  # fmt: skip
# Every dtype a checkpoint may hold, by name. A name read from metadata is looked up here,
# never with getattr(torch, name): a packed dtype (quint4x2, two values a byte) sized the
# restore's buffer at half its bytes and the chunk read overran the heap; a quantized one
# cannot be stored; and torch's lazy attributes import modules or call functions.
STORABLE_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in [*_NATIVE, *_ML_FLOATS, *(getattr(torch, n) for n in _RAW_DTYPES if hasattr(torch, n))]
}


class CorruptCheckpointError(RuntimeError):
    """A checkpoint failed verification: a bad checksum, a missing or truncated chunk, or
    unreadable metadata. The message names the path and the reason."""


class CheckpointReadError(OSError):
    """A chunk file could not be read for a reason of this machine, not of the checkpoint
    (too many open files, no memory): the step is not judged corrupt, nothing falls back
    or is set aside. Retry once the limit is raised (a restart does)."""


class CheckpointAccessError(CheckpointReadError, PermissionError):
    """A checkpoint file this user may not read (EACCES, EPERM): not a fault of the
    checkpoint either, so nothing is judged; unlike a machine limit a retry fails the same
    way (the command line's exit 2)."""


# The machine's resources of the moment, not the file: judged corrupt, an intact step was
# passed over by restore (its steps trained again) and set aside by the next save.
_OF_THE_MOMENT = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN, errno.EINTR}
)


def unreadable(path: object, err: OSError, what: str) -> Exception:
    """The error for a checkpoint file that could not be opened or read: corruption
    (restore falls back to an older step, listing skips it) unless the cause is the
    machine's (too many open files, no memory): :class:`CheckpointReadError`, the step is
    not judged."""
    if err.errno in (errno.EACCES, errno.EPERM):  # a permission: judged corrupt, an intact
        return CheckpointAccessError(  # step was passed over and its steps trained again
            err.errno,
            f"{path}: {what} ({err.strerror}): a permission of this user, not a fault of the "
            "checkpoint, which is left as it is; give this user read access to the run's "
            "files (or run as their owner)",
        )
    if err.errno in _OF_THE_MOMENT:
        return CheckpointReadError(
            err.errno,
            f"{path}: {what} ({err.strerror}): a limit of this machine, not a fault of the "
            "checkpoint, which is left as it is; raise the limit (ulimit -n, free memory) "
            "and retry",
        )
    return CorruptCheckpointError(f"{path}: {what} ({err})")


class CheckpointFormatError(RuntimeError):
    """A step was written in a format this ftrain cannot read (e.g. by a newer ftrain).

    Not a corruption: such a step is never skipped, set aside or deleted; the run stops
    and says which ftrain wrote it."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises ``CorruptCheckpointError`` for a name
    that is not one of :data:`STORABLE_DTYPES`."""
    dtype = STORABLE_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise CorruptCheckpointError(
            f"unknown dtype {name!r} in checkpoint metadata (not one a checkpoint holds)"
        )
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
    if dtype not in STORABLE_DTYPES.values():
        raise TypeError(
            f"cannot store dtype {dtype} in a checkpoint (packed, quantized or sub-byte); "
            f"convert the leaf to one of: {', '.join(sorted(STORABLE_DTYPES))}"
        )
    return _RAW_BITS[torch.empty((), dtype=dtype).element_size()]


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

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row (index of the first dimension); 0 for an array with no rows."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0

    def chunk_span(self, i: int) -> tuple[int, int]:
        """Byte range ``[start, stop)`` of chunk ``i``'s real payload in the flat tensor."""
        if not self.shape:
            return 0, self.nbytes
        start = i * self.chunk_shape[0] * self.row_nbytes
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


def write_all(fd: int, parts: list) -> None:
    """``os.writev`` of every part, continued after short writes."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


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
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        write_all(fd, [data])
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    return crc32c.crc32c(data), len(data)


def read_bytes_nofollow(path: Path) -> bytes:
    """A regular file's bytes, never through a symbolic link (a link inside a step is
    corruption) and never blocking on a FIFO planted in its place (``O_NONBLOCK``: it hung
    every listing, so every restart)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = _open_regular(path, flags)
    except OSError as e:
        raise unreadable(path, e, "unreadable metadata") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptCheckpointError(f"{path}: metadata is not a regular file")
        os.set_blocking(fd, True)  # a regular file: read it as usual
        if os.fstat(fd).st_size > MAX_JSON_BYTES:
            raise CorruptCheckpointError(f"{path}: metadata larger than {MAX_JSON_BYTES} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    except OSError as e:
        raise unreadable(path, e, "unreadable metadata") from e
    finally:
        os.close(fd)


def _open_regular(path: Path, flags: int) -> int:
    """``os.open`` with ``O_NONBLOCK`` (a FIFO in the file's place must not block), once
    more without it where a regular file answered EAGAIN (a write lease: an NFS or Samba
    server's delegation makes a non-blocking open fail instead of wait)."""
    try:
        return os.open(path, flags | os.O_NONBLOCK)
    except BlockingIOError:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise
        return os.open(path, flags)


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
        doc = _json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: unreadable metadata ({e})") from e
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: metadata is not a JSON object")
    return doc
