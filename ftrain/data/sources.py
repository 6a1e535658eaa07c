"""Data sources: random access to ``(x, y)`` token windows by global sample index.

Every source has ``len(source)`` samples and ``source.get(indices)`` returns a
``TensorDict(x, y)`` of int64 ``[len(indices), block_size]`` tensors. Sample ``i``
is the window ``w = tokens[i * block_size : i * block_size + block_size + 1]``
with ``x = w[:-1]`` and ``y = w[1:]``: windows are **non-overlapping** (stride =
``block_size``, neighbours share one boundary token), so an epoch predicts every
token of the split exactly once and ``len = (num_tokens - 1) // block_size``.

Sources here:

- :class:`TokenFileSource` — a flat token file (nanoGPT's ``train.bin``/``val.bin``),
  read window by window; a directory holds one file per split, a single file is split by
  token range (the last ``val_fraction`` of tokens is ``val``).
- :class:`~ftrain.data.text.TextCorpusSource` (``text.py``) — a directory/glob of text
  files tokenized once by the byte-level tokenizer into a cached token file.
- :class:`TensorSource` — tokens already in memory (tests, custom data).

Bring your own: subclass :class:`Source` (four members) and
:func:`register_source` a factory so configs can name it in ``make_source``.
"""

from __future__ import annotations

import abc
import hashlib
import inspect
import logging
import os
import stat
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from ftrain.data.fingerprint import file_digest, make_fingerprint

__all__ = [
    "DataFormatError",
    "DataPathError",
    "Source",
    "TensorSource",
    "TokenFileSource",
    "make_source",
    "register_source",
    "source_from_config",
    "source_names",
]

log = logging.getLogger(__name__)

_SPLITS = ("train", "val")


class DataPathError(FileNotFoundError):
    """A configured data path does not exist or holds nothing usable."""


class DataFormatError(ValueError):
    """A data file exists but is corrupt, truncated or too small."""


class SampleShapeError(DataFormatError):
    """A source's ``get`` returned windows of another shape than ``[len(indices),
    block_size]``: a model would train on short (or long) contexts without a word, and
    reading the batch again gives the same shape (exit 2, not 1)."""


class TokenRangeError(DataFormatError):
    """A batch holds a token id the model has no row for: the data (or ``data.dtype``)
    does not fit the model, and reading it again fails the same way (exit 2, not 1)."""


def _token_dtype(dtype) -> np.dtype:
    """``data.dtype`` as a numpy integer dtype: a float, bool or unknown dtype read token
    ids as garbage (a uint16 file as float16: every id 0, trained to the end) or failed
    deep inside numpy.

    Raises:
        DataFormatError: naming the value and the usual choices.
    """
    try:
        out = np.dtype(dtype)
    except TypeError:
        out = None
    if out is None or out.kind not in "iu":
        raise DataFormatError(
            f"data.dtype={dtype!r} is not an integer dtype of token ids; use the dtype the "
            "file was written with: uint16 (vocabularies up to 65,536, e.g. GPT-2's 50,257) "
            "or uint32 (nanoGPT writes uint16)"
        )
    return out


