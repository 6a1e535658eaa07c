"""``CheckpointManager``: when to save, where, in the background, what to keep, what to load.

Async saves hold a *reference* to the (immutable) state: no staging copy is made for CPU
tensors; tensors on other devices are copied to the host before ``save`` returns. At most
one save is in flight: a second ``save`` blocks until the first has committed (it is never
silently dropped, so a forced or final save always lands; the wait shows up in the
recorded blocking time). Saves are incremental: a leaf that is the same, unchanged tensor
object as in the step this manager last committed is hard-linked (or, on object stores,
server-side copied) from that step instead of rewritten (:mod:`ftrain.ckpt.incremental`,
which also states what is checked). A background failure is raised by the next ``save``,
``restore``, ``wait`` or ``close`` as :class:`CheckpointSaveError`. The writer is a
non-daemon thread, so a normal interpreter exit finishes the save in flight; a kill leaves
only a staging directory, which is never mistaken for a checkpoint and is swept later.

Example::

    with CheckpointManager("ckpt", save_policy=EveryNSteps(100),
                           keep_policy=AnyOf(LatestN(3), BestN("val_loss", 1))) as mgr:
        for batch in data:
            state, metrics = step(state, batch)
            mgr.save(state, metrics={"loss": float(metrics["loss"])})
    state = CheckpointManager("ckpt").restore(target=state)
"""

from __future__ import annotations

import contextlib
import errno
import logging
import operator
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDictBase

from ftrain.ckpt import aside, hostrng
from ftrain.ckpt import commit as protocol
from ftrain.ckpt import incremental as incr
from ftrain.ckpt.codecs import parse_compression
from ftrain.ckpt.format import (
    DEFAULT_CHUNK_BYTES,
    FORMAT_VERSION,
    CheckpointFormatError,
    CorruptCheckpointError,
    zarr_dtype,
)
from ftrain.ckpt.index import (
    INDEX,
    entry_for,
    load_or_rebuild,
    mark_best,
    reuse_or_read,
    write_index,
)
from ftrain.ckpt.location import CheckpointLocationError, parse_location, same_location
from ftrain.ckpt.mapped import read_tree_mapped
from ftrain.ckpt.meta import json_scalar, read_root_attributes, versions
from ftrain.ckpt.policies import (
    KeepAll,
    KeepPolicy,
    SaveContext,
    SavePolicy,
    StepInfo,
    best_policies,
    check_policy,
    newest_finite,
    ranks_nothing,
)
from ftrain.ckpt.reader import read_tree, specs_of
from ftrain.ckpt.store import (
    DEFAULT_WORKERS,
    check_chunk_sizes,
    check_key_lengths,
    check_path_lengths,
    groups_and_arrays,
    write_tree,
)
from ftrain.ckpt.target import check_only, match_target
from ftrain.ckpt.untracked import count_optimizer_writes
from ftrain.ckpt.writerlock import WriterLock
from ftrain.state.init import check_usable, pin, unpin

if TYPE_CHECKING:
    from ftrain.sharding import Sharder

__all__ = ["CheckpointManager", "CheckpointNotFoundError", "CheckpointSaveError"]

log = logging.getLogger("ftrain.ckpt")
_RESERVED_ATTRS = ("format_version", "step", "time", "metrics", "versions", "host_rng")
_METADATA_ADDS = ("save", "path")  # keys metadata(step) adds to the step's attributes


class CheckpointSaveError(RuntimeError):
    """A save failed (in the background or in every location)."""


class CheckpointNotFoundError(FileNotFoundError):
    """No committed checkpoint (or none that verifies) matches the request."""


