"""One run per run directory: a writability check and the run lock ``RUN_DIR/.lock``.

Two processes training on one ``run.dir`` would skip each other's saves and mix their
records, so a start takes an exclusive ``fcntl.flock`` on ``RUN_DIR/.lock`` and holds it
for the life of the run; the file says who holds it::

    {"pid": 1234, "host": "node7", "started": 1764571200.0, "argv": ["-m", "ftrain", ...]}

- A second start on the same directory is refused (:class:`RunLockError`, exit 2) with the
  holder's pid, host and command.
- The kernel drops a flock when its process dies (SIGKILL, OOM, power loss of a client
  process), so a lock that can be taken is not held: a lock file left by a dead process
  *on this host* is taken over, and the start says so.
- A lock file written on *another host* is refused even when its flock can be taken: on a
  shared file system a flock may not reach across hosts, so that run may be alive. The
  message says how to clear it (remove the file once that run is gone).
- A clean exit empties the file before unlocking, so the next start finds no holder. The
  file itself is never deleted (deleting a lock file races with a starter that opened it).

In a torchrun job only the coordinator (rank 0) takes the lock; the CLI broadcasts a
refusal so every rank stops.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ftrain import _json

__all__ = [
    "LOCK_NAME",
    "RunDirDiskError",
    "RunDirError",
    "RunLock",
    "RunLockError",
    "acquire",
    "check_checkpoint_dirs",
    "check_writable",
    "claim_run_dir",
    "stale_note",
]

LOCK_NAME = ".lock"


class RunDirError(RuntimeError):
    """A run directory (or checkpoint directory) that a run cannot use (exit 2).

    ``reason`` is the operating system's word for it (``Read-only file system``), where
    there is one."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


class RunLockError(RunDirError):
    """Another run holds the run directory (exit 2; the message names it)."""


class RunDirDiskError(RunDirError):
    """The disk under a run or checkpoint directory is full (bytes or inodes), over quota
    or failing: its state of the moment, not the config (exit 1: a supervisor restarts
    once space is freed; exit 2 tells it not to)."""


# what to do about a disk's state of the moment, by errno
_DISK_FIX = {
    errno.ENOSPC: "no free bytes or inodes: free space (df -h, df -i) and re-run",
    errno.EDQUOT: "over the disk quota: free space or raise the quota and re-run",
    errno.EIO: "a disk error: check the disk (dmesg) and re-run",
}


def _disk_or_dir_error(message: str, err: OSError, fix: str) -> RunDirError:
    """``message: reason; fix`` as :class:`RunDirDiskError` for a full or failing disk
    (its own fix), else :class:`RunDirError` with ``fix``."""
    reason = err.strerror or str(err)
    if err.errno in _DISK_FIX:
        return RunDirDiskError(f"{message}: {reason} ({_DISK_FIX[err.errno]})", reason)
    return RunDirError(f"{message}: {reason}{fix}", reason)