class Source(abc.ABC):
    """A random-access dataset of token windows. Subclass to bring your own data.

    Implement ``__len__``, ``get``, ``fingerprint`` and ``describe``; set ``block_size``.
    """

    block_size: int

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of samples."""

    @abc.abstractmethod
    def get(self, indices: torch.Tensor) -> TensorDict:
        """``TensorDict(x=int64[n, block_size], y=int64[n, block_size], batch_size=[n])``."""

    @property
    @abc.abstractmethod
    def fingerprint(self) -> str:
        """A string that changes whenever the samples could change (see ``fingerprint.py``)."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """JSON-serialisable facts for checkpoint metadata and logs."""


def _check_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size=}")
    return block_size


def _check_indices(indices: torch.Tensor | Sequence[int], n: int) -> np.ndarray:
    idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise IndexError(
            f"sample indices must lie in [0, {n}), got min={int(idx.min())} max={int(idx.max())}"
        )
    return idx.numpy()


def _windows_to_td(w: np.ndarray | torch.Tensor) -> TensorDict:
    w = torch.as_tensor(np.asarray(w, dtype=np.int64)) if isinstance(w, np.ndarray) else w.long()
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
    return TensorDict({"x": x, "y": y}, batch_size=[w.shape[0]])


def _open_tokens(owner: object, file: Path) -> int:
    """A read descriptor on ``file``, closed when ``owner`` is collected. Opened without
    blocking and refused unless a regular file: a FIFO given as the token file blocked the
    start in ``open`` for good, deaf to SIGTERM and SIGINT (only SIGKILL ended it)."""
    fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise DataPathError(
            f"token file {str(file)!r} is {_file_kind(mode)}, not a regular file: point "
            "data.path at token files written to disk (a pipe or device cannot be re-read "
            "at a resume)"
        )
    os.set_blocking(fd, True)
    weakref.finalize(owner, os.close, fd)
    return fd


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))
    kinds += ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


# a dtype and the one twice as wide that a file read with it may have been written with
_WIDER = {"uint8": "uint16", "uint16": "uint32", "int16": "int32", "int32": "int64"}
_PROBE_BYTES = 1 << 20


def _refuse_half_width(fd: int, file: Path, dtype: np.dtype) -> None:
    """A file written with twice the width of ``data.dtype`` (uint32 ids read as uint16):
    every other id is the high half, 0 for a vocabulary below 65,536, so it trained on
    ids interleaved with zeros without a word. The start of the file tells (every odd id
    0, some even one not, over at least 64 ids)."""
    wider = _WIDER.get(dtype.name)
    size = os.fstat(fd).st_size
    if wider is None or size % (2 * dtype.itemsize):
        return
    head = os.pread(fd, min(size, _PROBE_BYTES), 0)
    ids = np.frombuffer(head[: len(head) - len(head) % (2 * dtype.itemsize)], dtype=dtype)
    if len(ids) >= 64 and not ids[1::2].any() and ids[0::2].any():
        raise DataFormatError(
            f"token file {str(file)!r} read as data.dtype={dtype.name} has every other id 0 "
            f"(of its first {len(ids):,}): it looks written as {wider}; set "
            f"data.dtype={wider} (the dtype the file was written with)"
        )


class TokenFileSource(Source):
    """Non-overlapping ``block_size + 1`` windows over a flat token file.

    Args:
        path: a directory holding ``<split>.bin`` (nanoGPT layout), or one token file
            that is split by range: ``train`` = the first ``1 - val_fraction`` of its
            tokens, ``val`` = the rest.
        block_size: tokens per sample (the model's context length).
        split: which split to read (``"train"`` or ``"val"``; any name in directory mode).
        dtype: the file's token dtype (``"uint16"`` as nanoGPT writes, ``"uint32"``,
            ``"uint8"``, ``"int32"``, ``"int64"``).
        val_fraction: single-file mode only: the share of tokens held out as ``val``.
        tokenizer: the tokenizer id recorded in the fingerprint (e.g. ``"gpt2"``).
        vocab_size: optional, recorded in ``describe()``.

    Raises:
        DataPathError: the path or the split's file is missing.
        DataFormatError: the file size is not a multiple of the dtype size, or the
            split holds fewer than ``block_size + 1`` tokens.

    Example:
        >>> import tempfile, pathlib, numpy as np
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> np.arange(100, dtype=np.uint16).tofile(d / "train.bin")
        >>> src = TokenFileSource(d, block_size=8)
        >>> len(src), src.get(torch.tensor([1]))["x"][0, :3].tolist()
        (12, [8, 9, 10])
    """

    kind = "tokens"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        block_size: int,
        split: str = "train",
        dtype: str = "uint16",
        val_fraction: float = 0.1,
        tokenizer: str = "raw",
        vocab_size: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        _content_digest: str | None = None,
    ) -> None:
        self.cache_dir = cache_dir  # where file_digest caches this file's content hash
        self.block_size = _check_block_size(block_size)
        self.split, self.tokenizer, self.vocab_size = split, tokenizer, vocab_size
        self.dtype = _token_dtype(dtype)
        root = Path(path).expanduser()
        if not root.exists():
            raise DataPathError(
                f"token data path {str(root)!r} does not exist; point data.path at a "
                "directory with train.bin/val.bin or at a single token file"
            )
        if root.is_dir():
            self.file = root / f"{split}.bin"
            if self.file.exists() and not self.file.is_file():  # a FIFO, a directory
                _open_tokens(self, self.file)  # raises, naming what it is
            if not self.file.is_file():
                found = sorted(p.name for p in root.iterdir())[:10]
                raise DataPathError(
                    f"no {self.file.name!r} in token directory {str(root)!r} (found {found}); "
                    f"write the {split!r} split there, or pass one token file to split by range"
                )
        else:
            if split not in _SPLITS:
                raise ValueError(f"a single token file has splits {_SPLITS}, got {split=}")
            self.file = root
        # the size from the descriptor the windows are read from: a rename between a
        # stat of the path and the open would size one file and read another
        self._fd = _open_tokens(self, self.file)
        n_file = self._count_tokens()
        _refuse_half_width(self._fd, self.file, self.dtype)
        self.lo, self.hi = 0, n_file
        self.splits_by_range = not root.is_dir()  # train and val share one file
        if self.splits_by_range:
            if not 0.0 <= val_fraction < 1.0:
                raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction=}")
            cut = n_file - int(n_file * val_fraction)
            self.lo, self.hi = (0, cut) if split == "train" else (cut, n_file)
        self.num_tokens = self.hi - self.lo
        if self.num_tokens < block_size + 1:
            raise DataFormatError(
                f"split {split!r} of {str(self.file)!r} has {self.num_tokens} tokens, fewer "
                f"than block_size + 1 = {block_size + 1} needed for one sample; lower "
                "block_size or add data"
                + (", or change val_fraction" if self.splits_by_range else f" to {split}.bin")
            )
        self._content = _content_digest
        self._fingerprint: str | None = None

    def _count_tokens(self) -> int:
        size = os.fstat(self._fd).st_size
        if size == 0 or size % self.dtype.itemsize:
            raise DataFormatError(
                f"token file {str(self.file)!r} is empty or truncated: {size} bytes is not a "
                f"positive multiple of {self.dtype.itemsize} ({self.dtype.name}); regenerate "
                "the file, or set data.dtype to the dtype it was written with"
            )
        return size // self.dtype.itemsize

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.block_size

    def get(self, indices: torch.Tensor | Sequence[int]) -> TensorDict:
        idx = _check_indices(indices, len(self))
        starts = self.lo + idx * self.block_size
        return _windows_to_td(self._read_windows(starts.tolist()))

    def _read_windows(self, starts: list[int]) -> np.ndarray:
        """One ``pread`` per window. Not a memory map: a token file truncated in place
        while the run reads it (a dataset being regenerated) would kill the process with
        ``SIGBUS`` on the next touch, skipping the emergency save; a short read is an
        error that names the file. A file replaced by a rename keeps being read from the
        one opened here, as the run's fingerprint recorded."""
        out = np.empty((len(starts), self.block_size + 1), dtype=self.dtype)
        size = self.dtype.itemsize
        for row, start in zip(out, starts, strict=True):
            got = os.preadv(self._fd, [row], start * size)
            if got != row.nbytes:
                raise DataFormatError(
                    f"token file {str(self.file)!r} shrank while the run read it: window at "
                    f"token {start} read {got} of {row.nbytes} bytes (the file now has "
                    f"{os.fstat(self._fd).st_size} bytes, {self.hi * size} at the start); "
                    "write a new data set to a new file (or rename it into place) instead of "
                    "rewriting the one a run reads, then resume"
                )
        return out

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            # the file this source opened and reads, not what the path names by now
            content = self._content or file_digest(self.file, cache=self.cache_dir, fd=self._fd)
            self._fingerprint = make_fingerprint(
                kind=self.kind,
                tokenizer=self.tokenizer,
                split=self.split,
                block_size=self.block_size,
                content=content,
                extra={"dtype": self.dtype.name, "range": [self.lo, self.hi]},
            )
        return self._fingerprint

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": str(self.file),
            "split": self.split,
            "block_size": self.block_size,
            "num_samples": len(self),
            "num_tokens": self.num_tokens,
            "token_range": [self.lo, self.hi],
            "dtype": self.dtype.name,
            "tokenizer": self.tokenizer,
            "vocab_size": self.vocab_size,
            "windows": "non-overlapping, stride block_size",
            "fingerprint": self.fingerprint,
        }


