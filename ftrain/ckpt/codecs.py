"""Optional chunk compression: a small set of codecs every Zarr v3 reader can decode.

A compressed array's codec chain is ``bytes(little) -> <compressor> -> crc32c``: the chunk
file is the compressed full-size chunk followed by the crc32c of the *compressed* bytes.
The compressor is written in the array's ``zarr.json`` exactly as zarr-python 3 names it
(``zstd`` or ``blosc``), so ``zarr.open_group`` decodes every array without ftrain.

Accepted values of ``compression`` (``None`` or ``"none"``: raw chunks, the default):

``"zstd"`` / ``"zstd:LEVEL"``
    Zstandard, level 1 by default (1-22).
``"blosc-lz4"`` / ``"blosc-lz4:LEVEL"``
    Blosc with LZ4 and byte shuffle by the element size, level 5 by default (1-9).
``"blosc-zstd"`` / ``"blosc-zstd:LEVEL"``
    Blosc with Zstandard and byte shuffle, level 3 by default (1-9).

Measured trade-offs are in ``docs/checkpointing.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numcodecs import Blosc, Zstd, blosc

__all__ = ["ALLOWED", "Codec", "parse_compression"]

ALLOWED = ("none", "zstd[:1-22]", "blosc-lz4[:1-9]", "blosc-zstd[:1-9]")
_DEFAULT_LEVEL = {"zstd": 1, "blosc-lz4": 5, "blosc-zstd": 3}
_MAX_LEVEL = {"zstd": 22, "blosc-lz4": 9, "blosc-zstd": 9}


@dataclass(frozen=True)
class Codec:
    """One compressor with its level; ``spec`` is the canonical string (``"zstd:1"``)."""

    name: str
    level: int

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.level}"

    @property
    def max_chunk_bytes(self) -> int | None:
        """The largest chunk the codec takes, or ``None`` (no limit): Blosc's buffers stop
        short of 2 GiB (``ValueError: Codec does not support buffers of > 2147483647
        bytes`` from the background writer, after ``save()`` had returned)."""
        return None if self.name == "zstd" else blosc.MAX_BUFFERSIZE

    def zarr_codec(self, itemsize: int) -> dict:
        """The codec entry of the array's ``zarr.json`` (zarr-python 3 spelling)."""
        if self.name == "zstd":
            return {"name": "zstd", "configuration": {"level": self.level, "checksum": False}}
        conf = {"typesize": itemsize, "cname": self.name.removeprefix("blosc-")}
        conf |= {"clevel": self.level, "shuffle": "shuffle", "blocksize": 0}
        return {"name": "blosc", "configuration": conf}

    def _impl(self, itemsize: int) -> Zstd | Blosc:
        if self.name == "zstd":
            return Zstd(level=self.level)
        cname = self.name.removeprefix("blosc-")
        return Blosc(cname=cname, clevel=self.level, shuffle=Blosc.SHUFFLE, typesize=itemsize)

    def encode(self, data: memoryview, itemsize: int) -> bytes:
        """Compress one full-size chunk (releases the GIL)."""
        arr = np.frombuffer(data, dtype=np.uint8)
        if self.name != "zstd" and itemsize in (2, 4, 8) and len(arr) % itemsize == 0:
            # so blosc shuffles by the element size (complex128's 16 bytes have no unsigned
            # type; the codec's own typesize shuffles those)
            arr = arr.view(f"u{itemsize}")
        return bytes(self._impl(itemsize).encode(arr))

    def decode_into(self, data: bytes | memoryview, out: memoryview, itemsize: int) -> None:
        """Decompress ``data`` into ``out`` (exactly the full chunk size).

        Raises:
            ValueError: the frame is damaged or does not decode to ``len(out)`` bytes.
        """
        # the codecs fill only what the frame holds and return quietly: a frame of half
        # the chunk left the rest as whatever the memory held, restored and exported
        declared = _blosc_nbytes(data) if self.name != "zstd" else _zstd_content_size(data)
        if declared != len(out):
            raise ValueError(
                f"{self.spec} cannot decode the chunk: its frame declares "
                f"{'no size' if declared is None else f'{declared} bytes'}, the chunk holds "
                f"{len(out)}"
            )
        dest = np.frombuffer(out, dtype=np.uint8)
        try:
            self._impl(itemsize).decode(data, out=dest)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"{self.spec} cannot decode the chunk: {e}") from e


_ZSTD_MAGIC = 0xFD2FB528


def _zstd_content_size(frame: bytes | memoryview) -> int | None:
    """The content size a zstd frame's header declares (RFC 8878 3.1.1.1), or ``None``
    (no size written, not a zstd frame). libzstd refuses a frame whose blocks decode to
    another size than it declares, so a declared size equal to the chunk's means every
    byte of the chunk is written."""
    head = bytes(frame[:18])
    if len(head) < 5 or int.from_bytes(head[:4], "little") != _ZSTD_MAGIC:
        return None
    desc = head[4]
    single_segment = (desc >> 5) & 1
    size_bytes = (1 if single_segment else 0, 2, 4, 8)[desc >> 6]
    at = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[desc & 3]  # window, dictionary id
    if size_bytes == 0 or len(head) < at + size_bytes:
        return None
    size = int.from_bytes(head[at : at + size_bytes], "little")
    return size + 256 if size_bytes == 2 else size


def _blosc_nbytes(frame: bytes | memoryview) -> int | None:
    """The uncompressed size in a blosc frame's header, or ``None`` if its compressed size
    is not the frame's length (a truncated or padded frame)."""
    head = bytes(frame[:16])
    if len(head) < 16 or int.from_bytes(head[12:16], "little") != len(frame):
        return None
    return int.from_bytes(head[4:8], "little")


def parse_compression(value: str | None) -> Codec | None:
    """``None``/``"none"`` -> ``None``; ``"zstd:3"`` -> ``Codec("zstd", 3)``.

    Raises:
        ValueError: an unknown name or an out-of-range level; the message names the value
            and the allowed ones.

    Example:
        >>> parse_compression("blosc-lz4").spec
        'blosc-lz4:5'
    """
    if value is None or value == "none":
        return None
    bad = ValueError(f"compression={value!r} is not supported; allowed: None, {', '.join(ALLOWED)}")
    if not isinstance(value, str):
        raise bad
    name, sep, level_s = value.partition(":")
    if name not in _DEFAULT_LEVEL:
        raise bad
    if not sep:
        return Codec(name, _DEFAULT_LEVEL[name])
    try:
        level = int(level_s)
    except ValueError:
        raise bad from None
    if not 1 <= level <= _MAX_LEVEL[name]:
        raise bad
    return Codec(name, level)
