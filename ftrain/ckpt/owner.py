"""One run per checkpoint location: the owner record ``.owner.json``.

Why. The run lock (:mod:`ftrain.runlock`) keeps two processes off one ``run.dir``, not a
run in another ``run.dir`` whose ``checkpoint.dir`` (or ``fallback_dir``) points at the
same place — a shared prefix on S3, a path set once for a Hydra sweep whose jobs get their
own ``run.dir``, another run's ``${run.dir}/checkpoints``: two runs writing it skip,
replace and set aside each other's steps, and either may resume from the other's. A start
claims every checkpoint location for its ``run.dir``.

The record. ``LOCATION/.owner.json``::

    {"run_dir": "/abs/run", "host": "node7", "pid": 1234, "started": 1764571200.0,
     "token": "9f2c..."}

- None there: created atomically (a local hard link of a complete temporary file; on an
  object store a put with ``If-None-Match: *``), so of two starts at once one wins and the
  other reads the winner's record.
- Naming this ``run.dir``: a restart of the same run (the run lock already keeps a second
  process out), rewritten with this process.
- Naming another ``run.dir`` that no longer exists on this host, for a location inside
  this ``run.dir``: the run directory was moved (``mv runs/a runs/b``) with its
  checkpoints and record; taken over with a warning.
- Naming another ``run.dir``: refused (:class:`CheckpointOwnerError`, exit 2) with the owner
  and the two ways out — another ``checkpoint.dir``, or ``checkpoint.take_over=true`` once
  that run is gone. An object store has no lock that dies with its process, so a record is
  all a start can go by; a killed run leaves its record, which only its own restart (or a
  take-over) passes.
- Unreadable (a damaged file): taken over with a warning; nothing else could be read from it.
- Unwritable (a full or read-only location, an object store refusing the put): another
  run's record that can be read still refuses the start; otherwise the run starts without
  a claim there, with a warning (a failing ``checkpoint.dir`` is what ``fallback_dir`` is
  for; the run lock covers ``run.dir``). On an object store the record is read before the
  create, so a store without conditional puts cannot overwrite another run's record
  (only two starts within one round trip could both pass there).

The run ends its claim when it ends (also on an error; not on SIGKILL nor on a forced exit:
the hang watchdog's, a second Ctrl-C), only if the record is still its own (its ``token``):
a location holding committed steps keeps the record, marked ``ended`` (they are that run's
history: another ``run.dir`` resuming them is refused, pointed at ``init.from``), and an
empty one is freed. On a local directory every change of the record (a claim, a take-over, a
release's read-then-remove) holds an exclusive ``flock`` on the location's directory, so
a run ending as another takes over cannot remove the new owner's record between reading
it and removing it; an object store has no such lock (there the window is one round trip).
The record is never inside a step: listings, restores and retention ignore it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ftrain import _json
from ftrain._umask import plain_file_mode
from ftrain.ckpt.format import CorruptCheckpointError, read_bytes_nofollow
from ftrain.runlock import RunDirError

__all__ = ["OWNER", "CheckpointOwnerError", "Claim", "claim"]

OWNER = ".owner.json"

log = logging.getLogger("ftrain.ckpt")


class CheckpointOwnerError(RunDirError):
    """The checkpoint location belongs to another run directory (exit 2)."""


@dataclass
class Claim:
    """A held claim on one location; :meth:`release` ends it if the record is still ours."""

    location: object  # pathlib.Path or ftrain.ckpt.objstore.ObjectRoot
    record: dict
    taken_from: dict | None = None  # the record this start replaced, if any
    held: bool = True  # False: the record could not be written (see claim)

    def release(self) -> None:
        """End the claim if the record is still this claim's: a location that holds
        committed steps stays claimed, its record marked ``ended`` (another ``run.dir``
        resuming them would continue this run's history: the next job of a sweep sharing a
        ``checkpoint.dir`` trained on from the previous job's last step); an empty one is
        freed. Never raises (a run ending must not fail over its record; a record left
        behind only makes another run ask)."""
        if not self.held:
            return
        try:
            with _changing(self.location, create=False):
                if (_read(self.location) or {}).get("token") != self.record["token"]:
                    return  # taken over: the new owner's record
                if _holds_steps(self.location):
                    _write(self.location, self.record | {"ended": time.time()}, create=False)
                else:
                    _delete(self.location)
        except Exception as e:  # noqa: BLE001 - a newer-format step, a store's own error
            log.warning("could not update %s/%s: %s", self.location, OWNER, e)

    def renew(self) -> None:
        """Write the record again (``run.overwrite`` moved the directory, record and all)."""
        _write(self.location, self.record, create=False)


def claim(location, run_dir: str | os.PathLike, *, take_over: bool = False) -> Claim:
    """Claim ``location`` (a local directory or an object-store root) for ``run_dir``.

    Args:
        location: ``pathlib.Path`` or :class:`ftrain.ckpt.objstore.ObjectRoot`.
        run_dir: the run directory of this run (compared resolved).
        take_over: replace another run directory's record (``checkpoint.take_over``).

    Raises:
        CheckpointOwnerError: ``location`` belongs to another run directory.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> c = claim(d / "ckpt", d / "run-a")
        >>> claim(d / "ckpt", d / "run-b")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        CheckpointOwnerError: ...
        >>> c.release(); claim(d / "ckpt", d / "run-b").record["run_dir"].endswith("run-b")
        True
    """
    mine = {
        "run_dir": str(Path(run_dir).resolve()),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.time(),
        "token": secrets.token_hex(8),
    }
    try:
        with _changing(location, create=True):
            return _claim_held(location, mine, take_over)
    except OSError as e:  # a full or read-only location (what fallback_dir is there for)
        return _unwritten(location, mine, take_over, e)


def _claim_held(location, mine: dict, take_over: bool) -> Claim:
    """:func:`claim`'s decision, taken while the location's record cannot change."""
    # an object store is read first: one without conditional puts would let a create
    # overwrite another run's record (the put falls back to a plain one)
    first = isinstance(location, Path) or _held(location) is None
    if first and _write(location, mine, create=True):
        return Claim(location, mine)
    held = _held(location)
    other = held is not None and held.get("run_dir") != mine["run_dir"]
    if other and _moved_here(location, held, mine):
        log.warning("%s: its run directory moved here from %r", location, held["run_dir"])
    elif other and _ended_inside(location, held, mine):
        log.warning(
            "%s: the checkpoints of a run that ended under run.dir %r, inside this run.dir "
            "(moved or copied here): continuing them",
            location,
            held["run_dir"],
        )
    elif other and not take_over:
        raise CheckpointOwnerError(_refusal(location, held))
    elif other:
        log.warning("checkpoint.take_over=true: %s was %s", location, _describe(held))
    _write(location, mine, create=False)
    return Claim(location, mine, taken_from=held)


@contextlib.contextmanager
def _changing(location, *, create: bool):
    """Hold the location's directory ``flock`` while its record is read and changed (local
    directories only; see the module docstring). ``create``: make the directory first; a
    release of a directory that is gone has nothing to lock."""
    if not isinstance(location, Path):
        yield
        return
    if create:
        location.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(location, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        yield
        return
    try:
        # a file system without directory flocks (NFS emulates flock with write locks, which
        # a read-only descriptor cannot take) goes on unlocked, as before the lock
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the flock


def _moved_here(location, held: dict, mine: dict) -> bool:
    """The record came along with a moved run directory: the location lies inside this
    ``run.dir`` and the recorded one, on this host, is gone (a copy whose original still
    exists, or one on another host, is not taken: those ask for ``take_over``)."""
    if not isinstance(location, Path) or held.get("host") != mine["host"]:
        return False
    theirs = held.get("run_dir")
    inside = location.resolve().is_relative_to(mine["run_dir"])
    if not inside or not isinstance(theirs, str):
        return False
    if not os.path.lexists(theirs):
        return True
    with contextlib.suppress(OSError):  # the same directory under another path (a bind mount)
        return os.path.samefile(theirs, mine["run_dir"])
    return False


def _ended_inside(location, held: dict, mine: dict) -> bool:
    """A finished run's record in a location inside this ``run.dir``: the run directory
    was moved or copied here, from any host (a copy is its own history in its own place;
    only a location shared by two run directories mixes two)."""
    if not isinstance(location, Path) or _number(held.get("ended")) is None:
        return False
    return location.resolve().is_relative_to(mine["run_dir"])


def _held(location) -> dict | None:
    """The record there (``None``: none, or one too damaged to name a run)."""
    try:
        return _read(location)
    except ValueError as e:
        log.warning("%s/%s is unreadable (%s); taking it over", location, OWNER, e)
        return None


def _unwritten(location, mine: dict, take_over: bool, err: OSError) -> Claim:
    """The record could not be written. Another run's record, if one can be read, still
    refuses the start; otherwise the run starts unguarded there, as before claims (a full
    or read-only checkpoint location must not stop a run whose fallback can take saves;
    the saves themselves report the location's errors)."""
    try:
        held = _held(location)
    except OSError as e:  # neither written nor read: whose it is cannot be known
        raise CheckpointOwnerError(
            f"cannot claim checkpoint location {location} for this run: writing "
            f"{OWNER} failed ({err}) and reading it failed ({e}); check the location "
            "(permissions, space, the store's credentials and endpoint)"
        ) from err
    if held is not None and held.get("token") == mine["token"]:
        return Claim(location, mine)  # the write landed; only its reply was lost
    if held is not None and held.get("run_dir") != mine["run_dir"] and not take_over:
        raise CheckpointOwnerError(_refusal(location, held)) from err
    log.warning(
        "could not claim %s for this run (%s); starting without the claim: keep other runs "
        "off this location",
        location,
        err,
    )
    return Claim(location, mine, taken_from=held, held=False)


def _refusal(location, held: dict) -> str:
    if _number(held.get("ended")) is not None:  # a finished run's steps: its history
        return (
            f"checkpoint location {location} holds the checkpoints of another run: "
            f"{_describe(held)}. A run resuming them from another run.dir continues that "
            "run's history in its directory. Give this run its own checkpoint.dir (the "
            f"default is ${{run.dir}}/checkpoints), with init.from={held.get('run_dir')} to "
            "start from its weights; or, to continue its checkpoints from this run.dir, set "
            f"checkpoint.take_over=true (or remove {location}/{OWNER})"
        )
    return (
        f"checkpoint location {location} belongs to another run: {_describe(held)}. Two runs "
        "writing one checkpoint location set aside and resume each other's steps. Give this "
        "run its own checkpoint.dir (the default is ${run.dir}/checkpoints), or, once that run "
        f"is gone and this run is to continue its checkpoints, set checkpoint.take_over=true "
        f"(or remove {location}/{OWNER})"
    )


def _describe(held: dict) -> str:
    def at(t) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(_number(t) or 0))

    ended = _number(held.get("ended"))
    when = f", ended {at(ended)}" if ended is not None else ""
    return (
        f"run.dir {held.get('run_dir')!r} (pid {held.get('pid')} on host "
        f"{held.get('host')!r}, started {at(held.get('started'))}{when})"
    )