class TensorSource(Source):
    """Samples from tokens already in memory.

    Args:
        tokens: a 1-d integer tensor (cut into non-overlapping ``block_size + 1``
            windows like a token file) or a 2-d ``[n, block_size + 1]`` tensor whose
            rows are the samples.
        block_size: tokens per sample; inferred from a 2-d ``tokens`` when omitted.
        split: the split name recorded in the fingerprint.

    Example:
        >>> src = TensorSource(torch.arange(17), block_size=4)
        >>> len(src), src.get([0])["y"].tolist()
        (4, [[1, 2, 3, 4]])
    """

    kind = "tensor"

    def __init__(
        self, tokens: torch.Tensor, *, block_size: int | None = None, split: str = "train"
    ):
        tokens = torch.as_tensor(tokens)
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dim() not in (1, 2):
            raise ValueError(
                f"tokens must be a 1-d or 2-d integer tensor, got {tokens.dtype} {tuple(tokens.shape)}"
            )
        if tokens.dim() == 2:
            block_size = tokens.shape[1] - 1 if block_size is None else block_size
            if tokens.shape[1] != block_size + 1:
                raise ValueError(
                    f"2-d tokens need rows of block_size + 1 = {block_size + 1}, got {tuple(tokens.shape)}"
                )
        elif block_size is None:
            raise ValueError("block_size is required for 1-d tokens")
        self.block_size = _check_block_size(block_size)
        self.tokens, self.split = tokens.detach().cpu().long().contiguous(), split
        n = (tokens.shape[0] - 1) // block_size if tokens.dim() == 1 else tokens.shape[0]
        if n < 1:
            raise DataFormatError(
                f"{tokens.shape[0]} tokens make no sample of block_size {block_size}"
            )
        self._n = n
        self._offsets = torch.arange(block_size + 1)
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return self._n

    def get(self, indices: torch.Tensor | Sequence[int]) -> TensorDict:
        idx = torch.from_numpy(_check_indices(indices, self._n))
        if self.tokens.dim() == 2:
            return _windows_to_td(self.tokens[idx])
        return _windows_to_td(self.tokens[idx[:, None] * self.block_size + self._offsets])

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            content = hashlib.blake2b(self.tokens.numpy().tobytes(), digest_size=16).hexdigest()
            self._fingerprint = make_fingerprint(
                kind=self.kind,
                tokenizer="raw",
                split=self.split,
                block_size=self.block_size,
                content=content,
                extra={"shape": list(self.tokens.shape)},
            )
        return self._fingerprint

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "split": self.split,
            "block_size": self.block_size,
            "num_samples": self._n,
            "shape": list(self.tokens.shape),
            "fingerprint": self.fingerprint,
        }