def check_writable(path: str | os.PathLike, what: str) -> Path:
    """Create ``path`` if needed and prove a file can be written in it.

    Root ignores permission bits, so this writes (and removes) a real one-byte file rather
    than asking ``os.access``: a read-only mount, a full disk (bytes or inodes) or a
    regular file in the way all show up here, before anything is built.

    Raises:
        RunDirError: ``path`` cannot be created or written; the message names it
            (:class:`RunDirDiskError` for a full or failing disk).
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".ftrain-write-test-") as probe:
            probe.write(b"x")  # a block too: a disk without free bytes still has inodes
            probe.flush()
    except OSError as err:
        way = " (a file is in the way of the directory)"
        way = way if isinstance(err, FileExistsError | NotADirectoryError) else ""
        raise _disk_or_dir_error(
            f"{what}={str(path)!r} is not a writable directory",
            err,
            f"{way}; point {what} at a directory this process can write",
        ) from None
    return path


@dataclass
class RunLock:
    """A held run lock; :meth:`release` (or process death) frees it."""

    path: Path
    fd: int | None
    taken_over: dict = field(default_factory=dict)  # a dead holder's record, if any
    # claims on checkpoint locations outside the run directory (ftrain.ckpt.owner)
    claims: list = field(default_factory=list)

    def release(self) -> None:
        """Remove this run's checkpoint-location claims, empty the file (no holder) and
        drop the flock. Idempotent."""
        while self.claims:
            self.claims.pop().release()
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing the only descriptor releases the flock
        self.fd = None

    def earlier_runs(self) -> list[Path]:
        """The run directories whose checkpoint locations this start took over
        (``checkpoint.take_over``, a moved run): the steps they reached past the restored
        step ran before, and the resume report counts them as redone."""
        mine = Path(self.path).parent.resolve()
        held = (c.taken_from.get("run_dir") for c in self.claims if c.taken_from)
        return [Path(d) for d in dict.fromkeys(held) if isinstance(d, str) and Path(d) != mine]

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(fd: int) -> dict:
    """The JSON record in the lock file, ``{}`` if empty or unreadable (a torn write)."""
    try:
        raw = os.pread(fd, 65536, 0)
        value = _json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (OSError, ValueError):
        return {"unreadable": True}
    return value if isinstance(value, dict) else {"unreadable": True}


def _describe(h: dict) -> str:
    if not h or h.get("unreadable"):
        return "a process whose lock record is unreadable"
    started = h.get("started")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
        if isinstance(started, int | float)
        else "?"
    )
    argv = " ".join(map(str, h.get("argv") or []))
    return f"pid {h.get('pid')} on host {h.get('host')} (started {when}: {argv})"


def acquire(run_dir: str | os.PathLike, argv: list[str] | None = None) -> RunLock:
    """Take the run lock of ``run_dir`` (created if needed) for this process.

    Raises:
        RunLockError: a live process holds it, or a lock file written on another host
            is there on a file system that may be shared (see ``_LOCAL_FS``).
        RunDirError: the lock file cannot be created.
    """
    path = Path(run_dir) / LOCK_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # the umask decides the mode: a hard-coded 0o644 kept the teammates of a group-shared
        # run directory (umask 002, setgid) from resuming it ("Permission denied")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as err:
        verb = "open" if os.path.lexists(path) else "create"
        fix = (
            f" (another user's run lock: make it writable to this user, e.g. chmod g+w {path} "
            "for a group, or run as its owner)"
            if verb == "open" and isinstance(err, PermissionError)
            else ""
        )
        raise _disk_or_dir_error(f"cannot {verb} the run lock {path}", err, fix) from None
    try:
        return _take(fd, path, argv)
    except BaseException:
        os.close(fd)
        raise


def _take(fd: int, path: Path, argv: list[str] | None) -> RunLock:
    host = socket.gethostname()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunLockError(
            f"run.dir {str(path.parent)!r} is in use by {_describe(_holder(fd))}: two runs must "
            "not train in one run directory. Wait for it to finish, stop it (kill PID: it saves "
            "and exits), or use another run.dir / run.name"
        ) from None
    previous = _holder(fd)
    if previous.get("host") not in (None, host) and not _is_local_fs(path):
        raise RunLockError(
            f"run.dir {str(path.parent)!r} has a lock written on another host by "
            f"{_describe(previous)}, which this host cannot check on this shared file "
            f"system ({_fs_type(path)}). If that run is no longer running, remove the lock "
            f"file and start again: rm {path}"
        )
    record = {
        "pid": os.getpid(),
        "host": host,
        "started": time.time(),
        "argv": list(sys.argv if argv is None else argv),
    }
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
    except OSError as err:  # a full disk: one line, exit 1 (was a traceback)
        raise _disk_or_dir_error(f"cannot write the run lock {path}", err, "") from None
    return RunLock(path, fd, taken_over=previous if previous else {})


# File systems on this machine's own disks or memory: no other host can hold a lock on
# them, so a free flock there is proof the holder is gone, whatever host name it wrote (a
# restarted container gets a new one). Anything else may be shared (nfs, cifs, lustre,
# fuse, ceph, ...), where a flock may not reach across hosts: a foreign record is refused.
_LOCAL_FS = frozenset(
    [
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "f2fs",
        "zfs",
        "jfs",
        "reiserfs",
        "tmpfs",
        "ramfs",
        "overlay",
        "squashfs",
        "vfat",
        "exfat",
    ]
)


def _is_local_fs(path: Path) -> bool:
    return _fs_type(path) in _LOCAL_FS


def _fs_type(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> str:
    """The type of the file system holding ``path`` (``/proc/self/mountinfo``: the mount
    with the longest matching mount point, the last of equals — the one on top, visible),
    or ``"unknown"``."""
    target, best, kind = os.fsencode(os.path.realpath(path)), -1, "unknown"
    try:
        lines = mountinfo.read_bytes().splitlines()
    except OSError:
        return kind
    for line in lines:
        fields, _, rest = line.partition(b" - ")
        parts, after = fields.split(), rest.split()
        if len(parts) < 5 or not after:
            continue
        mount = _OCTAL.sub(lambda m: bytes([int(m[1], 8)]), parts[4])  # \040 for a space
        inside = target == mount or target.startswith(mount.rstrip(b"/") + b"/")
        if inside and len(mount) >= best:
            best, kind = len(mount), os.fsdecode(after[0])
    return kind


_OCTAL = re.compile(rb"\\([0-7]{3})")


def stale_note(lock: RunLock) -> str | None:
    """A line for the log when a dead process's lock was taken over, else None."""
    if not lock.taken_over:
        return None
    return (
        f"took over the run lock {lock.path} left by {_describe(lock.taken_over)}, "
        "which is no longer running"
    )


