"""Text corpora: files tokenized once by the byte-level tokenizer, cached, read by window.

The corpus's files (sorted) are joined by the tokenizer's EOT byte (NUL) and written to
``<cache>/corpus/<key>.u8`` with a JSON sidecar written last (its presence marks the
entry complete). The key covers the tokenizer and each file's path, size and mtime, so
an edited file makes a new entry; a truncated entry is rebuilt. The result is read as a
:class:`~ftrain.data.sources.TokenFileSource` (uint8 tokens).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ftrain import _json
from ftrain.data.fingerprint import (
    NoCacheDirError,
    _probe_digest,
    _write_json_atomic,
    cache_dir,
    cache_path,
    file_identity,
    remove_stale_tmp,
    unique_tmp,
)
from ftrain.data.sources import DataFormatError, DataPathError, TokenFileSource, register_source
from ftrain.data.tokenizer import ByteTokenizer

__all__ = ["TextCorpusSource", "resolve_text_files", "tokenize_corpus"]

log = logging.getLogger(__name__)


def resolve_text_files(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    pattern: str = "**/*",
    exclude: Sequence[str] = (),
) -> list[Path]:
    """The files of a text corpus, in a deterministic order.

    Each entry of ``paths`` is a file, a directory (its files matching ``pattern``,
    sorted by relative POSIX path) or a glob (its matches, sorted). Entries keep their
    order. Files with a path component in ``exclude`` are skipped.

    Raises:
        DataPathError: an entry matches no file, or cannot be read (a directory this user
            may not enter, a file it may not read).
    """
    entries = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    out: list[Path] = []
    for entry in entries:
        p = Path(entry).expanduser()
        try:
            found = _entry_files(p, pattern, set(exclude) | {"__pycache__"})
        except OSError as err:  # a directory it may not enter, a failing disk
            raise DataPathError(f"text corpus entry {str(p)!r} cannot be read ({err})") from None
        if not found:
            raise DataPathError(
                f"text corpus entry {str(p)!r} matches no file (pattern {pattern!r}); point "
                "data.path at existing text files, a directory or a glob"
            )
        unreadable = [f for f in found if not os.access(f, os.R_OK)]
        if unreadable:
            raise DataPathError(
                f"text corpus file {str(unreadable[0])!r} is not readable by this user "
                f"({len(unreadable)} of {len(found)} under {str(p)!r}); fix its permissions "
                "or leave it out of data.path"
            )
        out.extend(found)
    return out


def _entry_files(p: Path, pattern: str, skip: set[str]) -> list[Path]:
    """The files of one ``data.path`` entry (see :func:`resolve_text_files`)."""
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(
            (f for f in p.glob(pattern) if f.is_file() and not skip & set(f.relative_to(p).parts)),
            key=lambda f: f.relative_to(p).as_posix(),
        )
    found = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
    return _once_each([f for f in found if not skip & set(f.parts)])


def _once_each(files: list[Path]) -> list[Path]:
    """Each file once, at its first match: a recursive glob follows symlinked folders, and
    one linking back up (``sub/loop -> ..``) matched every file ~40 times, until ELOOP."""
    seen: set[Path] = set()
    out = []
    for f in files:
        real = f.resolve()
        if real not in seen:
            seen.add(real)
            out.append(f)
    return out


def _tokenize_files(files: Sequence[Path], target: Path) -> dict[str, Any]:
    """Write ``files`` as byte tokens joined by EOT into ``target`` (atomically; a killed or
    failed write leaves no temporary file behind)."""
    eot = bytes([ByteTokenizer().eot])
    h, n, t0, binary = hashlib.blake2b(digest_size=16), 0, time.perf_counter(), []
    with unique_tmp(target) as tmp:
        with open(tmp, "wb") as out:

            def write(piece: bytes) -> None:
                nonlocal n
                out.write(piece)
                h.update(piece)
                n += len(piece)

            for i, f in enumerate(files):
                if i:
                    write(eot)
                nul = False
                for piece in _pieces(f):
                    write(piece)
                    nul = nul or eot in piece
                if nul:  # not text, and its NULs read as document ends
                    binary.append(f)
        os.replace(tmp, target)
    binary_names = [str(f) for f in binary]
    warn_binary(binary_names)
    log.info(
        "tokenized %d files (%d bytes) into %s in %.1fs",
        len(files),
        n,
        target,
        time.perf_counter() - t0,
    )
    probe = _probe_digest(target, n)
    return {"num_tokens": n, "digest": h.hexdigest(), "probe": probe, "binary": binary_names}


def warn_binary(names: list[str]) -> None:
    """Said at every start that reads such a corpus, from the cache too (it was said only
    by the start that tokenized it)."""
    if not names:
        return
    log.warning(
        "%d corpus file(s) hold NUL bytes, so they are not text (a binary file?) and "
        "their NULs read as document ends: %s; leave them out with a narrower data.path, a "
        "glob of the text files (data.path='DIR/**/*.txt'), or TextCorpusSource(..., "
        "exclude=[NAME]) in Python (a path component to skip)",
        len(names),
        ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""),
    )


_PIECE = 8 << 20  # a corpus file is copied this much at a time: a 5 GB file was read whole


def _pieces(f: Path):
    """One corpus file's bytes, a piece at a time; a file that cannot be read is a
    DataPathError."""
    try:
        with f.open("rb") as src:
            while piece := src.read(_PIECE):
                yield piece
    except OSError as err:
        raise DataPathError(f"text corpus file {str(f)!r} cannot be read ({err})") from None


def tokenize_corpus(
    files: Sequence[Path], *, cache: str | os.PathLike | None = None
) -> tuple[Path, dict[str, Any], bool]:
    """Tokenize ``files`` once into the cache; later calls reuse the cached token file.

    The cache entry is keyed by the tokenizer and each file's path, size, mtime, inode,
    ctime and a probe of its content, so editing a file makes a new entry. A JSON sidecar written last marks it complete.

    Returns:
        ``(token_file, meta, tokenized_now)``; ``meta`` has ``num_tokens`` and ``digest``.
    """
    try:
        stats = [_stat(f) for f in files]
    except OSError as err:  # a file gone or failing since it was listed
        raise DataPathError(f"text corpus file cannot be read ({err})") from None
    key = hashlib.blake2b(
        json.dumps([ByteTokenizer.id, _CACHE_KEY_VERSION, stats]).encode(), digest_size=12
    ).hexdigest()
    try:
        folder = cache_dir(cache) / "corpus"
        folder.mkdir(parents=True, exist_ok=True)
    except NoCacheDirError as err:  # none to name (no HOME): the error says what to set
        raise DataPathError(str(err)) from None
    except OSError as err:
        raise DataPathError(
            f"the text corpus cache {cache_path(cache) / 'corpus'} cannot be created ({err}); "
            "point data.cache_dir (or FTRAIN_CACHE_DIR) at a writable directory"
        ) from None
    token_file, meta_file = folder / f"{key}.u8", folder / f"{key}.json"
    try:
        meta = _json.loads(meta_file.read_text())
        size = token_file.stat().st_size
        if size == meta["num_tokens"] and _probe_digest(token_file, size) == meta["probe"]:
            binary = meta.get("binary")
            warn_binary([str(b) for b in binary] if isinstance(binary, list) else [])
            return token_file, meta, False
        log.warning("corpus cache %s is incomplete or corrupt; tokenizing again", token_file)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    remove_stale_tmp(folder)  # what a writer killed mid-way left behind
    need = sum(st[1]["size"] for st in stats) + max(len(files) - 1, 0)
    meta = {"tokenizer": ByteTokenizer.id, "files": len(files)} | _cached_tokens(
        files, token_file, need
    )
    try:
        _write_json_atomic(meta_file, meta)
    except OSError as err:  # a full cache disk: the tokens are right, only not reusable
        log.warning(
            "corpus cache %s: sidecar not written (%s); tokenizing again next start", meta_file, err
        )
    return token_file, meta, True


def _cached_tokens(files: Sequence[Path], token_file: Path, need: int) -> dict[str, Any]:
    """:func:`_tokenize_files` into the cache, whose failed write (a full disk, a read-only
    volume, a file-size limit) is a :class:`DataPathError` naming the cache and its fix."""
    try:
        return _tokenize_files(files, token_file)
    except DataPathError:  # a corpus file that cannot be read: it says which
        raise
    except OSError as err:
        raise DataPathError(
            f"the text corpus cache file {token_file} cannot be written ({err}); it takes "
            f"{need} bytes: free that much there, or point data.cache_dir (or "
            "FTRAIN_CACHE_DIR) at a writable directory with room"
        ) from None


# 2: each file's probe digest joined the key (a file rewritten with its old size and
# mtime, as cp -p and rsync -a leave it, reused the old tokens); 3: its inode and ctime
# (an edit outside the probes, so rewritten, reused them all the same)
_CACHE_KEY_VERSION = 3


def _stat(f: Path) -> list:
    """What keys a corpus file's tokens: path, size, mtime, inode, ctime and a probe of its
    content (:func:`ftrain.data.fingerprint.file_identity`)."""
    st = f.stat()
    return [str(f.resolve()), file_identity(st), _probe_digest(f, st.st_size)]


class TextCorpusSource(TokenFileSource):
    """Text files tokenized once by the byte-level tokenizer (vocab 256), then read by window.

    Args:
        path: a directory, a file, a glob, or a list of them (see ``resolve_text_files``).
        block_size: tokens per sample.
        split: ``"train"`` or ``"val"`` (the last ``val_fraction`` of the corpus's tokens).
        pattern: files to take from a directory (default: all).
        exclude: path components to skip (``__pycache__`` always is).
        val_fraction: the share of tokens held out for ``val``.
        cache_dir: where tokenized corpora are cached (see ``cache_dir``).

    Attributes:
        tokenized: whether this construction tokenized (``False``: the cache was reused).

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "a.txt").write_text("hello " * 50)
        >>> src = TextCorpusSource(d, block_size=16, cache_dir=d / "cache")
        >>> ByteTokenizer().decode(src.get([0])["x"][0])
        'hello hello hell'
    """

    kind = "text"

    def __init__(
        self,
        path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
        *,
        block_size: int,
        split: str = "train",
        pattern: str = "**/*",
        exclude: Sequence[str] = (),
        val_fraction: float = 0.05,
        cache_dir: str | os.PathLike | None = None,
        paths: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    ) -> None:
        if paths is not None:  # the first spelling of this argument, kept for callers of it
            warnings.warn(
                "TextCorpusSource(paths=...) is now path=...", DeprecationWarning, stacklevel=2
            )
            path = paths if path is None else path
        if path is None:
            raise TypeError(
                "TextCorpusSource needs path= (a directory, file, glob or a list of them)"
            )
        self.files = resolve_text_files(path, pattern=pattern, exclude=exclude)
        token_file, meta, self.tokenized = tokenize_corpus(self.files, cache=cache_dir)
        if meta["num_tokens"] <= max(len(self.files) - 1, 0):  # only the files' separators
            raise DataFormatError(
                f"text corpus {_shown(path)} holds no text ({len(self.files)} empty file(s)); "
                "point data.path at the text to train on"
            )
        try:
            self._open_tokens(token_file, meta, block_size, split, val_fraction, cache_dir)
        except DataFormatError as err:  # named by the corpus, not by its cache file
            raise DataFormatError(
                str(err).replace(repr(str(token_file)), f"text corpus {_shown(path)}")
            ) from None

    def _open_tokens(self, token_file, meta, block_size, split, val_fraction, cache_dir) -> None:
        super().__init__(
            token_file,
            block_size=block_size,
            split=split,
            dtype="uint8",
            val_fraction=val_fraction,
            tokenizer=ByteTokenizer.id,
            vocab_size=ByteTokenizer.vocab_size,
            cache_dir=cache_dir,
            _content_digest=meta["digest"],
        )

    def describe(self) -> dict[str, Any]:
        return super().describe() | {"num_files": len(self.files), "eot": ByteTokenizer.eot}


def _shown(path) -> str:
    return repr(str(path)) if isinstance(path, str | os.PathLike) else repr([str(p) for p in path])


register_source("text", TextCorpusSource)