# ---------------------------------------------------------------- registry

_REGISTRY: dict[str, Callable[..., Source]] = {}


def register_source(name: str, factory: Callable[..., Source] | None = None):
    """Register a source factory under ``name`` (usable as a decorator).

    Example:
        >>> @register_source("ones")
        ... def ones(*, block_size: int, split: str = "train") -> Source:
        ...     return TensorSource(torch.ones(64, dtype=torch.long), block_size=block_size)
        >>> len(make_source("ones", block_size=8))
        7
    """

    def add(f: Callable[..., Source]) -> Callable[..., Source]:
        if _REGISTRY.get(name, f) is not f:
            raise ValueError(
                f"a data source named {name!r} is already registered ({_REGISTRY[name]!r})"
            )
        _REGISTRY[name] = f
        return f

    return add if factory is None else add(factory)


def make_source(name: str, /, **kwargs: Any) -> Source:
    """Build the source registered as ``name`` with ``kwargs`` (e.g. from ``conf/data``).

    Raises:
        KeyError: no source of that name (the message lists the known ones).
    """
    if name not in _REGISTRY:
        raise KeyError(
            f"unknown data source {name!r}; known: {sorted(_REGISTRY)} (add one with register_source)"
        )
    return _REGISTRY[name](**kwargs)


