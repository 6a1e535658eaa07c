"""The commit protocol: a step directory either is a complete checkpoint or is ignored.

Protocol for one step (``root/step_00000400``), one writer per step:

1. Create and ``flock`` a lock file ``root/.step_00000400.tmp-<pid>-<hex>.lock``, *then*
   create the staging directory ``root/step_00000400.tmp-<pid>-<hex>/``. The writer holds
   the lock until it has committed or aborted; the kernel drops it if the writer dies.
2. Write every chunk and ``zarr.json`` into the staging directory and make them durable
   (one ``syncfs`` on Linux; elsewhere fsync every file, then every directory bottom-up).
   Chunks and documents of leaves unchanged since the previous commit are hard links to
   that step's files instead (:mod:`ftrain.ckpt.incremental`): already durable, only
   their names are new. Any error aborts: the staging directory is removed (its names
   only: a linked file lives on in the committed step).
3. Write ``manifest.json`` (groups, arrays, shapes, dtypes, chunk shapes, per-chunk
   crc32c, bytes) and fsync it.
4. Write ``COMMITTED`` last: JSON with the step, the format version and the crc32c and
   length of ``manifest.json`` (plus save timings). fsync it and the staging directory.
5. If ``root/step_00000400`` already exists (a corrupt step, or one from an older branch
   of the run being redone), it is first *moved aside* — renamed to
   ``step_00000400.replaced-<hex>`` — never deleted; then ``rename(staging,
   root/step_00000400)`` (atomic on POSIX file systems), fsync ``root``, release and
   unlink the lock. A crash between the two renames leaves the old step aside and no
   step 400: restore falls back to the previous commit, nothing committed is lost.

Reading: a directory counts as a checkpoint only if its name is ``step_<digits>`` and
its ``COMMITTED`` marker parses and matches ``manifest.json`` (crc and length). Listing,
restore and retention all use :func:`committed_steps`. Restore then verifies every chunk
(size + crc32c) and falls back to an older step on any failure (see ``manager``).

Deleting: ``rename(step, step.del-<hex>)`` (atomic: the step leaves the listing at once),
then remove the tree.

Setting aside: ``step_N.replaced-<hex>`` (same step number rewritten),
``step_N.superseded-<hex>`` (a later step of a history that a resume from an earlier step
replaced) and ``step_N.unreadable-<hex>`` (a ``step_*`` directory without a valid marker
that a new commit of the same number needed out of the way). They are never listed,
restored, swept or deleted by ftrain: ``python -m ftrain.ckpt list`` shows them.

Format versions: a marker whose ``format_version`` this ftrain cannot read, confirmed by
the manifest it seals, raises :class:`~ftrain.ckpt.format.CheckpointFormatError` (never
"not committed": a step written by a newer ftrain must not be mistaken for garbage and
cleaned up); one the manifest does not confirm is a damaged marker, a corrupt step.

Sweeping (at start-up): a ``*.tmp-*`` directory whose lock file is missing or can be
``flock``-ed is from a dead writer and is removed; one whose lock is held is in flight and
is left alone. ``*.del-*`` directories, orphan lock files and index temporary files
(``.checkpoints.json.<hex>``) older than a minute are removed too. The lock is
created before the staging directory and unlinked after the rename, so a sweeper never
sees a live staging directory without its lock. Only names that ftrain's own staging and
deletion produce are swept; anything else in ``root`` is left alone.

On stores without atomic rename (object stores), writing ``COMMITTED`` last *is* the
commit; the same marker checks apply (:func:`check_format`, :func:`check_manifest`). The
object-store protocol is :mod:`ftrain.ckpt.objstore`'s: every function here that takes a
location or a step accepts its ``ObjectRoot`` / ``ObjectKey`` too and hands it over.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path

import crc32c

from ftrain import _json
from ftrain.ckpt import aside
from ftrain.ckpt.format import (
    FORMAT_VERSION,
    READABLE_FORMATS,
    CheckpointFormatError,
    CorruptCheckpointError,
    parse_json,
    read_bytes_nofollow,
    read_json,
    write_json,
)
from ftrain.ckpt.store import fsync_dir

log = logging.getLogger(__name__)

__all__ = [
    "UNFINISHED",
    "Staging",
    "abort",
    "begin",
    "check_manifest",
    "commit",
    "committed_steps",
    "delete_step",
    "marker_document",
    "read_committed",
    "set_aside",
    "misplaced_location",
    "set_aside_steps",
    "step_dir_hint",
    "step_dirname",
    "sweep_stale",
]

MARKER = "COMMITTED"
MANIFEST = "manifest.json"
# The step number exactly as step_dirname writes it: ASCII digits, 8 of them or more
# without a leading zero. "step_000000002" or Unicode digits matched too, as a second
# step 2 that listings hid behind the first and retention of the first brought back.
_NUM = r"([0-9]{8}|[1-9][0-9]{8,})"
_STEP_RE = STEP_DIR = re.compile(rf"^step_{_NUM}$")  # STEP_DIR: for other modules
_TMP_RE = re.compile(rf"^step_{_NUM}\.tmp-[0-9a-z-]+$")
_DEL_RE = re.compile(rf"^step_{_NUM}\.del-[0-9a-f]+$")
_ASIDE_RE = re.compile(rf"^step_{_NUM}\.(replaced|superseded|unreadable)-[0-9a-f]+$")

# Fault-injection seam for tests: called with a phase name at each protocol step.
fault_hook: Callable[[str], None] | None = None


class StepTakenError(FileExistsError):
    """Another writer committed this step at this location first (an object store's
    create-only put of the manifest or marker lost). Its objects are the winner's: the
    loser deletes nothing and does not try the fallback location (whose commit would set
    the winner's step aside as a replaced copy)."""


# why a step prefix without a marker is not a checkpoint: on a store that is what a save
# in progress, a killed one or a retention delete that could not finish leaves (locally a
# step directory exists only once committed, so a missing marker there is damage)
UNFINISHED = (
    "no COMMITTED marker: a save or a retention delete that did not finish (nothing "
    "committed; swept at a start once older than the newest commit and 10 minutes)"
)


def _phase(name: str) -> None:
    if fault_hook is not None:
        fault_hook(name)


def step_dirname(step: int) -> str:
    """``400`` -> ``"step_00000400"``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step=}")
    return f"step_{step:08d}"


def misplaced_location(path: Path) -> str | None:
    """Why a local ``path`` cannot be a checkpoint location one writes, or ``None``: a file
    (or a path under one: the first save failed with ``File exists``), or a step's own
    directory (a save wrote ``step_N/`` and an index inside a committed step)."""
    there = path
    while not os.path.lexists(there) and there != there.parent:
        there = there.parent
    if os.path.lexists(there) and not there.is_dir():
        where = "is a file" if there == path else f"lies under {there}, which is a file"
        return f"{path} {where}; a checkpoint location is a directory"
    return step_dir_hint(path)


def step_dir_hint(path: Path) -> str | None:
    """``path`` is a step's own directory (it holds a marker or manifest): what to pass."""
    if not isinstance(path, Path) or not any((path / n).is_file() for n in (MARKER, MANIFEST)):
        return None
    return (
        f"{path} is the directory of one step, not a checkpoint location; pass its parent, "
        f"{path.parent}"
    )


@dataclass
class Staging:
    """A staging directory owned by this process until commit or abort."""

    root: Path
    step: int
    path: Path
    lock_path: Path
    lock_fd: int

    def release(self) -> None:
        if self.lock_fd >= 0:
            try:
                self.lock_path.unlink(missing_ok=True)
            finally:  # the descriptor (and with it the flock) goes whatever unlink did
                os.close(self.lock_fd)
                self.lock_fd = -1


def begin(root: Path, step: int) -> Staging:
    """Create the lock and staging directory for ``step`` under ``root`` (made if missing).

    Raises:
        OSError: ``root`` cannot be created or written.
    """
    root.mkdir(parents=True, exist_ok=True)
    for _ in range(_BEGIN_TRIES):
        staging = _try_begin(root, step)
        if staging is not None:
            return staging
    raise FileExistsError(
        f"the staging lock for step {step} under {root} was removed {_BEGIN_TRIES} times "
        "before it was taken: something other than ftrain's start-up sweep deletes files there"
    )


# Another process's start-up sweep (every CheckpointManager runs one: a restore in another
# process too) may hold or unlink a lock in the instant between its creation and its
# flock, when it looks like a dead writer's; a fresh name is taken then (that failed the
# save: the CLI stopped the run with exit 1).
_BEGIN_TRIES = 5


def _try_begin(root: Path, step: int) -> Staging | None:
    """One try of :func:`begin`; ``None`` if a sweeper removed the lock before the flock."""
    name = f"{step_dirname(step)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    lock_path = root / f".{name}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a sweeper holds it, about to unlink it
            os.close(fd)
            lock_path.unlink(missing_ok=True)
            return None
        if os.fstat(fd).st_nlink == 0:  # a sweeper unlinked it between open and flock
            os.close(fd)
            return None
        (root / name).mkdir()
    except BaseException:
        lock_path.unlink(missing_ok=True)
        os.close(fd)
        raise
    return Staging(root, step, root / name, lock_path, fd)


def commit(staging: Staging, manifest: dict, marker_extra: dict | None = None) -> Path:
    """Steps 3-5 of the protocol; returns the committed directory.

    Raises:
        FileExistsError: the step is already committed (the staging is left to the caller).
        OSError: from the file system.
    """
    _phase("data_written")
    manifest = dict(manifest, step=staging.step)
    write_json(staging.path / MANIFEST, manifest)
    _phase("manifest_written")
    raw = (staging.path / MANIFEST).read_bytes()
    write_json(staging.path / MARKER, marker_document(staging.step, raw, marker_extra))
    fsync_dir(staging.path)
    _phase("marker_written")
    final = staging.root / step_dirname(staging.step)
    if os.path.lexists(final):
        set_aside(final, "replaced" if _is_committed(final) else "unreadable")
    os.rename(staging.path, final)
    try:
        fsync_dir(staging.root)
    except OSError as e:
        # The step is complete and visible (its files and marker are fsynced); only the
        # rename's durability is in doubt. Failing here would report a committed step as
        # not saved, and a fallback save would then set this copy aside.
        log.warning(
            "[step=%d] committed %s, but fsync of %s failed: %s",
            staging.step,
            final,
            staging.root,
            e,
        )
    _phase("renamed")
    try:
        staging.release()
    except OSError as e:  # committed: a lock file left behind is swept at the next start
        log.warning(
            "[step=%d] committed %s, but its staging lock stayed: %s", staging.step, final, e
        )
    return final


def marker_document(step: int, manifest_raw: bytes, extra: dict | None = None) -> dict:
    """The ``COMMITTED`` document sealing ``manifest_raw`` (the manifest's exact bytes)."""
    marker = dict(extra or {})
    marker |= {"format_version": FORMAT_VERSION, "step": step, "ftrain": _ftrain_version()}
    return marker | {
        "manifest_crc32c": crc32c.crc32c(manifest_raw),
        "manifest_bytes": len(manifest_raw),
    }


def abort(staging: Staging) -> None:
    """Remove a staging directory after a failed write (best effort) and drop its lock."""
    shutil.rmtree(staging.path, ignore_errors=True)
    staging.release()


def read_committed(step_dir: Path) -> tuple[dict, dict]:
    """The ``(marker, manifest)`` of a committed step, cross-checked.

    Raises:
        CheckpointFormatError: the marker names a format this ftrain cannot read.
        CorruptCheckpointError: no marker, unreadable JSON, or a marker/manifest mismatch.
    """
    if not isinstance(step_dir, Path):  # an object-store step (ftrain.ckpt.objstore)
        return step_dir.read_committed()
    if os.path.islink(step_dir):
        raise CorruptCheckpointError(f"{step_dir}: is a symbolic link, not a step directory")
    marker = read_json(step_dir / MARKER)
    try:
        raw, unreadable = read_bytes_nofollow(step_dir / MANIFEST), None
    except CorruptCheckpointError as e:  # a newer format's step may name it otherwise
        raw, unreadable = None, e
    check_format(step_dir, marker, raw)
    if unreadable is not None:
        raise unreadable
    return marker, check_manifest(step_dir, step_dir.name, marker, raw)


def check_manifest(where: object, name: str, marker: dict, raw: bytes | None) -> dict:
    """The manifest sealed by ``marker``, parsed; the checks every backend applies.

    Args:
        where: the step (for messages).
        name: the step's directory or prefix name, ``step_<digits>``.
        marker: the parsed, format-checked ``COMMITTED`` document.
        raw: the manifest's bytes (``None``: missing).

    Raises:
        CorruptCheckpointError: a missing manifest, a crc/length mismatch with the marker,
            a step number that disagrees with the name, or a format version that disagrees
            with the marker's.
    """
    if raw is None:
        raise CorruptCheckpointError(f"{where}: {MANIFEST} is missing")
    if not _seals(marker, raw):
        raise CorruptCheckpointError(f"{where}: {MARKER} does not match {MANIFEST}")
    manifest = parse_json(raw, f"{where}/{MANIFEST}")
    m = _STEP_RE.match(name)
    if (
        not m
        or not _same_step(marker, int(m.group(1)))
        or not _same_step(manifest, int(m.group(1)))
    ):
        raise CorruptCheckpointError(f"{where}: marker/manifest step does not match the name")
    if manifest.get("format_version") != marker["format_version"]:  # it says how to read docs
        raise CorruptCheckpointError(f"{where}: marker and manifest disagree on the format")
    return manifest


def _same_step(doc: dict, step: int) -> bool:
    """``doc["step"]`` is the whole number ``step``: ``true`` equals 1 in Python, so a step
    directory ``step_00000001`` whose records said ``"step": true`` counted as step 1."""
    value = doc.get("step")
    return isinstance(value, int) and not isinstance(value, bool) and value == step


def check_format(step_dir: object, marker: dict, manifest_raw: bytes | None) -> None:
    """Refuse a step whose marker names a format this ftrain cannot read.

    An unknown version is a damaged marker (one flipped bit turns format 2 into 3) when the
    manifest it seals (crc32c and length) names a format this ftrain reads: the step is
    corrupt and a restore falls back past it, rather than every listing of the directory
    refusing to go on. Without that evidence it is a newer format, refused.

    Raises:
        CheckpointFormatError: a well-formed but unknown (e.g. newer) format version.
        CorruptCheckpointError: no usable format version at all, or a damaged one.
    """
    version = marker.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise CorruptCheckpointError(f"{step_dir}: {MARKER} has no format version ({version!r})")
    if version not in READABLE_FORMATS:
        sealed = _sealed_format(marker, manifest_raw)
        if type(sealed) is int and sealed in READABLE_FORMATS:
            raise CorruptCheckpointError(
                f"{step_dir}: {MARKER} names format {version}, the manifest it seals format "
                f"{sealed} (a damaged marker)"
            )
        writer = marker.get("ftrain") if isinstance(marker.get("ftrain"), str) else "unknown"
        raise CheckpointFormatError(
            f"{step_dir} was written by ftrain {writer} (format {version}); this is ftrain "
            f"{_ftrain_version()} (format {FORMAT_VERSION}, reads {sorted(READABLE_FORMATS)}). "
            "Upgrade ftrain to resume it, or point checkpoint.dir elsewhere; nothing was changed"
        )


def _seals(marker: dict, raw: bytes) -> bool:
    """``raw`` is the manifest ``marker`` seals (its crc32c and length)."""
    return marker.get("manifest_bytes") == len(raw) and marker.get(
        "manifest_crc32c"
    ) == crc32c.crc32c(raw)


def _sealed_format(marker: dict, raw: bytes | None) -> object:
    """The format version named by the manifest ``marker`` seals (``None``: none such)."""
    if raw is None or not _seals(marker, raw):
        return None
    try:
        return _json.loads(raw).get("format_version")
    except (ValueError, AttributeError):  # not JSON, or not an object
        return None


def _ftrain_version() -> str:
    try:
        return importlib_metadata.version("ftrain")
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


def _is_committed(step_dir: Path) -> bool:
    try:
        read_committed(step_dir)
        return True
    except CorruptCheckpointError:
        return False


def set_aside(step_dir: Path, reason: str) -> Path:
    """Rename a step directory out of the listing (never deleted); returns the new path.

    ``reason`` is ``replaced``, ``superseded`` or ``unreadable`` (see the module docstring).
    """
    if not isinstance(step_dir, Path):
        return step_dir.root.set_aside(step_dir, reason)
    target = step_dir.with_name(f"{step_dir.name}.{reason}-{secrets.token_hex(4)}")
    os.rename(step_dir, target)
    fsync_dir(step_dir.parent)
    return target


def set_aside_steps(root: Path) -> dict[int, list[Path]]:
    """``{step: [paths...]}`` of the steps set aside under ``root``."""
    if not isinstance(root, Path):
        return root.set_aside_steps()
    out: dict[int, list[Path]] = {}
    try:
        names = sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for name in names:
        m = _ASIDE_RE.match(name)
        if m:
            out.setdefault(int(m.group(1)), []).append(root / name)
    return dict(sorted(out.items()))


def committed_steps(
    root: Path,
    *,
    on_invalid: Callable[[Path, str], None] | None = None,
    on_valid: Callable[[Path, dict], None] | None = None,
) -> dict[int, Path]:
    """Every step under ``root`` with a valid marker, ``{step: path}`` (missing root: ``{}``).

    ``on_invalid(path, reason)`` is called for ``step_*`` directories that do not count
    (among them the steps a set-aside journal names: :mod:`ftrain.ckpt.aside`),
    ``on_valid(path, marker)`` with the marker of each one that does.

    Raises:
        CheckpointFormatError: a step was written in a format this ftrain cannot read.
    """
    if not isinstance(root, Path):
        return root.committed_steps(on_invalid=on_invalid, on_valid=on_valid)
    out: dict[int, Path] = {}
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return out
    journal = aside.pending(root)  # an abandoned history whose move aside a kill cut short
    for e in entries:
        m = _STEP_RE.match(e.name)
        if not m:
            continue
        if e.is_symlink() or not e.is_dir():
            if on_invalid is not None:
                on_invalid(Path(e.path), "not a directory (symbolic links are not followed)")
            continue
        try:
            marker, _ = read_committed(Path(e.path))
            if aside.leaving(journal, e.name, marker):
                raise CorruptCheckpointError(_LEAVING)
        except CorruptCheckpointError as err:
            if not os.path.lexists(e.path):
                continue  # deleted or set aside since the scan: it left the listing, not damage
            if on_invalid is not None:
                on_invalid(Path(e.path), str(err))
            continue
        if on_valid is not None:
            on_valid(Path(e.path), marker)
        out[int(m.group(1))] = Path(e.path)
    return dict(sorted(out.items()))


def step_vanished(step_dir) -> bool:
    """``step_dir``'s marker is gone since it was listed: a live run's retention deleted the
    step, or a go-back set it aside, while a reader read it. That is not damage; the reader
    lists again. An object store: ``False`` (a deleted step reads as missing objects)."""
    return isinstance(step_dir, Path) and not os.path.lexists(step_dir / MARKER)


_LEAVING = (
    "a step of the history a resume went back from, named in .setting-aside.json: its move "
    "aside was cut short, the next save finishes it"
)


def delete_step(step_dir: Path) -> None:
    """Atomically drop a step from the listing, then remove its files."""
    if not isinstance(step_dir, Path):
        return step_dir.root.delete_step(step_dir)
    trash = step_dir.with_name(f"{step_dir.name}.del-{secrets.token_hex(4)}")
    os.rename(step_dir, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _lock_is_free(lock_path: Path, *, unlink: bool = False) -> bool:
    """Whether nobody holds the lock (a missing file is free). ``unlink``: a free lock is
    unlinked *while held* (a missing one is then not free: nothing was removed). Unlinked
    after letting it go, it could be a writer's that :func:`begin` had just taken (its
    staging directory not made yet), which then wrote with no lock a later sweep respects."""
    try:
        fd = os.open(lock_path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return not unlink
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if unlink:
            if os.fstat(fd).st_ino != os.lstat(lock_path).st_ino:
                return False  # replaced meanwhile: not the file judged free
            lock_path.unlink()
        return True
    except (BlockingIOError, FileNotFoundError):
        return False
    finally:
        os.close(fd)


def _is_orphan_lock(name: str, names: list[str]) -> bool:
    return name.startswith(".step_") and name.endswith(".lock") and name[1:-5] not in names


def sweep_stale(root: Path) -> list[Path]:
    """Remove staging directories of dead writers, half-deleted steps and orphan locks.

    Returns:
        The paths removed. In-flight staging directories (lock held) are never touched.
    """
    if not isinstance(root, Path):
        return root.sweep_stale()
    removed: list[Path] = []
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for name in names:
        path = root / name
        if _DEL_RE.match(name) or (_TMP_RE.match(name) and _lock_is_free(root / f".{name}.lock")):
            shutil.rmtree(path, ignore_errors=True)
            (root / f".{name}.lock").unlink(missing_ok=True)
            removed.append(path)
        elif _is_orphan_lock(name, names) and _lock_is_free(path, unlink=True):
            removed.append(path)
        elif _is_dead_index_tmp(path):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


# the temporary files of the index (``.checkpoints.json.<pid>-<hex>``) and of the owner
# record (``.owner.<pid>-<mkstemp's 8>``, ftrain.ckpt.owner)
_INDEX_TMP_RE = re.compile(
    r"^\.(?:checkpoints\.json\.(?:(\d+)-)?[0-9a-f]{8}|owner\.(\d+)-[a-z0-9_]{8})$"
)
_INDEX_TMP_AGE_S = 60.0  # older than any index write in flight (one small JSON file)


def _is_dead_index_tmp(path: Path) -> bool:
    """A temporary file of an index or owner-record write that a kill interrupted (each is
    written under a temporary name and renamed or linked into place within milliseconds):
    its writer is gone, or it is older than any write in flight."""
    m = _INDEX_TMP_RE.match(path.name)
    if not m:
        return False
    pid = m.group(1) or m.group(2)
    if pid and not _pid_alive(int(pid)):
        return True
    try:
        return time.time() - os.lstat(path).st_mtime > _INDEX_TMP_AGE_S
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