def _number(value) -> float | None:
    """A recorded time, ``None`` unless a finite number (the record is not checksummed)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and abs(value) < 1e11 else None


def _holds_steps(location) -> bool:
    """Whether a step is committed there (what a run resuming it would read): locally any
    ``step_*`` directory with a marker, without reading one (the run's end read every
    marker and manifest); on an object store its listing."""
    from ftrain.ckpt import commit  # ftrain.ckpt imports this module

    if not isinstance(location, Path):
        return bool(commit.committed_steps(location))
    with os.scandir(location) as entries:
        return any(
            commit.STEP_DIR.match(e.name) and os.path.lexists(os.path.join(e.path, commit.MARKER))
            for e in entries
        )


# ---- the record on a local directory or an object store ------------------------------
def _write(location, record: dict, *, create: bool) -> bool:
    """Write the record; with ``create`` only if none exists (returns False if one did)."""
    raw = json.dumps(record, indent=1).encode()
    if not isinstance(location, Path):
        if not create:
            location.put(OWNER, raw)
            return True
        try:
            location.put_new(OWNER, raw)
        except FileExistsError:
            return False
        return True
    location.mkdir(parents=True, exist_ok=True)
    # the writer's pid in the name: a kill's leftover is swept (ftrain.ckpt.commit.sweep_stale)
    fd, tmp = tempfile.mkstemp(prefix=f".owner.{os.getpid()}-", dir=location)
    try:
        # mkstemp's 0600: a record that outlives its run must be readable to a teammate
        # resuming a group-shared run directory (it read as "writing failed")
        os.fchmod(fd, plain_file_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        if not create:
            os.replace(tmp, location / OWNER)
            return True
        try:
            os.link(tmp, location / OWNER)  # atomic, and never a half-written record
        except FileExistsError:
            return False
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _read(location) -> dict | None:
    """The record, ``None`` if there is none; ``ValueError`` if it is not one."""
    if isinstance(location, Path):
        try:  # never through a link nor blocking on a FIFO planted in its place
            raw = read_bytes_nofollow(location / OWNER)
        except CorruptCheckpointError as e:
            if isinstance(e.__cause__, FileNotFoundError):
                return None
            raise ValueError(str(e)) from None
    else:
        raw = location.get(OWNER)
        if raw is None:
            return None
    try:
        held = _json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(held, dict) or not isinstance(held.get("run_dir"), str):
        raise ValueError("no run_dir in it")
    return held


def _delete(location) -> None:
    if isinstance(location, Path):
        (location / OWNER).unlink(missing_ok=True)
    else:
        location.delete([OWNER])