def claim_checkpoint_locations(cfg) -> list:
    """Claim ``checkpoint.dir`` and ``checkpoint.fallback_dir`` for ``run.dir``
    (:mod:`ftrain.ckpt.owner`), also where they lie inside it: the run lock covers only
    runs started on the same ``run.dir``, and a second run elsewhere pointing its
    ``checkpoint.dir`` at this run's (``runs/b`` with ``checkpoint.dir=runs/a/checkpoints``)
    trained into it beside the first, moving its steps aside as another history.

    Raises:
        CheckpointOwnerError: one belongs to another run directory (claims made so far are
            released).
    """
    from ftrain.ckpt.location import parse_location
    from ftrain.ckpt.owner import claim

    run_dir = Path(cfg.run.dir).resolve()
    claims: list = []
    try:
        for d in filter(None, (cfg.checkpoint.dir, cfg.checkpoint.fallback_dir)):
            where = parse_location(d, cfg.checkpoint.storage)
            if not isinstance(where, Path):  # an endpoint that does not answer: said in
                where.probe()  # seconds (the claim's requests retry for minutes each)
            claims.append(claim(where, run_dir, take_over=cfg.checkpoint.take_over))
    except BaseException:
        for c in claims:
            c.release()
        raise
    return claims


def check_checkpoint_dirs(cfg) -> None:
    """The local checkpoint directories can take a save: ``checkpoint.dir`` writable, or,
    where it is not (a disk remounted read-only, full), ``checkpoint.fallback_dir`` —
    what the fallback is for; the run then resumes from the primary's steps and saves to
    the fallback, said once here. An object store is probed by the manager.

    Raises:
        RunDirError: the primary is not writable and there is no writable fallback (both
            named), or a file stands where a directory is configured.
    """
    from ftrain.ckpt.location import parse_location

    def local(key: str) -> bool:
        d = cfg.checkpoint.get(key)
        return bool(d) and isinstance(parse_location(d, cfg.checkpoint.storage), Path)

    fallback = cfg.checkpoint.get("fallback_dir")
    fallback_err = (
        _unwritable(fallback, "checkpoint.fallback_dir") if local("fallback_dir") else None
    )
    if fallback_err is not None and _file_in_the_way(fallback):
        raise fallback_err
    primary_err = _unwritable(cfg.checkpoint.dir, "checkpoint.dir") if local("dir") else None
    if primary_err is None:
        if fallback_err is not None:
            print(
                f"ftrain: warning: {fallback_err} (it takes the saves that checkpoint.dir cannot)",
                flush=True,
            )
        return
    if not fallback or fallback_err is not None or _file_in_the_way(cfg.checkpoint.dir):
        if fallback_err is not None:
            both_disks = all(isinstance(e, RunDirDiskError) for e in (primary_err, fallback_err))
            kind = RunDirDiskError if both_disks else RunDirError
            raise kind(f"{primary_err}; and {fallback_err}") from None
        raise primary_err
    print(
        f"ftrain: warning: checkpoint.dir={str(cfg.checkpoint.dir)!r} is not writable "
        f"({primary_err.reason}); saves go to checkpoint.fallback_dir={str(fallback)!r} "
        "(the steps already in checkpoint.dir are still read)",
        flush=True,
    )


def _unwritable(path, what: str) -> RunDirError | None:
    try:
        check_writable(path, what)
    except RunDirError as err:
        return err
    return None


def _file_in_the_way(path) -> bool:
    """A file where a directory is configured: a config mistake, not a disk's state."""
    p = Path(path)
    return any(q.exists() and not q.is_dir() for q in (p, *p.parents))


def claim_run_dir(cfg, world) -> RunLock:
    """At start, before anything is built: the coordinator checks that ``run.dir`` and
    ``checkpoint.dir`` are writable and takes the run lock; a refusal reaches every rank.

    Other ranks get an unheld :class:`RunLock` (``release`` is a no-op).

    Raises:
        RunDirError / RunLockError: on the coordinator, with its reason; on the other ranks,
            one that points at the coordinator's message.
    """
    from ftrain.dist import agree_any

    lock, failed = RunLock(Path(cfg.run.dir) / LOCK_NAME, None), None
    if world.is_coordinator:
        try:
            check_writable(cfg.run.dir, "run.dir")
            lock = acquire(cfg.run.dir)
            check_checkpoint_dirs(cfg)
            lock.claims = claim_checkpoint_locations(cfg)
        except BaseException as err:  # every rank must hear of it, whatever it is
            lock.release()
            failed = err
    try:
        refused = agree_any(failed is not None)
    except BaseException:  # the collective itself failed: the claims are not kept
        lock.release()
        raise
    if refused:
        from ftrain.dist import broadcast_json

        # the disk's state (exit 1) on every rank alike: a launcher taking any rank's exit
        # code must not read "config, do not retry" (exit 2) for a full disk
        disk = broadcast_json(isinstance(failed, RunDirDiskError))
        if failed is not None:
            raise failed
        kind = RunDirDiskError if disk else RunLockError
        raise kind(
            f"the coordinator (rank 0) refused to start in run.dir {cfg.run.dir!r}; "
            "its message says why and what to change"
        )
    note = stale_note(lock)
    if note:
        print(f"ftrain: {note}", flush=True)
    return lock