def _json_value(name: str, value: object) -> None:
    """``value`` as the writer will write it (strict JSON, sorted keys), or a ValueError
    naming ``name`` (a tensor in the metadata said only "Object of type Tensor is not JSON
    serializable"; a tuple key only "'<' not supported")."""
    import json

    try:
        json.dumps(value, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{name} must be JSON-serialisable (str, int, float, bool, None, lists and dicts "
            f"with string keys; floats finite): {e}"
        ) from None


class CheckpointManager:
    """Saves, retains and restores checkpoints of a state TensorDict under ``directory``.

    Args:
        directory: the primary checkpoint location: a local directory (created on the
            first save) or an object-store URL, ``s3://bucket/prefix`` (also ``gs://``,
            ``az://``; see :mod:`ftrain.ckpt.location` and :mod:`ftrain.ckpt.objstore`).
        save_policy: decides which offered steps are saved (``None``: every one).
        keep_policy: which committed steps to keep (``None``: all). The newest committed
            step is always kept; deletion only happens right after a newer commit.
        async_save: write in a background thread (``save`` returns once the write started).
        fallback_directory: where saves go when the primary location fails with an
            ``OSError`` (ENOSPC, EIO, EACCES, EROFS, a vanished mount, a store error);
            restore uses both. A path or a URL, like ``directory``.
        chunk_bytes: target chunk size (tuning; see ``docs/checkpointing.md``).
        io_workers: I/O threads per save or restore for the large chunks (half as many
            more handle ``zarr.json`` documents and small chunks alongside them).
        compression: ``None`` (raw chunks, the default), ``"zstd"``, ``"zstd:LEVEL"``,
            ``"blosc-lz4"``, ``"blosc-zstd"`` (optionally ``:LEVEL``); see
            :mod:`ftrain.ckpt.codecs`. Restore reads compressed and raw steps alike.
        rank: this process's rank: the key under which saves record its host RNG states
            and from which ``restore(host_rng=True)`` puts them back.
        incremental: link (or server-side copy) the chunks of leaves that are the same,
            unchanged tensor objects as in the step this manager last committed, instead
            of rewriting them (:mod:`ftrain.ckpt.incremental`). ``False``: every save
            writes every byte (each step then has its own copy of every chunk).
        storage_options: object-store settings for both locations (``endpoint``,
            ``region``, ``access_key_id``, ``allow_http``, ...; they win over the
            ``AWS_*``/``GOOGLE_*``/``AZURE_*`` environment), see
            :func:`ftrain.ckpt.location.split_storage_options`. Ignored for local paths.

    Raises:
        CheckpointFormatError: a step under a directory was written in a format this
            ftrain cannot read (nothing is changed on disk).
        CheckpointLocationError: ``directory`` is an unknown scheme or a URL-like path, a
            file (or under one), or one step's own directory; or ``fallback_directory`` is
            the same location under another spelling.
        CheckpointStoreError: an object store refuses the location (no such bucket, bad
            credentials, access denied).

    Example:
        >>> import tempfile
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from ftrain.ckpt import CheckpointManager
        >>> state = TensorDict({"step": torch.tensor(1), "w": torch.ones(2)})
        >>> with tempfile.TemporaryDirectory() as d, CheckpointManager(d, async_save=False) as mgr:
        ...     mgr.save(state)
        True
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        save_policy: SavePolicy | None = None,
        keep_policy: KeepPolicy | None = None,
        async_save: bool = True,
        fallback_directory: str | Path | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        io_workers: int = DEFAULT_WORKERS,
        compression: str | None = None,
        rank: int = 0,
        incremental: bool = True,
        storage_options: Mapping | None = None,
    ) -> None:
        codec = parse_compression(compression)  # ValueError for an unknown codec, now
        self.compression = codec.spec if codec else None
        # a Path (the fast local path) or an ObjectRoot (s3://, gs://, az://: objstore)
        self.directory = parse_location(directory, storage_options)
        self.fallback_directory = (
            parse_location(fallback_directory, storage_options) if fallback_directory else None
        )
        if self.fallback_directory is not None and same_location(
            self.directory, self.fallback_directory
        ):  # every commit would then set its own other "copy" aside: nothing stays listed
            raise CheckpointLocationError(
                f"the fallback location {fallback_directory} is the checkpoint location "
                f"{directory} under another spelling; point the fallback at another disk or "
                "bucket, or leave it unset"
            )
        for key, d in (
            ("directory", self.directory),
            ("fallback_directory", self.fallback_directory),
        ):
            why = protocol.misplaced_location(d) if isinstance(d, Path) else None
            if why:  # found at the first save before, as "File exists", or written into a step
                raise CheckpointLocationError(f"{key}: {why}")
        check_policy(save_policy, "should_save", "save_policy")
        check_policy(keep_policy, "keep", "keep_policy")
        self.save_policy = save_policy
        self.keep_policy = keep_policy or KeepAll()
        self.async_save = async_save
        self.chunk_bytes = _positive_int("chunk_bytes", chunk_bytes, DEFAULT_CHUNK_BYTES)
        if codec and codec.max_chunk_bytes and self.chunk_bytes > codec.max_chunk_bytes:
            raise ValueError(
                f"chunk_bytes={chunk_bytes} is past the {codec.max_chunk_bytes} bytes "
                f"compression={codec.spec!r} compresses at once: pass a smaller chunk_bytes "
                "(the default is 32 MiB) or compression='zstd'"
            )
        self.io_workers = _positive_int("io_workers", io_workers, DEFAULT_WORKERS)
        self.incremental = incremental
        if incremental:
            count_optimizer_writes()  # fused torch.optim kernels leave _version alone
        # the step this manager last committed, its leaves' identities and entries: set
        # only after a commit succeeds, so a failed save never makes the next one link to
        # an uncommitted step
        self._last_commit: incr.LastCommit | None = None
        self._dirs = [self.directory] + (
            [self.fallback_directory] if self.fallback_directory else []
        )
        self._thread: threading.Thread | None = None
        self._writers = WriterLock()  # taken at the first save(): one writer per directory
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._last_step: int | None = None
        self._last_time: float | None = None
        # the last *committed* (step, time): a failed save rolls the policy clock back to it
        self._committed_last: tuple[int | None, float | None] = (None, None)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:  # keys host RNGs
            raise ValueError(
                f"rank must be a whole number >= 0 (this process's rank), got rank={rank!r}"
            )
        self.rank = rank
        # The step this manager restored (the branch point of the history it continues) and
        # the steps it committed itself: a committed step newer than the branch point that
        # this manager did not write belongs to another history and is set aside.
        self._restored_from: int | None = None
        # the steps of the whole-state restores since the last commit, in order: a step
        # newer than the last is of the history trained on from there, even if this
        # manager wrote that number; at the next commit of N the run went on from the
        # newest of them not after N (a look at an older step moves nothing back)
        self._rewinds: list[int] = []
        self._written: set[int] = set()
        self._generation = 0  # of this manager's last commit (see _next_generation)
        self._saved_clock: dict[int, tuple[float, float]] = {}  # step -> (wall, monotonic)
        self._undeletable: set[str] = set()  # copies retention could not delete: warned once
        self._invalid: dict[Path, str] = {}
        self._seals: dict[str, object] = {}
        self.read_bytes = 0  # chunk payload bytes the last restore read (rows: its share)
        self.restored_copy: int | None = None  # the seal of the copy the last restore read
        # save() and wait() from two threads at once (the hang watchdog's save beside a loop
        # that woke up) must not start two background writers or join a thread twice
        self._calls = threading.RLock()
        for d in self._dirs:
            if not isinstance(d, Path):
                d.probe()  # no such bucket / bad credentials: CheckpointStoreError, now
            for p in protocol.sweep_stale(d):
                log.info("removed stale %s", p)
        self._entries = self._load_index()

    # ---- listing ---------------------------------------------------------------
    def _locations(self) -> dict[int, list[Path]]:
        """``{step: [paths...]}`` of committed steps; a step in both locations newest copy
        first (see :func:`_newest_copy_first`), else primary location first."""
        out: dict[int, list[Path]] = {}
        invalid: dict[Path, str] = {}
        seals: dict[str, object] = {}  # which copy each listed path holds (index entries)

        def valid(path, marker: dict) -> None:
            seals[str(path)] = marker.get("manifest_crc32c")
            found = marker.get("generation")
            if isinstance(found, int) and not isinstance(found, bool):
                self._generation = max(self._generation, found)

        for d in self._dirs:
            found = protocol.committed_steps(d, on_invalid=invalid.__setitem__, on_valid=valid)
            for s, p in found.items():
                out.setdefault(s, []).append(p)
        self._invalid, self._seals = invalid, seals
        return {s: _newest_copy_first(ps) if len(ps) > 1 else ps for s, ps in sorted(out.items())}

    def _candidates(self, step: int | None, copy: int | None) -> list[tuple[int, Path]]:
        """``[(step, path), ...]`` a restore tries in order: newest step first, each step's
        newest copy first; only ``step`` (and the copy sealing ``copy``) when named."""
        cands = [(s, p) for s, ps in reversed(self._locations().items()) for p in ps]
        if step is not None:
            cands = [(s, p) for s, p in cands if s == step]
        if copy is not None:
            cands = [(s, p) for s, p in cands if self._seals.get(str(p)) == copy]
        return cands

    def _why_not_listed(self, step: int | None) -> str:
        """What a restore that found nothing can add: why the step's directory does not
        count (a damaged marker), or where a run directory keeps its checkpoints."""
        named = protocol.step_dirname(step) if step is not None else None
        why = [
            f"{p}: {r}" for p, r in self._invalid.items() if named and Path(str(p)).name == named
        ]
        for d in self._dirs:
            below = d / "checkpoints" if isinstance(d, Path) else None
            if below is not None and protocol.committed_steps(below):
                why.append(f"{d} is a run directory: its checkpoints are in {below}, pass that")
        return f" ({'; '.join(why)})" if why else ""

    def invalid_steps(self) -> dict[Path, str]:
        """``step_*`` directories that do not count as checkpoints, with the reason
        (no marker, unreadable or mismatched metadata, not a directory)."""
        self._locations()
        return dict(self._invalid)

    def set_aside_steps(self) -> dict[int, list[Path]]:
        """Steps moved out of the listing (replaced, superseded, unreadable), kept on disk."""
        out: dict[int, list[Path]] = {}
        for d in self._dirs:
            for s, ps in protocol.set_aside_steps(d).items():
                out.setdefault(s, []).extend(ps)
        return dict(sorted(out.items()))

    def all_steps(self) -> list[int]:
        """Committed steps in both locations, ascending (marker-checked, not chunk-verified)."""
        return list(self._locations())

    def committed_here(self, step: int) -> bool:
        """Whether this manager's own save of ``step`` has committed (its background write
        included), answered from memory: asking the location (a marker's HEAD request on
        an object store, retried for minutes in an outage) every training step stalled the
        training loop while a save was pending."""
        return step in self._written

    def committed_copies(self) -> list[tuple[int, int | None]]:
        """``(step, copy)`` of every committed copy, newest step first, then newest copy
        first (primary first on a tie): ``copy`` is the seal :meth:`restore` takes (the
        marker's manifest crc32c)."""
        locations = self._locations()
        return [(s, self._seals.get(str(p))) for s, ps in reversed(locations.items()) for p in ps]

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None``."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metadata(self, step: int, copy: int | None = None) -> dict:
        """The root attributes of ``step`` plus ``"save"`` (bytes, timings) and ``"path"``.

        ``copy``: of that copy of the step (:attr:`restored_copy`: the metadata of what a
        restore read, when two locations hold the step), else of the copy saved last (the
        one :meth:`restore` reads first).

        Raises:
            CheckpointNotFoundError: ``step`` (that copy) is not committed.
            CorruptCheckpointError: its metadata does not verify.
        """
        path = self._committed_path(step, copy, "metadata")
        marker, manifest = protocol.read_committed(path)
        attrs = read_root_attributes(path, manifest)
        facts = ("bytes", "written_bytes", "linked_bytes", "blocking_seconds", "write_seconds")
        save = {k: marker.get(k) for k in facts}
        return attrs | {"save": save, "path": str(path)}

    def arrays(self, step: int, copy: int | None = None) -> dict[str, tuple[tuple, str]]:
        """The arrays of ``step`` as its sealed manifest records them: ``{key path: (shape,
        dtype name)}`` (``"params/w": ((4, 3), "float32")``), nothing read but the manifest.

        Raises:
            CheckpointNotFoundError: as :meth:`metadata`.
        """
        manifest = protocol.read_committed(self._committed_path(step, copy, "arrays"))[1]
        return {k: (tuple(a["shape"]), a["dtype"]) for k, a in manifest["arrays"].items()}

    def _committed_path(self, step: int, copy: int | None, method: str):
        if step is None:  # restore(None) is the newest; these read one named step
            raise TypeError(f"{method}(step): name the step (latest_step() is the newest)")
        step = _as_step(step, method)
        paths = self._locations().get(step) or []
        if copy is not None:
            paths = [p for p in paths if self._seals.get(str(p)) == copy]
        if not paths:
            raise CheckpointNotFoundError(
                f"step {step}{'' if copy is None else f' (copy {copy})'} is not committed; "
                f"available: {self.all_steps()}"
            )
        return paths[0]

    # ---- saving ----------------------------------------------------------------
    def save(
        self,
        state: TensorDictBase,
        *,
        metrics: dict | None = None,
        metadata: dict | None = None,
        force: bool = False,
        host_rng: dict[int, dict] | None = None,
    ) -> bool:
        """Save ``state`` if the save policy (or ``force``) says so.

        A step number that is already committed on disk but was neither written nor
        restored by this manager (a corrupt newest step being redone, or a step of an older
        history after a resume from an earlier step) is written anew; the old directory is
        moved aside at the commit, never deleted before it.

        Args:
            state: a nested TensorDict of tensors; ``state["step"]`` gives the step.
            metrics: numbers (floats, ints or 0-d tensors) recorded with the step.
            metadata: JSON-able facts merged into the root group's attributes.
            force: save regardless of the policy.
            host_rng: ``{rank: hostrng.capture()}`` of every rank to record (default: this
                process's states under ``rank``).

        Returns:
            True if a save was started (async) or committed (sync); False if skipped by
            policy or because this manager already wrote (or restored) this step.

        Raises:
            CheckpointSaveError: a previous background save failed, or (sync) this one
                failed in every location.
            LeafChangedError: a leaf that would be reused (same object, same version
                counter) was changed behind PyTorch's back (a ``ValueError``; nothing is
                saved; see :mod:`ftrain.ckpt.incremental`).
            ValueError: the state or metadata cannot be stored.
            CheckpointDirInUseError: another manager (in this process or another) is
                saving into this directory; nothing is saved.
        """
        with self._calls:  # one save at a time, whichever thread calls (see __init__)
            return self._save(state, metrics, metadata, force, host_rng)

    def _save(self, state, metrics, metadata, force: bool, host_rng) -> bool:
        t0 = time.perf_counter()
        self._check_usable()
        step = self._read_step(state)
        check_usable(state, "save")  # a donated state's tensors already hold a later step
        now = time.monotonic()  # the policy's clock: an NTP step back must not stop saves
        if not self._wants(step, now, force):
            return False
        for i, root in enumerate(self._dirs):
            if isinstance(root, Path):
                self._writers.claim(root, create=i == 0)
        self.wait()  # at most one save in flight
        attrs = self._attributes(step, metrics, metadata, host_rng)
        leaves = self._storable_leaves(state)
        plan = (
            incr.plan_save(self._last_commit, leaves, self.chunk_bytes, self.compression)
            if self.incremental
            else incr.NO_REUSE
        )  # identities from the caller's tensors now; LeafChangedError before anything
        snapshot = incr.host_snapshot(state, leaves, plan.reuse)
        self._last_step, self._last_time = step, now
        if not self.async_save:
            self._write(snapshot, step, attrs, t0, time.perf_counter() - t0, plan)
            return True
        blocking = time.perf_counter() - t0
        # The writer reads the caller's tensors (no copy): pin the state so a donate=True
        # step does not overwrite them before the commit.
        self._start_background(state, step, self._write, snapshot, step, attrs, t0, blocking, plan)
        return True

    def save_sharded(
        self,
        state: TensorDictBase,
        *,
        metrics: dict | None = None,
        metadata: dict | None = None,
        host_rng: dict[int, dict] | None = None,
        group=None,
    ) -> bool:
        """Save a sharded state (DTensor leaves) with every rank writing its own rows into
        one store (:mod:`ftrain.ckpt.sharded`); every rank calls it, once all ranks decided
        to save this step (no policy check here). A local directory or an object store
        (each rank uploads its own chunk objects in parallel; rank 0 puts the manifest and
        marker once all confirmed); a failure raises on every rank and commits nothing.

        With ``async_save`` every rank's part is written in a background thread, as
        :meth:`save` does, and the call returns in milliseconds; the two-phase commit's
        collectives then run on ``group`` (default: a gloo group made now, collectively,
        by :func:`ftrain.dist.checkpoint_group`), never on the group the training step
        uses. A failure is raised on every rank by the next ``save_sharded`` / ``wait``.

        Raises:
            ValueError: the state cannot be stored (a bad key or leaf, a chunk path past
                PATH_MAX), raised on every rank before anything is written.
            CheckpointSaveError: (sync) a rank could not write its part, or the commit
                failed; (async) the previous save did.
        """
        t0 = time.perf_counter()
        self._check_usable()
        step, now = self._read_step(state), time.monotonic()
        self._storable_leaves(state, sharded=True)  # the same on every rank: all raise
        self.wait()
        attrs = self._attributes(step, metrics, metadata, host_rng)
        self._last_step, self._last_time = step, now
        if not self.async_save:
            self._write_sharded(state, step, attrs, t0, 0.0, group)
            return True
        if group is None:
            from ftrain.dist import checkpoint_group

            group = checkpoint_group()
        blocking = time.perf_counter() - t0
        self._start_background(
            state, step, self._write_sharded, state, step, attrs, t0, blocking, group
        )
        return True

    def _write_sharded(self, state, step: int, attrs: dict, t0: float, blocking: float, group):
        with self._unsaved_on_failure(step, "sharded save"):
            done = self._sharded_first(state, step, attrs, t0, blocking, group)
        if done is not None:  # the coordinator: retention, index
            final, manifest = done
            self._after_commit(step, final, time.perf_counter() - t0, manifest)
        else:
            self._written.add(step)
            self._saved_clock.pop(step, None)  # retention's, which the coordinator runs

    def _sharded_first(self, state, step: int, attrs: dict, t0: float, blocking: float, group):
        """:meth:`_write_first` for a sharded save: every rank learns the same failure, so
        every rank moves on to the same next location (the fallback)."""
        from ftrain.ckpt.sharded import save_all_ranks

        def extra(manifest: dict) -> dict:
            return _marker_extra(manifest, attrs, blocking, t0, self._next_generation(step))

        def write(root):
            return save_all_ranks(self, state, step, attrs, extra, group, root=root)

        return self._first_location(step, "sharded save", write)

    def _next_generation(self, step: int) -> int:
        """The generation of the copy of ``step`` about to commit: one more than that of
        any copy of ``step`` committed in a location, of any step this manager listed and
        of its last commit, and no less than the wall clock's milliseconds; so the copy
        saved last outranks the others even when the clock stepped back between them
        (:func:`_newest_copy_first`). Read from the locations at the commit: no copy there
        is the usual case, and costs a missing marker per location."""
        newest = self._generation  # also the highest any listing of this manager saw
        for root in self._dirs:
            try:
                marker, _ = protocol.read_committed(root / protocol.step_dirname(step))
            except (CorruptCheckpointError, CheckpointFormatError, OSError, ValueError):
                continue
            found = marker.get("generation")
            if isinstance(found, int) and not isinstance(found, bool):
                newest = max(newest, found)
        # at least the wall clock's milliseconds: a copy that could not be read now (a
        # primary failing with EIO) is still outranked while the clock is right
        self._generation = max(newest + 1, int(time.time() * 1000))
        return self._generation

    def _storable_leaves(
        self, state: TensorDictBase, sharded: bool = False
    ) -> dict[str, torch.Tensor]:
        """The state's leaves, or the ``ValueError`` the writer would only meet in the
        background (or, sharded, on every rank after trying the fallback as a failing disk)."""
        _, leaves = groups_and_arrays(state)
        _check_leaves(leaves)
        check_chunk_sizes(leaves, self.chunk_bytes, self.compression, rows_only=sharded)
        if isinstance(self._dirs[0], Path):  # a fallback too long fails there, if ever used
            check_path_lengths(self._dirs[0], leaves)
        else:
            check_key_lengths(self._dirs[0].url, leaves)
        return leaves

    @property
    def failed(self) -> bool:
        """A background save failed; the next ``save`` / ``wait`` raises its error (this
        only looks, so a data-parallel run can decide on every rank to stop together)."""
        return self._error is not None

    def join(self) -> None:
        """Block until the save in flight (if any) has finished, without raising its error
        (:attr:`failed` then tells; ``wait`` raises it)."""
        thread = self._thread  # read once: a wait() in another thread may clear it
        if thread is not None:
            thread.join()

    def wants(self, state: TensorDictBase, *, force: bool = False) -> bool:
        """Whether ``save(state, force=force)`` would write now (the save policy and the
        already-saved check), without saving: lets every rank of a data-parallel run take
        part in gathering what the save records (e.g. each rank's host RNG states)."""
        return self._wants(self._read_step(state), time.monotonic(), force)

    def _wants(self, step: int, now: float, force: bool) -> bool:
        ctx = SaveContext(step, now, self._last_step, self._last_time)
        if not force and self.save_policy is not None and not self.save_policy.should_save(ctx):
            return False
        if step == self._last_step or (
            (not self._rewinds or step <= self._rewinds[-1])
            and (step == self._restored_from or step in self._written)
        ):  # after going back, a step number this manager wrote is of the old history
            log.info("[step=%d] already saved; skipping", step)
            return False
        return True

    def _read_step(self, state: TensorDictBase) -> int:
        if not isinstance(state, TensorDictBase):  # a plain dict was "needs ... 'step'"
            raise TypeError(
                f"save() needs a TensorDict, got {type(state).__name__}: wrap it, "
                "TensorDict(state, batch_size=[]) (with a 0-d integer 'step' entry)"
            )
        if "step" not in state.keys():
            raise ValueError("save() needs a TensorDict with a 0-d integer 'step' entry")
        s = state["step"]
        integer = isinstance(s, torch.Tensor) and not (
            s.is_floating_point() or s.is_complex() or s.dtype == torch.bool
        )  # torch.tensor(True) was step 1
        if not integer or s.dim() != 0:
            raise ValueError(f"state['step'] must be a 0-d integer tensor, got {s!r}")
        step = int(s.item())
        if step < 0:  # here, not in the background write (it failed a later call before)
            raise ValueError(f"state['step'] must be >= 0 (a step number), got {step}")
        return step

    def _attributes(
        self,
        step: int,
        metrics: dict | None,
        metadata: dict | None,
        host_rng: dict[int, dict] | None,
    ) -> dict:
        for name, given in (("metrics", metrics), ("metadata", metadata)):
            if given is not None and not isinstance(given, Mapping):
                raise TypeError(f"{name} must be a dict, got {type(given).__name__}: {given!r}")
        _string_keys(metadata or {}, "metadata")
        attrs = dict(metadata or {})
        clash = sorted(set(attrs) & set(_RESERVED_ATTRS))
        if clash:
            raise ValueError(
                f"metadata keys {clash} are reserved by the checkpoint format; rename them"
            )
        hidden = sorted(set(attrs) & set(_METADATA_ADDS))
        if hidden:  # metadata(step) puts its own there: the user's would never be read back
            raise ValueError(
                f"metadata keys {hidden} are taken by metadata(step), which adds the save's "
                "facts and the step's path under them; rename them"
            )
        wall = time.time()  # for people and keep policies; its true age by the monotonic
        self._saved_clock[step] = (wall, time.monotonic())
        attrs |= {
            "format_version": FORMAT_VERSION,
            "step": step,
            "time": wall,
            "metrics": {str(k): _metric_json(k, v) for k, v in (metrics or {}).items()},
            "versions": versions(),
            "host_rng": {
                str(r): v for r, v in (host_rng or {self.rank: hostrng.capture()}).items()
            },
        }
        for key, value in attrs.items():  # as the writer does, naming the key at fault
            _json_value(f"metadata[{key!r}]" if key in (metadata or {}) else key, value)
        return attrs

    def _start_background(self, state: TensorDictBase, step: int, write, *args: object) -> None:
        """Run ``write(*args)`` in the one background save thread; ``state`` stays pinned
        (a donating step never overwrites it) until the write ends."""
        pin(state)
        thread = threading.Thread(
            target=self._run_background,
            args=(state, step, write, *args),
            name=f"ftrain-ckpt-{step}",
        )
        try:
            thread.start()
        except RuntimeError as e:  # no thread to be had (a thread or memory limit)
            # written here instead: a raw RuntimeError lost the save, and the unstarted
            # thread left behind made every later wait() and close() raise
            log.warning(
                "ftrain: cannot start the background save of step %d (%s); writing it in "
                "the calling thread instead",
                step,
                e,
            )
            self._run_background(state, step, write, *args, in_caller=True)
            return
        self._thread = thread

    def _run_background(
        self, state: TensorDictBase, step: int, write, *args: object, in_caller: bool = False
    ) -> None:
        try:
            write(*args)
        except BaseException as e:  # noqa: BLE001 - raised by the next call
            if in_caller and not isinstance(e, Exception):
                raise  # Ctrl-C in the caller's thread is the caller's, now
            self._error = e
            # said now too: a script that ends without wait() or close() never heard of it
            log.error(
                "ftrain: the background save of step %d failed (%s); it is raised by the "
                "next save(), wait() or close() of this manager",
                step,
                _described(e),
            )
        finally:
            unpin(state)

    def _write(
        self,
        snapshot: TensorDictBase,
        step: int,
        attrs: dict,
        t0: float,
        blocking: float,
        plan: incr.SavePlan,
    ) -> None:
        with self._unsaved_on_failure(step, "save"):
            self._set_aside_old_history(step)
            plan = incr.confirm_sources(plan, protocol.read_committed)  # still ours to link?
            final, manifest = self._write_first(snapshot, step, attrs, t0, blocking, plan)
        last, written = self._last_commit, groups_and_arrays(snapshot)[1]
        self._last_commit = incr.remember(last, step, final, manifest, written, plan)
        self._after_commit(step, final, time.perf_counter() - t0, manifest)

    def _write_first(self, snapshot, step: int, attrs: dict, t0: float, blocking: float, plan):
        """Write to the first location that takes it (an OSError moves on to the next)."""

        def write(root):
            return self._write_to(root, snapshot, step, attrs, t0, blocking, plan)

        return self._first_location(step, "save", write)

    def _first_location(self, step: int, what: str, write):
        """``write(root)`` in the first location that takes it: an ``OSError`` moves on to
        the next (the fallback), said once; none taking it is a ``CheckpointSaveError``."""
        errors = []
        for i, root in enumerate(self._dirs):
            try:
                return write(root)
            except protocol.StepTakenError as e:
                # another writer committed this step here first: the fallback would then
                # set the winner's step aside as "a replaced copy"
                raise CheckpointSaveError(
                    f"[step={step}] {what} to {root} lost to another writer, which committed "
                    f"step {step} there first ({e}); nothing was moved aside. Two runs write "
                    "this location: give each its own checkpoint directory"
                ) from e
            except OSError as e:
                errors.append(f"{root}: {e}{_limit_hint(e)}")
                if i + 1 < len(self._dirs):
                    msg = f"[step={step}] {what} to {root} failed ({e}); saving to fallback {self._dirs[i + 1]}"
                    log.warning(msg)
                    warnings.warn(msg, RuntimeWarning, stacklevel=3)
        raise CheckpointSaveError(
            f"[step={step}] {what} failed in every location: " + "; ".join(errors)
        )

    @contextlib.contextmanager
    def _unsaved_on_failure(self, step: int, what: str):
        """A write that fails in any way (an OSError everywhere, but also a MemoryError or a
        codec's error) leaves the step unsaved: a later save may write it (the loop's
        emergency save after an exception, the stop save on SIGTERM), and the error is a
        ``CheckpointSaveError``."""
        try:
            yield
        except BaseException as e:
            self._last_step, self._last_time = self._committed_last
            if isinstance(e, CheckpointSaveError) or not isinstance(e, Exception):
                raise
            raise CheckpointSaveError(
                f"[step={step}] {what} failed: {type(e).__name__}: {e}"
            ) from e

    def _write_to(
        self,
        root: Path,
        snapshot: TensorDictBase,
        step: int,
        attrs: dict,
        t0: float,
        blocking: float,
        plan: incr.SavePlan,
    ) -> tuple[Path, dict]:
        if not isinstance(root, Path):  # object store: no staging, the marker commits
            return root.write_step(
                step,
                snapshot,
                attrs,
                chunk_bytes=self.chunk_bytes,
                compression=self.compression,
                marker_extra=lambda m: _marker_extra(
                    m, attrs, blocking, t0, self._next_generation(step)
                ),
                reuse=plan.reuse,
            )
        staging = protocol.begin(root, step)
        try:
            manifest = write_tree(
                staging.path,
                snapshot,
                attrs,
                chunk_bytes=self.chunk_bytes,
                workers=self.io_workers,
                compression=self.compression,
                reuse=plan.reuse,
            )
            extra = _marker_extra(manifest, attrs, blocking, t0, self._next_generation(step))
            return protocol.commit(staging, manifest, extra), manifest
        except BaseException:
            protocol.abort(staging)
            raise

    # ---- retention and index ---------------------------------------------------
    def _load_index(self) -> dict[int, dict]:
        """The index entries, read or rebuilt, with the keep policy's "best" flags (an
        entry read again from its step, e.g. a rebuilt index, had none)."""
        steps = {s: ps[0] for s, ps in self._locations().items()}
        entries = load_or_rebuild(self._index_path(), steps, self._seals)
        mark_best(entries, best_policies(self.keep_policy))
        return entries

    def _after_commit(self, step: int, final: Path, total: float, manifest: dict) -> None:
        self._committed_last = (
            step,
            self._last_time if self._last_step == step else time.monotonic(),
        )
        with self._lock:
            linked = manifest.get("linked_bytes", 0)
            log.info(
                "[step=%d] committed %s in %.2fs (%d bytes written, %d linked)",
                step,
                final,
                total,
                manifest["nbytes"] - linked,
                linked,
            )
            self._written.add(step)
            self._rewinds = []  # committed: the restores before it are settled
            try:
                self._retain(step, final, total)
            # committed: nothing to undo or retry (a newer format's step beside this run's:
            # retention judges nothing it cannot read)
            # a keep policy of the user's that raises is reported the same way: the step is
            # committed, and failing the next save over it would lose that one
            except Exception as e:
                msg = f"[step={step}] committed, but retention or the index failed: {e!r}"
                log.warning(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=2)

    def _retain(self, step: int, final: Path, total: float) -> None:
        """Histories set aside, the keep policy applied, the index written (under the lock)."""
        locations = self._set_aside_replaced_copies(step, final)
        entries = self._entries_of(locations)
        entries[step] = entry_for(step, final, save_seconds=total)
        now = time.time()
        infos = [
            StepInfo(s, self._saved_at(s, e, now), e.get("metrics") or {})
            for s, e in entries.items()
        ]
        keep = self.keep_policy.keep(infos, now) | {step, max(locations)}
        if ranks_nothing(self.keep_policy, infos):  # a lone BestN with nothing to rank
            keep |= set(locations)
        keep |= newest_finite(entries)  # a diverged run never loses its last good step
        # A step whose metadata could not be read (maybe an EIO or EMFILE of the moment)
        # is not the policy's to judge: deleting it could lose committed work.
        keep |= set(locations) - set(entries)
        for s in sorted(set(locations) - keep):
            if all([self._delete_or_warn(s, p) for p in locations[s]]):  # every copy tried
                entries.pop(s, None)  # a copy left (a read-only disk) is still listed
        mark_best(entries, best_policies(self.keep_policy))
        self._saved_clock = {s: c for s, c in self._saved_clock.items() if s in entries}
        self._entries = entries
        self._store_index()

    def _saved_at(self, step: int, entry: dict, now: float) -> float:
        """The save time a keep policy judges ``step`` by: for a step this manager saved,
        ``now`` less its age on the monotonic clock, so a wall clock stepped since (NTP, a
        VM restored from a snapshot) neither ages it nor makes it young (``YoungerThan``
        deleted every step but the newest after a jump two days ahead); for the others the
        recorded wall-clock time, all there is."""
        wall, mono = self._saved_clock.get(step, (None, None))
        if mono is None or wall != entry.get("time"):  # not (this copy) saved here
            return entry["time"]
        return now - (time.monotonic() - mono)

    def _entries_of(self, locations: dict[int, list[Path]]) -> dict[int, dict]:
        """Index entries of the listed steps: known ones reused, the rest read; a step
        whose metadata cannot be read is left out (and so kept, never judged)."""

        def unreadable(s: int, path, err) -> None:
            log.warning("[step=%d] %s unreadable (%s); kept, not indexed", s, path, err)

        steps = {s: paths[0] for s, paths in locations.items()}
        return reuse_or_read(self._entries, steps, self._seals, unreadable)

    def _set_aside_old_history(self, step: int) -> None:
        """Before committing ``step`` after a restore: the committed steps of the history
        the run left are moved aside, so no kill leaves two histories listed (a restart
        between this and the commit resumes from the restored step, which is what the run
        went back to). Two rules: steps newer than the branch point (the resume) that
        this manager did not write, and, after going back (a step newer than ``step`` is
        listed), every step after the newest restore not after ``step`` (a look at an
        older step moves nothing back: when unsure, too little is set aside, never the
        current history). They stay on disk; ``ckpt list`` shows them."""
        self._finish_cut_short()
        if not self._rewinds:  # no restore since the last commit: nothing to leave
            return  # (the list is emptied by a commit: a failed write keeps it, retried)
        locations = self._locations()
        rewound = max((r for r in self._rewinds if r <= step), default=None)
        went_back = rewound is not None and any(s > step for s in locations)
        moves = []
        for s, paths in locations.items():
            branch = self._restored_from is not None and s > self._restored_from
            old = went_back and s > rewound
            if old or (branch and s not in self._written):
                # the old history's copy of ``step`` itself too: left listed while the new
                # one is written, a kill before the commit would resume the old history
                moves += [(s, p, "replaced" if s == step else "superseded") for p in paths]
        self._move_aside(moves)
        if went_back:  # no longer saved (listed, deleted by retention or set aside before):
            # the new history may save those numbers again, the branch point's included
            self._written = {w for w in self._written if w <= rewound}
            if self._restored_from is not None and rewound < self._restored_from:
                self._restored_from = rewound  # the new common ancestor

    def _delete_or_warn(self, step: int, path) -> bool:
        """Delete a step the keep policy let go; one that cannot be deleted (a location
        remounted read-only) is kept with a warning (once per copy), and retention goes on
        at the other locations: the fallback that took the saves is still pruned."""
        try:
            protocol.delete_step(path)
        except OSError as err:
            level = logging.INFO if str(path) in self._undeletable else logging.WARNING
            self._undeletable.add(str(path))
            log.log(
                level,
                "[step=%d] %s could not be deleted by keep policy (%s); kept",
                step,
                path,
                err,
            )
            return False
        log.info("[step=%d] deleted by keep policy", step)
        return True

    def _move_aside(self, moves: list[tuple[int, object, str]]) -> None:
        """Set ``(step, path, why)`` aside behind a journal in every location involved
        (:mod:`ftrain.ckpt.aside`; two or more moves in all, or any on an object store): a
        kill between the moves leaves none of them listed. Once the moves are done the
        journal goes, or names only the steps that failed to move (unlisted, for the next
        save to move)."""
        journaled = {}
        for root, names in _journal_dirs(moves).items():
            sealed = {n: self._seals.get(str(root / n)) for n in names}
            try:
                aside.write(root, sealed)
                journaled[root] = sealed
            except OSError as e:  # a read-only location: its moves fail too (warned)
                log.warning("could not write %s (%s)", root / aside.JOURNAL, e)
        failed: set[str] = set()
        for s, p, why in sorted(moves, key=lambda m: -m[0]):
            if not self._set_aside_or_warn(s, p, why):
                failed.add(str(p))
        for root, sealed in journaled.items():
            self._settle_journal(root, {n: v for n, v in sealed.items() if str(root / n) in failed})

    def _finish_cut_short(self) -> None:
        """Before each save: the moves aside a journal names (a kill cut them short, or
        they failed) are finished, for the directories whose seal still matches (a step
        committed since under that name is the new history's); the steps are not listed
        meanwhile. One read per location (a missing file; on an object store a request)."""
        for root in self._dirs:
            journal = aside.pending(root)
            if not journal:
                continue
            left = {}
            for name in sorted(set(journal) & _step_dirs(root)):
                m = protocol.STEP_DIR.match(name)
                if not (m and _sealed_as(root / name, journal[name])):
                    continue  # gone, or a step of the new history under that name
                if not self._set_aside_or_warn(int(m.group(1)), root / name, "superseded"):
                    left[name] = journal[name]
            self._settle_journal(root, left)

    def _settle_journal(self, root, left: dict) -> None:
        """The journal of ``root`` after its moves: gone, or naming only ``left``."""
        try:
            if left:
                aside.write(root, left)
            else:
                aside.done(root)
        except OSError as e:  # the steps it names stay unlisted; the next save retries
            log.warning("could not update %s (%s)", root / aside.JOURNAL, e)

    @staticmethod
    def _set_aside_or_warn(step: int, path, why: str) -> bool:
        """Move one step of the other history aside (True); a location that refuses (a
        read-only primary after a disk error) keeps it, with a warning, and the save goes
        on (to the fallback): failing here would stop every later save of the run."""
        try:
            moved = protocol.set_aside(path, why)
        except OSError as e:
            msg = f"[step={step}] could not move {path} aside ({e}); it is kept"
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            return False
        log.warning("[step=%d] moved %s aside to %s (another history)", step, path, moved)
        return True

    def _set_aside_replaced_copies(self, step: int, final: Path) -> dict[int, list[Path]]:
        """After committing ``step``: its older copies elsewhere (the other location) are
        moved aside. Returns the committed steps left (listed again only if one moved)."""
        locations = self._locations()
        others = [p for p in locations.get(step, []) if p != final]
        for p in others:  # one that cannot move (a read-only location) stays listed with a
            # warning, and no longer stops retention and the index of every later save
            self._set_aside_or_warn(step, p, "replaced")
        return self._locations() if others else locations

    def _store_index(self) -> None:
        for d in self._dirs:
            try:
                write_index(d / INDEX, self._entries)
                return
            except OSError as e:
                log.warning("cannot write %s: %s", d / INDEX, e)

    def index(self) -> list[dict]:
        """The index entries (step, path, time, metrics, bytes, timings, best flags)."""
        with self._lock:
            self._entries = self._load_index()
            return [self._entries[s] for s in sorted(self._entries)]

    def _index_path(self) -> Path:
        return next((d / INDEX for d in self._dirs if (d / INDEX).exists()), self.directory / INDEX)

    # ---- restoring -------------------------------------------------------------
    def restore(
        self,
        step: int | None = None,
        *,
        target: TensorDictBase | None = None,
        only: str | tuple[str, ...] | None = None,
        host_rng: bool = False,
        check_metadata: Callable[[dict], None] | None = None,
        rows: Sharder | None = None,
        mmap: bool = False,
        copy: int | None = None,
    ) -> TensorDictBase:
        """Load the newest committed step that verifies (or exactly ``step``).

        The first whole-state restore before this manager's first commit (a resume) makes
        the restored step its branch point: once it commits a newer step, committed steps
        after the branch point that it did not write (another history) are moved aside.
        After whole-state restores, R the newest of them not after the next commit's step
        N, a commit of N older than a listed step means the run went back and trained on
        from R: every listed step after R but N is moved aside (it may save them again), and a save of a step newer than the restored one is never skipped as
        "already saved" (its number may be one this manager wrote, in the old history: the
        new copy replaces it, the old moved aside). A restore to evaluate an old step, followed by commits of newer
        steps, sets nothing aside.

        Args:
            step: the step to load; ``None`` = newest valid, falling back past corrupt ones.
            target: a template; the result must match its keys, shapes and dtypes (all
                differences are reported in one error) and is moved to its devices.
            only: key paths to load, e.g. ``("params",)`` or ``"opt/mu"``.
            host_rng: also set this process's global Python/NumPy/torch/CUDA generators to
                the states recorded for ``rank`` (for user code that draws from them;
                ftrain's own randomness is the key chain in the state). A warning says
                so if the step recorded none for this rank.
            check_metadata: ``check_metadata(attributes)`` validates the caller's own root
                attributes (e.g. a config it will act on); raising
                ``CorruptCheckpointError`` makes the step corrupt, so restore falls back.
            rows: this rank's sharding of the state: read only the chunks of the rows it
                owns of every array it shards, and those leaves come back as DTensors built
                from them (:func:`ftrain.ckpt.sharded.read_owned`); the rest whole. Every
                rank calls it (no collective here: agreeing on the step is the caller's).
                On an object store the same, object by object
                (:func:`ftrain.ckpt.objio.download_owned`).
            mmap: map each array stored as one uncompressed chunk copy-on-write instead of
                copying it (:mod:`ftrain.ckpt.mapped`): a faster cold restore whose pages
                stay shared with the page cache until written; every chunk is still
                verified before this returns. Local directories, whole arrays only.
            copy: read only the copy of ``step`` whose marker seals this manifest crc32c
                (:attr:`restored_copy` of the rank that chose it): when the primary and
                the fallback location both hold ``step`` (a redo whose older copy is not
                set aside yet), every rank of a job reads the one the coordinator read.

        Returns:
            A nested TensorDict (CPU tensors unless ``target`` says otherwise).
            ``self.read_bytes`` is then the chunk payload bytes this call read, and
            ``self.restored_copy`` the restored copy's seal (its manifest crc32c).

        Raises:
            CheckpointNotFoundError: nothing committed, or nothing that verifies.
            ValueError: the checkpoint does not match ``target``, or ``only`` names no key.
        """
        step = _as_step(step)
        self.wait()
        _check_mmap(mmap, rows, self._dirs)
        only_t = _only_paths(only)
        if target is not None and not isinstance(target, TensorDictBase):
            raise TypeError(
                f"restore(target=...) takes a TensorDict template (the fresh state, e.g. "
                f"ftrain.init_state(...)), got {type(target).__name__}"
            )
        cands = self._candidates(step, copy)
        if not cands:
            raise CheckpointNotFoundError(
                f"no committed checkpoint{'' if step is None else f' for step {step}'}"
                f"{'' if copy is None else f' of copy {copy}'} in "
                f"{[str(d) for d in self._dirs]}; available: {self.all_steps()}"
                + self._why_not_listed(step)
            )
        problems, i, relists = [], 0, 0
        while i < len(cands):
            s, path = cands[i]
            try:
                marker, manifest = protocol.read_committed(path)
                specs_of(manifest)  # every field validated before anything acts on it
                attrs = read_root_attributes(path, manifest)  # checksummed, checked
                if check_metadata is not None:
                    check_metadata(attrs)
                check_only(manifest, only_t)
                td = self._read(path, manifest, only_t, rows, mmap)
                rng_states = hostrng.for_rank(attrs, self.rank) if host_rng else None
            except CorruptCheckpointError as e:
                i += 1
                if protocol.step_vanished(path):
                    # another process's retention or go-back took it: list again (a newer
                    # step may be committed by now), never call it corrupt
                    problems.append(f"{path}: deleted or set aside while it was read (a live run)")
                    log.info("[step=%d] %s went away while it was read: listing again", s, path)
                    if relists < _RELISTS:
                        relists += 1
                        tried = cands[:i]
                        cands = tried + [c for c in self._candidates(step, copy) if c not in tried]
                    continue
                problems.append(f"{path}: {e}")
                msg = f"[step={s}] checkpoint {path} is corrupt ({e}){_next_try(cands[i:], s)}"
                log.warning(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
                continue
            log.info("[step=%d] restored from %s", s, path)
            self.restored_copy = marker.get("manifest_crc32c")
            out = td if target is None else match_target(td, target, only_t)
            if host_rng:
                _restore_host_rng(rng_states, s, self.rank)
            if only_t is None:
                self._rewinds.append(s)  # the next commit may go back (see the docstring)
                self._last_step = s  # on disk: the state a save would write again
                self._committed_last = (s, self._committed_last[1])
                if self._restored_from is None and not self._written:
                    self._restored_from = s  # the branch point: the resume, not a later look
                    # a time policy counts from the resume: the restored step is the last
                    # save (EveryNSeconds saved again at the first step of every restart)
                    self._last_time = time.monotonic()
                    self._committed_last = (s, self._last_time)
                if rows is None:  # a sharded save rewrites every row: nothing to link
                    self._remember_restored(s, path, manifest, out)
            return out
        head = "no checkpoint verifies"
        if all(p.endswith("while it was read (a live run)") for p in problems):
            head = "every step tried was deleted or set aside while it was read (a live run)"
        err = CheckpointNotFoundError(f"{head}:\n  " + "\n  ".join(problems))
        err.problems = problems  # "path: why" of each candidate, for a caller's report
        raise err

    def _read(
        self, path, manifest: dict, only: tuple[str, ...] | None, rows, mmap: bool = False
    ) -> TensorDictBase:
        """The step's tree (this rank's rows of it with ``rows``); sets ``read_bytes``."""
        if rows is not None and isinstance(path, Path):
            from ftrain.ckpt.sharded import read_owned

            td, self.read_bytes = read_owned(
                path, manifest, rows, only=only, workers=self.io_workers
            )
            return td
        if rows is not None:  # an object store: this rank's chunk objects only
            from ftrain.ckpt.objio import download_owned

            td, self.read_bytes = download_owned(
                path, manifest, rows, only=only, concurrency=path.root.concurrency
            )
            return td
        read = read_tree_mapped if mmap else read_tree
        td = read(path, manifest, only=only, workers=self.io_workers)
        self.read_bytes = sum(t.nbytes for t in td.values(True, True))  # no third parse
        return td

    def _remember_restored(self, step: int, path: Path, manifest: dict, out) -> None:
        """A whole-state restore by a manager that has committed nothing yet (a resume) is
        a commit it knows: leaves of the restored tree carried into later states as the
        same objects (a resumed fine-tune's frozen base) link from the restored step, so
        the first save after a resume does not rewrite them. Fingerprints come from the
        restored bytes (just verified). A restore later on (e.g. to evaluate an old step)
        leaves the record of this manager's own last commit alone."""
        if self.incremental and self._last_commit is None:
            leaves = groups_and_arrays(out)[1]
            plan = incr.SavePlan(incr.identify(leaves), {})
            self._last_commit = incr.remember(None, step, path, manifest, leaves, plan)

    # ---- lifecycle -------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointManager is closed; create a new one")
        self._raise_pending()

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointSaveError(
                f"a background checkpoint save failed: {_described(err)}"
            ) from err

    def wait(self) -> None:
        """Block until the save in flight (if any) has committed; raise its error if it failed."""
        with self._calls:
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            self._raise_pending()

    def close(self) -> None:
        """Wait for the save in flight, then refuse further saves. Idempotent.

        Under the lock ``save()`` takes (re-entrant, so ``wait()`` inside it too): a save
        from another thread (the hang watchdog's) cannot start between the wait and the
        closing, where it would outlive ``close()`` with its error never raised."""
        with self._calls:
            if not self._closed:
                try:
                    self.wait()
                finally:
                    self._closed = True
                    self._writers.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self.close()
        except CheckpointSaveError:
            if exc is None:
                raise
            log.exception("a checkpoint save failed while handling another exception")


def _limit_hint(err: OSError) -> str:
    """What ``File too large`` means here: a shell's ``ulimit -f`` (Python ignores the
    SIGXFSZ that would have killed the process) or the file system's largest file."""
    if err.errno != errno.EFBIG:
        return ""
    return (
        " (a file passed this process's file size limit: raise or remove `ulimit -f` in "
        "the job's shell, or use a file system that holds files this large)"
    )


def _journal_dirs(moves: list[tuple[int, object, str]]) -> dict[object, list[str]]:
    """``{location: [step directory names]}`` of the locations ``moves`` sets steps aside
    in, to journal: all of them when there are two or more moves (one rename alone is
    atomic), any on an object store (a step's set-aside there is a copy and a delete per
    object)."""
    names: dict[object, list[str]] = {}
    for _, p, _ in moves:
        names.setdefault(_location_of(p), []).append(p.name)
    if len(moves) > 1:  # old 3 in the primary, old 4 in the fallback: both journaled
        return names
    return {root: n for root, n in names.items() if not isinstance(root, Path)}


def _sealed_as(step_dir, seal: object) -> bool:
    """Whether ``step_dir``'s marker holds ``seal`` (an unreadable one does not)."""
    try:
        return protocol.read_committed(step_dir)[0].get("manifest_crc32c") == seal
    except (CorruptCheckpointError, OSError):
        return False


def _location_of(step_dir) -> object:
    """The directory (or ``ObjectRoot``) a step directory is in."""
    return step_dir.parent if isinstance(step_dir, Path) else step_dir.root


def _step_dirs(root) -> set[str]:
    """The names of the ``step_*`` directories (prefixes) in a location."""
    if not isinstance(root, Path):
        return set(root.list_dir("")[0])
    try:
        return {e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False)}
    except (FileNotFoundError, NotADirectoryError):
        return set()


def _newest_copy_first(paths: list) -> list:
    """Two committed copies of one step: the one saved last first. They differ after a
    redo whose old copy could not be moved aside (a primary remounted read-only after a
    disk error, the new copy in the fallback): reading the primary's first resumed the
    history the run had left, silently. Saved last means the higher marker generation
    (the save time of the wall clock chose the old copy after a clock stepped back: a VM
    restored from a snapshot, NTP); the save time orders only copies that both lack one
    (older ftrain). A copy that cannot be read goes last; on a tie the primary stays
    first."""

    def saved_at(path) -> tuple[int, float]:
        try:
            marker, manifest = protocol.read_committed(path)
            when = read_root_attributes(path, manifest).get("time")
        except (CorruptCheckpointError, CheckpointFormatError, OSError, ValueError):
            return (-2, float("-inf"))
        generation = marker.get("generation")
        if not isinstance(generation, int) or isinstance(generation, bool):
            generation = -1
        return (generation, float(when) if isinstance(when, (int, float)) else float("-inf"))

    return sorted(paths, key=saved_at, reverse=True)  # stable: primary first on a tie


def _as_step(step, call: str = "restore") -> int | None:
    """``step`` as an int (a numpy or 0-d integer tensor too); "5" matched nothing ("no
    step 5; available: [4, 5]") and True was step 1."""
    if step is None:
        return None
    try:
        if isinstance(step, bool):
            raise TypeError
        return operator.index(step)
    except TypeError:
        newest = " (or None: the newest)" if call == "restore" else ""
        raise TypeError(f"{call}(step={step!r}): a step is an int{newest}") from None


_RELISTS = 5  # a run deleting the newest step on every listing is not a reader's to outrun


def _next_try(rest: list, step: int) -> str:
    """What a restore does after a corrupt copy: an explicit step has no older one to try
    (it said "trying an older one" and then stopped)."""
    if not rest:
        return "; no other copy to try"
    return "; trying its other copy" if rest[0][0] == step else "; trying an older one"


def _only_paths(only) -> tuple[str, ...] | None:
    """``restore(only=...)`` as key path strings: ``"params"``, ``["params", "opt"]``, or
    TensorDict-style tuple keys (``("opt", "scale_by_adam")`` is ``"opt/scale_by_adam"``)."""
    if only is None:
        return None
    items = [only] if isinstance(only, str) else only
    try:
        items = list(items)
    except TypeError:
        items = [only]
    out = []
    for p in items:
        if isinstance(p, tuple) and p and all(isinstance(x, str) for x in p):
            p = "/".join(p)
        if not isinstance(p, str):
            raise TypeError(
                f"restore(only={only!r}): a key path is a string ('params', 'opt/scale_by_adam') "
                "or a tuple of strings; pass one or a list of them"
            )
        out.append(p)
    return tuple(out)


def _string_keys(node, where: str) -> None:
    """Metadata is JSON, written with sorted keys: ``{1: 1, "a": 2}`` passed ``save()`` and
    failed in the background writer (str and int keys do not sort). Keys of one kind pass
    (JSON writes ``1`` as ``"1"``, as a config's ``{1: a}`` always was)."""
    if isinstance(node, Mapping):
        kinds = {type(k).__name__ for k in node}
        if len(kinds) > 1 and "str" in kinds:
            odd = [k for k in node if not isinstance(k, str)]
            raise ValueError(
                f"{where} mixes string keys with {odd!r}: JSON metadata is written with sorted "
                "keys; make them all strings"
            )
        for k, v in node.items():
            _string_keys(v, f"{where}[{k!r}]")
    elif isinstance(node, list | tuple):
        for i, v in enumerate(node):
            _string_keys(v, f"{where}[{i}]")


def _metric_json(name: object, value: object) -> object:
    try:
        return json_scalar(value)
    except ValueError as e:
        raise ValueError(f"metric {name!r}: {e}") from None


def _positive_int(name: str, value, default: int) -> int:
    """A size or count argument: an ``int`` of at least 1 (0 divided by zero at the first
    save, a float or a negative one planned nonsense chunks)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"CheckpointManager({name}={value!r}): expected a whole number of at least 1 "
            f"(the default is {default})"
        )
    return value


def _check_leaves(leaves: dict[str, torch.Tensor]) -> None:
    """What can only fail in the (background) writer fails here, naming the leaf: a dtype
    the format cannot hold, a meta leaf (a shape and no values)."""
    for k, t in leaves.items():
        try:
            zarr_dtype(t.dtype)
        except TypeError as e:
            raise ValueError(f"leaf {k!r}: {e}") from None
    meta = [k for k, t in leaves.items() if t.is_meta]
    if meta:
        shown = ", ".join(meta[:5]) + (f" and {len(meta) - 5} more" if len(meta) > 5 else "")
        raise ValueError(
            f"cannot save leaves on the meta device (a shape, no values): {shown}; "
            "materialize them before saving (module.to_empty(device=...) and initialise, "
            "or load their weights)"
        )


def _check_mmap(mmap: bool, rows, dirs: list) -> None:
    if not mmap:
        return
    if rows is not None:
        raise ValueError(
            "restore(mmap=True) maps whole arrays; with rows= (a sharded "
            "restore) leave mmap at False"
        )
    remote = [str(d) for d in dirs if not isinstance(d, Path)]
    if remote:
        raise ValueError(
            f"restore(mmap=True) maps local files; {remote} is an object store: "
            "leave mmap at False there"
        )


def _marker_extra(manifest: dict, attrs: dict, blocking: float, t0: float, generation: int) -> dict:
    """The save facts recorded in the marker: the step's chunk bytes, how many of them this
    save wrote and how many it linked (or server-side copied) from the previous step,
    time, blocking and total seconds, and the copy's generation (which of two copies of a
    step was saved last, whatever the wall clock said: :meth:`CheckpointManager._next_generation`)."""
    linked = manifest.get("linked_bytes", 0)
    return {
        "bytes": manifest["nbytes"],
        "written_bytes": manifest["nbytes"] - linked,
        "linked_bytes": linked,
        "blocking_seconds": blocking,
        "time": attrs["time"],
        "write_seconds": time.perf_counter() - t0,
        "generation": generation,
    }


def _restore_host_rng(states: dict | None, step: int, rank: int) -> None:
    if states is None:
        msg = f"[step={step}] the checkpoint recorded no host RNG states for rank {rank}"
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return
    hostrng.restore(states)


def _described(err: BaseException) -> str:
    """``err`` for a message: its type, and its text when it has one (a KeyboardInterrupt
    in the writer said "a background checkpoint save failed: " and nothing more)."""
    text = str(err)
    if isinstance(err, CheckpointSaveError) and text:  # says which step and where itself
        return text
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
