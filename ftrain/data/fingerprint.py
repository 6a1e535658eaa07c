"""Dataset fingerprints: what a checkpoint records about the data it was trained on.

A fingerprint is a short string that changes whenever the *samples* a source
yields could change: the token content, the tokenizer, the split and the block
size. It is deliberately independent of the file's location, so a dataset that
is moved or mounted elsewhere still resumes. Format::

    <kind>:<tokenizer>:<split>:bs<block_size>:<digest>

e.g. ``tokens:bytes-v1:train:bs256:3f9a0c1d2b4e5f60``. The digest (BLAKE2b-64)
covers all those fields plus the content hash and the split's token range.

Hashing a large file is costly, so :func:`file_digest` caches the full content
hash per file in the cache directory, keyed by absolute path, size and
``mtime_ns``. On a cache hit it re-hashes a few fixed 64 KiB probes (start,
end and six evenly spaced blocks) and compares them with the cached probe
digest: a cheap check (< 1 MiB read) that catches files rewritten with a
restored mtime in the probed regions. A file edited in place outside the probes
*and* given back its old mtime is the one case not caught; delete
``<cache>/fingerprints`` (or touch the file) to force a full re-hash.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from ftrain import _json
from ftrain._umask import plain_file_mode

__all__ = [
    "DataFingerprintError",
    "cache_dir",
    "check_fingerprint",
    "file_digest",
    "make_fingerprint",
]

log = logging.getLogger(__name__)

_CHUNK = 8 << 20
_PROBE = 64 << 10
_N_MIDDLE_PROBES = 6
_CACHE_VERSION = 2  # 2: the inode and ctime joined the key


class DataFingerprintError(ValueError):
    """The data a checkpoint was trained on differs from the data configured now."""


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """The directory for ftrain's caches (tokenized corpora, fingerprints).

    Precedence: ``override`` > env ``FTRAIN_CACHE_DIR`` > ``$XDG_CACHE_HOME/ftrain``
    > ``~/.cache/ftrain``. The directory is created if missing.

    Example:
        >>> cache_dir("/tmp/ftrain-cache").name
        'ftrain-cache'
    """
    path = cache_path(override)
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_path(override: str | os.PathLike | None = None) -> Path:
    """:func:`cache_dir` without creating it."""
    if override is not None:
        path = Path(override)
    elif os.environ.get("FTRAIN_CACHE_DIR"):
        path = Path(os.environ["FTRAIN_CACHE_DIR"])
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        path = (Path(xdg) if xdg else _home() / ".cache") / "ftrain"
    return path.expanduser()


class NoCacheDirError(OSError):
    """No cache directory is set and there is no home directory to put one in (an
    ``OSError``, as an unwritable one is: a token file's hash is then computed uncached)."""


def _home() -> Path:
    try:
        return Path.home()
    except (RuntimeError, KeyError):  # HOME unset and a uid without a passwd entry
        raise NoCacheDirError(
            f"no data cache directory: HOME is unset and uid {os.getuid()} has no home "
            "directory (a container run with an arbitrary --user); set FTRAIN_CACHE_DIR "
            "(or data.cache_dir, or HOME) to a writable directory"
        ) from None


def _opened(path: Path, fd: int | None):
    """``path`` opened for reading, or the file a caller already holds open as ``fd``
    (read through a duplicate: closing it leaves the caller's open)."""
    return open(path, "rb") if fd is None else open(os.dup(fd), "rb")  # noqa: SIM115


def _full_digest(path: Path, fd: int | None = None) -> str:
    h = hashlib.blake2b(digest_size=16)
    with _opened(path, fd) as f:
        f.seek(0)
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _probe_digest(path: Path, size: int, fd: int | None = None) -> str:
    offsets = {0, max(size - _PROBE, 0)}
    offsets |= {size * (i + 1) // (_N_MIDDLE_PROBES + 1) for i in range(_N_MIDDLE_PROBES)}
    h = hashlib.blake2b(digest_size=16)
    with _opened(path, fd) as f:
        for off in sorted(offsets):
            f.seek(off)
            h.update(off.to_bytes(8, "little"))
            h.update(f.read(_PROBE))
    return h.hexdigest()


def file_identity(st: os.stat_result) -> dict:
    """What says a file is unchanged, beside its path: its size, its mtime, and its inode
    and ctime, which no copy tool can set back (``cp -p``/``rsync -a`` keep the size and
    mtime of a rewritten file; a rename puts another file at the path)."""
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ino": st.st_ino,  # not st_dev: NFS clients number a mount each their own way
        "ctime_ns": st.st_ctime_ns,
    }


def _entry_path(path: Path, cache: Path) -> Path:
    name = hashlib.blake2b(os.fsencode(path), digest_size=12).hexdigest()
    return cache / "fingerprints" / f"{name}.json"


def _write_json_atomic(target: Path, obj: dict) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.parent not in _SWEPT:  # once per process: this runs for every file hashed
        _SWEPT.add(target.parent)
        remove_stale_tmp(target.parent)
    with unique_tmp(target) as tmp:  # two writers (even of one pid) never share a tmp
        tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
        os.replace(tmp, target)


@contextlib.contextmanager
def unique_tmp(target: Path):
    """A fresh temporary path beside ``target`` (``target.tmp-<random>``), removed if the
    block leaves it behind (an error, a KeyboardInterrupt): two processes with one pid (two
    containers on one cache volume) wrote the same ``.tmp-<pid>``, truncating each other's."""
    fd, name = tempfile.mkstemp(prefix=f"{target.name}.tmp-", dir=target.parent)
    try:
        os.fchmod(fd, plain_file_mode())  # mkstemp's 0600 kept other users of a cache out
        # held while the block writes: a sweep by another start passes a file it cannot
        # lock (a writer stopped for an hour, a clock stepped ahead: its file looked dead,
        # was removed, and the writer failed with a wrong "free that much space")
        _lock_or_skip(fd)
        yield Path(name)
    finally:
        os.close(fd)
        Path(name).unlink(missing_ok=True)


def _lock_or_skip(fd: int) -> None:
    """``flock`` ``fd`` (a file system without locks only loses the sweep's protection)."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _held_by_a_writer(path: Path) -> bool:
    """A live :func:`unique_tmp` writer holds a lock on its file; a dead one's is free."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no locks here: the age alone decides, as before
        return False
    finally:
        os.close(fd)
    return False


# a temporary file untouched this long belongs to a writer that died (SIGKILL, power loss):
# a live writer's file is written to, or replaced, far sooner
STALE_TMP_S = 3600.0
_SWEPT: set[Path] = set()  # fingerprint folders this process has swept


def remove_stale_tmp(folder: Path, older_than_s: float = STALE_TMP_S) -> int:
    """Remove ``*.tmp-*`` files in ``folder`` whose mtime is ``older_than_s`` past: what a
    killed writer of :func:`unique_tmp` left (its ``finally`` never ran). Best effort (a
    read-only cache keeps them); returns how many went."""
    removed, cutoff = 0, time.time() - older_than_s
    try:
        for f in folder.glob("*.tmp-*"):
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove
                if f.stat().st_mtime < cutoff and not _held_by_a_writer(f):
                    f.unlink()
                    removed += 1
    except OSError:
        pass
    return removed


def file_digest(
    path: str | os.PathLike, *, cache: str | os.PathLike | None = None, fd: int | None = None
) -> str:
    """The content hash (BLAKE2b-128, hex) of a file, cached by path, size, mtime, inode
    and ctime (:func:`file_identity`).

    Args:
        path: the file to hash.
        cache: cache directory override (see :func:`cache_dir`).
        fd: the file as the caller opened it, hashed instead of what ``path`` names now
            (a file renamed over ``path`` since is not the one the caller reads).

    Returns:
        32 hex characters. Equal for equal content wherever the file lives.

    Raises:
        FileNotFoundError: the file does not exist.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.bin"; _ = p.write_bytes(b"abc")
        >>> len(file_digest(p, cache=p.parent))
        32
    """
    path = Path(path).resolve()
    st = path.stat() if fd is None else os.fstat(fd)
    try:
        entry_file = _entry_path(path, cache_dir(cache))
    except OSError as e:  # a read-only HOME or cache volume, or none: hashed, not cached
        log.warning("fingerprint cache unusable (%s); hashing %s in full", e, path)
        return _full_digest(path, fd)
    try:
        entry = _json.loads(entry_file.read_text())
    except (OSError, ValueError):
        entry = None
    key = {"v": _CACHE_VERSION, "path": str(path)} | file_identity(st)
    if isinstance(entry, dict) and all(entry.get(k) == v for k, v in key.items()):
        if entry.get("probe") == _probe_digest(path, st.st_size, fd):
            return str(entry["digest"])
        log.warning("fingerprint cache: %s changed without a new mtime; re-hashing", path)
    digest = _full_digest(path, fd)
    try:
        _write_json_atomic(
            entry_file, {**key, "digest": digest, "probe": _probe_digest(path, st.st_size, fd)}
        )
    except OSError as e:  # a read-only cache only costs a re-hash next time
        log.warning("fingerprint cache: could not write %s: %s", entry_file, e)
    return digest


def make_fingerprint(
    *,
    kind: str,
    tokenizer: str,
    split: str,
    block_size: int,
    content: str,
    extra: dict | None = None,
) -> str:
    """Assemble a source fingerprint from its parts (see the module docstring).

    Args:
        kind: the source kind, e.g. ``"tokens"``.
        tokenizer: the tokenizer id, e.g. ``"bytes-v1"`` (``"none"`` for raw tokens).
        split: ``"train"``, ``"val"`` or another split name.
        block_size: tokens per sample.
        content: the content hash of the underlying tokens.
        extra: any further facts that change the samples (token range, dtype).

    Example:
        >>> fp = make_fingerprint(kind="t", tokenizer="x", split="train", block_size=8, content="00")
        >>> fp.startswith("t:x:train:bs8:")
        True
    """
    payload = {"kind": kind, "tokenizer": tokenizer, "split": split, "block_size": block_size}
    payload |= {"content": content, "extra": extra or {}}
    digest = hashlib.blake2b(
        json.dumps(payload, sort_keys=True).encode(), digest_size=8
    ).hexdigest()
    return f"{kind}:{tokenizer}:{split}:bs{block_size}:{digest}"


def check_fingerprint(saved: str | None, current: str, allow_changed: bool = False) -> bool:
    """Compare the fingerprint saved in a checkpoint with the current source's.

    Args:
        saved: the fingerprint from the checkpoint metadata (``None``: not recorded).
        current: ``source.fingerprint`` of the data configured now.
        allow_changed: accept a change (config ``data.allow_changed=true``).

    Returns:
        ``True`` when the data changed and the change was allowed (the caller records
        it in the run's metrics/log), else ``False``.

    Raises:
        DataFingerprintError: the fingerprints differ and ``allow_changed`` is false.

    Example:
        >>> check_fingerprint("a", "a")
        False
    """
    if saved is None or saved == current:
        return False
    if allow_changed:
        log.warning(
            "data changed since the checkpoint (saved %s, now %s); continuing because "
            "data.allow_changed=true — the cursor keeps its epoch/position",
            saved,
            current,
        )
        return True
    raise DataFingerprintError(
        "the dataset differs from the one this checkpoint was trained on:\n"
        f"  checkpoint fingerprint: {saved}\n"
        f"  current fingerprint:    {current}\n"
        "Point the data config back at the original data, or, to continue on the new data "
        "from the saved cursor (epoch/position), pass data.allow_changed=true."
    )