_LOADER_KEYS = frozenset({"_target_", "name", "shuffle", "drop_last", "prefetch", "allow_changed"})


def source_from_config(cfg: Mapping[str, Any], *, split: str = "train") -> Source:
    """Build the ``split`` source described by a ``data`` config (``conf/data/*.yaml``).

    ``cfg["_target_"]`` (a dotted path, as in Hydra's ``instantiate``) names the factory;
    without one, ``cfg["name"]`` picks a registered factory. The keys it accepts are passed on
    (``path``/``cache_dir`` only when set); loader and resume keys (``shuffle``,
    ``drop_last``, ``prefetch``, ``allow_changed``) are not source arguments.

    Example:
        >>> src = source_from_config({"name": "tensor", "tokens": torch.arange(9), "block_size": 4})
        >>> len(src)
        2
    """
    factory = _factory(cfg)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin (data._target_=builtins.dict): no signature
        raise KeyError(_not_a_source(cfg, f"{factory!r} cannot be called with keys")) from None
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {
        k: v
        for k, v in dict(cfg).items()
        if k not in _LOADER_KEYS
        and (takes_any or k in params)
        and not (k in ("path", "cache_dir") and v is None)
    }
    if takes_any or "split" in params:
        kwargs["split"] = split
    source = factory(**kwargs)
    missing = [a for a in _SOURCE_API if not hasattr(source, a)]
    if missing:  # data._target_=os.getcwd: a traceback at the first use of its result
        got = f"a {type(source).__name__} without {', '.join(missing)}"
        raise KeyError(_not_a_source(cfg, f"it returned {got}"))
    return source


_SOURCE_API = ("__len__", "get", "fingerprint", "describe", "block_size")


def _not_a_source(cfg: Mapping[str, Any], why: str) -> str:
    what = (
        f"data._target_={cfg.get('_target_')!r}"
        if cfg.get("_target_")
        else f"data.name={cfg.get('name')!r}"
    )
    return (
        f"{what} is not a data source factory: {why}; it must return a ftrain.data.Source "
        "(subclass it: __len__, get, fingerprint, describe, block_size)"
    )


def _factory(cfg: Mapping[str, Any]) -> Callable[..., Source]:
    target, name = cfg.get("_target_"), cfg.get("name")
    if name in _REGISTRY and not _is_ftrains(_REGISTRY[name]):
        # a source the user registered (register_source) and named: it wins over the
        # _target_ of the data option it overrides, as a registered model.name does
        return _REGISTRY[name]
    if target:
        from hydra._internal.utils import _locate  # as instantiate looks targets up

        try:
            return _locate(str(target))
        except Exception as err:  # not importable: the message names the path
            raise KeyError(
                f"data._target_={target!r} cannot be imported ({err}); check the dotted path "
                "and that its package is importable"
            ) from None
    if name not in _REGISTRY:
        make_source(str(name))  # raises the listing error
    return _REGISTRY[name]


def _is_ftrains(factory: Callable) -> bool:
    """Whether a registered factory is one of ftrain's own (not a user's register_source)."""
    return str(getattr(factory, "__module__", "")).split(".")[0] == "ftrain"


def source_names() -> list[str]:
    """The names ``make_source`` accepts."""
    return sorted(_REGISTRY)


register_source("tokens", TokenFileSource)
register_source("tensor", TensorSource)
