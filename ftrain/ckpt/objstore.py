"""Checkpoints on object storage (S3, GCS, Azure): the commit protocol without rename.

A location ``s3://bucket/prefix`` is an :class:`ObjectRoot`: a ``zarr.storage.ObjectStore``
(zarr-python's ``Store`` interface, over ``obstore``) rooted at the prefix. A step is the
prefix ``step_00000400/`` holding exactly the objects the local format has as files
(same keys, same bytes: ``zarr.json`` documents, chunks, ``manifest.json``, ``COMMITTED``),
so ``zarr.open_group(store=ObjectStore(...), path="step_00000400", mode="r")`` reads it.

Protocol for one step (one writer per step: the run lock of ``run.dir`` ensures it):

1. Clear the way: if ``step_N/`` holds objects, then with a ``COMMITTED`` marker (a
   committed step being redone, or one with a marker that does not verify) it is first
   copied aside to ``step_N.replaced-<hex>/`` (or ``.unreadable-<hex>/``) by server-side
   copies, marker copied last; then its marker is deleted, then its other objects. Without
   a marker it is a dead writer's partial upload and is deleted. Nothing committed is lost.
2. Upload every chunk and ``zarr.json`` straight to its final key, ``concurrency``
   requests in flight (obstore uploads objects over 5 MiB in multipart, up to 12 parts
   at a time, and retries
   throttling, 5xx and connection errors with backoff: :data:`ftrain.ckpt.location.RETRY`).
   Every request is confirmed (awaited) before the next phase; any error aborts: the
   objects uploaded so far are deleted (best effort; a leftover is swept later). Chunks
   of leaves unchanged since the previous commit (:mod:`ftrain.ckpt.incremental`) are
   server-side copies of that step's objects instead of uploads: the new step still owns
   every object it lists, so deleting the older step never breaks it.
3. Put ``manifest.json`` (every array, shape, dtype, chunk crc32c, document checksums).
   Create-only (``If-None-Match: *``): a manifest already there is a second writer's
   (the way was cleared in step 1), and this save fails instead of unsealing the other
   writer's committed step.
4. Put ``COMMITTED`` *last*, with ``If-None-Match: *`` (obstore ``mode="create"``): the
   step exists from this moment. If a marker appeared meanwhile (a second writer committed
   the same step first) the put fails and this save fails: two writers cannot both commit
   one step. (Two writers of one step — the run lock and the location's owner claim
   prevent that in the CLI; a zombie writer after a take-over can still do it — may
   overwrite each other's chunks before that: the committed step then fails its crc32c
   checks on restore, which falls back to an older step. Stores without conditional puts
   get plain puts: the last writer wins; S3, GCS, Azure, MinIO and moto support them.)

Reading: a step counts only if its ``COMMITTED`` parses, names a readable format, and
seals ``manifest.json`` (crc32c and length) with the step matching the name — the same
checks as the local path (:func:`ftrain.ckpt.commit.check_manifest`). Restore lists the
step once (sizes checked before anything is allocated), reads chunks concurrently and
verifies every crc32c; any defect falls back to an older step.

Deleting (retention): the marker first (the step leaves the listing at once), then the
rest. Setting aside: copy to ``step_N.<reason>-<hex>/`` (marker last), then delete as
above. Sweeping at start-up: a marker-less ``step_N/`` is removed only when ``N`` is below
the newest committed step *and* every object in it is older than that commit's marker
*and* older than :data:`SWEEP_MIN_AGE_S` (10 minutes). One manager writes one step at a
time, in step order, so a writer still in flight would have to have uploaded nothing for
longer than both: only dead writers' uploads go. Other marker-less prefixes are left
alone (listed as invalid) until their step is written again (step 1).

Errors: no such bucket, bad credentials, access denied, or an endpoint still failing
after retries raise :class:`~ftrain.ckpt.location.CheckpointStoreError` naming the URL
and the store's reason (an ``OSError``: a save then tries the fallback location).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import obstore
from tensordict import TensorDictBase
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from ftrain.ckpt import aside
from ftrain.ckpt import commit as protocol
from ftrain.ckpt.format import CorruptCheckpointError, json_bytes, parse_json
from ftrain.ckpt.location import PROBE_RETRY, CheckpointStoreError, describe_error, open_store

__all__ = ["SWEEP_MIN_AGE_S", "ObjectKey", "ObjectRoot", "gather_bounded"]

log = logging.getLogger("ftrain.ckpt")
SWEEP_MIN_AGE_S = 600.0  # a marker-less step prefix younger than this is never swept
# objects in flight per save/restore: the local path's measured "8 arrays in flight" on 2
# cores; not tuned for a remote store (each large object is itself a multipart upload)
DEFAULT_CONCURRENCY = 8
_PROTO = default_buffer_prototype()


@dataclass(frozen=True)
class ObjectKey:
    """One key under an :class:`ObjectRoot`: a step prefix (``step_00000400``), or an
    object (``checkpoints.json``). Has the few path-like methods the manager uses."""

    root: ObjectRoot
    key: str

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return f"{self.root.url}/{self.key}"

    def __truediv__(self, name: str) -> ObjectKey:
        return ObjectKey(self.root, f"{self.key}/{name}")

    def read_bytes(self) -> bytes:
        data = self.root.get(self.key)
        if data is None:
            raise FileNotFoundError(f"{self}: no such object")
        return data

    def write_bytes(self, data: bytes) -> None:
        self.root.put(self.key, data)

    def exists(self) -> bool:
        return self.root.head(self.key) is not None

    def stat(self) -> SimpleNamespace:
        """``st_mtime`` / ``st_size`` of the object (``FileNotFoundError`` if missing)."""
        meta = self.root.head(self.key)
        if meta is None:
            raise FileNotFoundError(f"{self}: no such object")
        return SimpleNamespace(st_mtime=meta["last_modified"].timestamp(), st_size=meta["size"])

    # step operations (the protocol functions of ftrain.ckpt.commit hand these over)
    def read_committed(self) -> tuple[dict, dict]:
        return self.root.read_committed(self)

    def read_document(self, rel: str, *, checksum: list | None = None) -> dict:
        return parse_json(self.root.get(f"{self.key}/{rel}"), self / rel, checksum=checksum)

    def read_tree(self, manifest: dict, *, only: tuple[str, ...] | None = None):
        from ftrain.ckpt.objio import download_tree

        return download_tree(self, manifest, only=only, concurrency=self.root.concurrency)

    def verify_tree(self, manifest: dict) -> int:
        from ftrain.ckpt.objio import verify_objects

        return verify_objects(self, manifest)


@dataclass(frozen=True)
class ObjectRoot:
    """A checkpoint location on an object store (see the module docstring).

    Example:
        >>> root = ObjectRoot.open("s3://bucket/ckpt")  # doctest: +SKIP
        >>> root.committed_steps()  # doctest: +SKIP
        {400: ObjectKey(...)}
    """

    url: str
    store: object = field(compare=False, repr=False)
    concurrency: int = field(default=DEFAULT_CONCURRENCY, compare=False)
    # the same store with quick retries, for :meth:`probe` (None: probe with ``store``)
    probe_store: object = field(default=None, compare=False, repr=False)

    @classmethod
    def open(cls, url: str, storage: Mapping | None = None) -> ObjectRoot:
        """Configure the store for ``url`` with the environment's settings overridden by
        ``storage`` options (no request is made; see :meth:`probe`)."""
        quick = open_store(url, storage, PROBE_RETRY)
        return cls(url, open_store(url, storage), probe_store=quick)

    def __str__(self) -> str:
        return self.url

    def __truediv__(self, name: str) -> ObjectKey:
        return ObjectKey(self, name)

    def is_dir(self) -> bool:
        """Whether anything is stored under the prefix (``CheckpointStoreError`` if the
        bucket cannot be listed)."""
        dirs, objects = self.list_dir("")
        return bool(dirs or objects)

    # ---- requests: every store error becomes CheckpointStoreError naming the key -----
    def _run(self, what: str, fn, *args, **kwargs):
        """``await fn(*args, **kwargs)`` on zarr-python's I/O event loop (obstore's async
        calls need a running loop when called, hence the wrapper coroutine)."""

        async def call():
            return await fn(*args, **kwargs)

        try:
            return sync(call())
        except (CheckpointStoreError, CorruptCheckpointError, FileExistsError):
            raise
        except (obstore.exceptions.BaseError, OSError) as e:
            where = f"{self.url}/{what}" if what else self.url
            raise CheckpointStoreError(f"{where}: {describe_error(e)}") from e
        except Exception as e:
            if type(e).__name__ != "RustPanic":  # the client's panic: a bad setting, likely
                raise
            where = f"{self.url}/{what}" if what else self.url
            raise CheckpointStoreError(
                f"{where}: the object store client failed ({describe_error(e)}); check the "
                "endpoint (AWS_ENDPOINT_URL, checkpoint.storage.endpoint: http(s)://HOST:PORT)"
            ) from e

    def probe(self) -> None:
        """One listing request: the bucket exists and the credentials may list it.

        Raises:
            CheckpointStoreError: naming the URL and the store's reason.
        """
        store = (self.probe_store or self.store).store
        try:
            self._run("", obstore.list_with_delimiter_async, store, None)
        except CheckpointStoreError as e:
            bucket = self.url.split("://", 1)[1].split("/", 1)[0]
            raise CheckpointStoreError(
                f"cannot use checkpoint location {self.url} (bucket {bucket!r}): "
                f"{str(e).split(': ', 1)[-1]}; check the bucket name, the credentials "
                "(AWS_ACCESS_KEY_ID, ...) and the endpoint (AWS_ENDPOINT_URL; an http:// "
                "endpoint also needs AWS_ALLOW_HTTP=true)"
            ) from e

    def get(self, key: str) -> bytes | None:
        buf = self._run(key, self.store.get, key, _PROTO)
        return None if buf is None else buf.to_bytes()

    def put(self, key: str, data: bytes) -> None:
        self._run(key, self.store.set, key, _PROTO.buffer.from_bytes(data))

    def put_new(self, key: str, data: bytes) -> None:
        """Put ``key`` only if no object has that key (``If-None-Match: *``).

        Raises:
            FileExistsError: the key exists (another writer was first).
        """
        self._run(key, _put_create, self.store.store, key, data)

    def head(self, key: str) -> dict | None:
        return self._run(key, _head, self.store.store, key)

    def list(self, prefix: str) -> list[dict]:
        """Every object under ``prefix`` (``path`` relative to the root, ``size``,
        ``last_modified``)."""
        return self._run(prefix, _list, self.store.store, prefix)

    def list_dir(self, prefix: str) -> tuple[list[str], list[str]]:
        """``(sub-prefix names, object names)`` directly under ``prefix``."""
        res = self._run(prefix, obstore.list_with_delimiter_async, self.store.store, prefix or None)
        strip = len(prefix) + 1 if prefix else 0
        dirs = [p[strip:].rstrip("/") for p in res["common_prefixes"]]
        return dirs, [m["path"][strip:] for m in res["objects"]]

    def delete(self, keys: list[str]) -> None:
        """Delete ``keys`` (missing ones are fine), ``concurrency`` at a time."""
        self._run(keys[0] if keys else "", _each, self.store.delete, keys, self.concurrency)

    def copy(self, pairs: list[tuple[str, str]]) -> None:
        """Server-side copies ``src -> dst`` (no data passes through this process)."""

        async def one(src: str, dst: str) -> None:
            await obstore.copy_async(self.store.store, src, dst)

        self._run(pairs[0][0] if pairs else "", _each, one, pairs, self.concurrency)

    # ---- the protocol -----------------------------------------------------------
    def read_committed(self, step: ObjectKey) -> tuple[dict, dict]:
        """``(marker, manifest)`` of a committed step, cross-checked like a local one.

        Raises:
            CheckpointFormatError: a format this ftrain cannot read.
            CorruptCheckpointError: no marker, unreadable JSON, or a marker/manifest mismatch.
        """
        return self._check_committed(step, *self._run(step.key, self._get_sealed, step.key))

    async def _get_sealed(self, key: str) -> tuple[bytes | None, bytes | None]:
        """The marker's and the manifest's bytes (``None``: missing), fetched together."""
        marker, manifest = await asyncio.gather(
            self.store.get(f"{key}/{protocol.MARKER}", _PROTO),
            self.store.get(f"{key}/{protocol.MANIFEST}", _PROTO),
        )
        return tuple(None if b is None else b.to_bytes() for b in (marker, manifest))

    def _check_committed(self, step: ObjectKey, marker_raw, manifest_raw) -> tuple[dict, dict]:
        if marker_raw is None:  # the normal state of a step being saved or deleted
            raise CorruptCheckpointError(f"{step}: {protocol.UNFINISHED}")
        marker = parse_json(marker_raw, step / protocol.MARKER)
        protocol.check_format(step, marker, manifest_raw)
        return marker, protocol.check_manifest(step, step.name, marker, manifest_raw)

    def committed_steps(
        self,
        *,
        on_invalid: Callable[[object, str], None] | None = None,
        on_valid: Callable[[object, dict], None] | None = None,
    ) -> dict[int, ObjectKey]:
        """``{step: ObjectKey}`` of every step whose marker verifies (missing: ``{}``);
        ``on_invalid``/``on_valid`` as :func:`ftrain.ckpt.commit.committed_steps`'."""
        dirs, objects = self.list_dir("")
        out: dict[int, ObjectKey] = {}
        for name in objects:
            if protocol._STEP_RE.match(name) and on_invalid is not None:
                on_invalid(self / name, "an object, not a step prefix")
        # an abandoned history whose move aside a kill cut short (ftrain.ckpt.aside)
        journal = aside.pending(self) if aside.JOURNAL in objects else {}
        names = sorted(n for n in dirs if protocol._STEP_RE.match(n))
        # every step's marker and manifest in one round of concurrent requests
        sealed = self._run(
            "", gather_bounded, [self._sealed_or_error(n) for n in names], self.concurrency
        )
        _raise_if_nothing_answered(self, names, sealed)
        for name, raws in zip(names, sealed, strict=True):
            m = protocol._STEP_RE.match(name)
            try:
                if isinstance(raws, Exception):  # this step's objects refused, not the store
                    raise CorruptCheckpointError(
                        f"{self / name}: its marker or manifest cannot be read "
                        f"({describe_error(raws)}; archived by a lifecycle rule, or access "
                        "denied?)"
                    )
                marker, _ = self._check_committed(self / name, *raws)
                if aside.leaving(journal, name, marker):
                    raise CorruptCheckpointError(protocol._LEAVING)
            except CorruptCheckpointError as err:
                if on_invalid is not None:
                    on_invalid(self / name, str(err))
                continue
            if on_valid is not None:
                on_valid(self / name, marker)
            out[int(m.group(1))] = self / name
        return dict(sorted(out.items()))

    async def _sealed_or_error(self, key: str):
        """:meth:`_get_sealed`, or the store's refusal of this step's objects (403: archived
        by a lifecycle rule, access denied): one such step must not make every other step
        unlistable. Any other error (a timeout, a 5xx after retries) is the store failing
        and is raised: taking it for a bad step would resume an older one."""
        try:
            return await self._get_sealed(key)
        except obstore.exceptions.PermissionDeniedError as e:
            return e

    def set_aside_steps(self) -> dict[int, list[ObjectKey]]:
        """``{step: [keys...]}`` of the steps set aside (replaced, superseded, unreadable)."""
        out: dict[int, list[ObjectKey]] = {}
        for name in sorted(self.list_dir("")[0]):
            m = protocol._ASIDE_RE.match(name)
            if m:
                out.setdefault(int(m.group(1)), []).append(self / name)
        return dict(sorted(out.items()))

    def delete_step(self, step: ObjectKey) -> None:
        """The marker first (the step leaves the listing), then every other object.

        Raises:
            CheckpointStoreError: only while the step is still committed (the marker's
                delete failed). Once the marker is gone the step is deleted; objects a
                failing store left are a warning, swept at a later start (a caller told
                "kept" kept indexing a step that was no longer listed).
        """
        self.delete([f"{step.key}/{protocol.MARKER}"])
        protocol._phase("delete_marker_removed")
        try:
            self.delete([m["path"] for m in self.list(step.key + "/")])
        except CheckpointStoreError as err:
            log.warning(
                "%s: deleted (its marker is gone), but some of its objects were not (%s); a "
                "later start's sweep removes them",
                step,
                err,
            )

    def set_aside(self, step: ObjectKey, reason: str) -> ObjectKey:
        """Copy ``step`` to ``step_N.<reason>-<hex>/`` (marker last), then delete it."""
        target = self / f"{step.name}.{reason}-{secrets.token_hex(4)}"
        keys = [m["path"] for m in self.list(step.key + "/")]
        marker = f"{step.key}/{protocol.MARKER}"
        rest = [k for k in keys if k != marker]
        self.copy([(k, target.key + k[len(step.key) :]) for k in rest])
        if marker in keys:
            self.copy([(marker, f"{target.key}/{protocol.MARKER}")])
        self.delete_step(step)
        return target

    def clear_way(self, step: int) -> ObjectKey | None:
        """Step 1 of the protocol: make ``step_N/`` empty without losing a commit. Returns
        where an intact committed step N was moved aside (``None``: nothing intact was
        there), for :meth:`put_back` if the new upload fails."""
        key = self / protocol.step_dirname(step)
        objects = self.list(key.key + "/")
        if not objects:
            return None
        if not any(m["path"] == f"{key.key}/{protocol.MARKER}" for m in objects):
            # a dead writer's partial upload: object stores have no staging directory
            self.delete([m["path"] for m in objects])
            return None
        try:
            self.read_committed(key)
            reason = "replaced"
        except CorruptCheckpointError:
            reason = "unreadable"
        moved = self.set_aside(key, reason)
        log.warning("[step=%d] moved %s aside to %s before rewriting it", step, key, moved)
        return moved if reason == "replaced" else None

    def put_back(self, moved: ObjectKey, step: int) -> None:
        """An intact step that :meth:`clear_way` moved aside, back in its place after the
        upload that was to replace it failed (marker last): the failed redo left the run's
        newest commit unlisted, so restore went back to an older step. Best effort: the
        copy set aside stays if this fails (``ckpt list`` shows it)."""
        key = self / protocol.step_dirname(step)
        try:
            if self.head(f"{key.key}/{protocol.MARKER}") is not None:
                return  # the new step did commit (interrupted after its marker): it stands
            self.abort_step(key)  # the failed upload's objects, if any are left
            keys = [m["path"] for m in self.list(moved.key + "/")]
            marker = f"{moved.key}/{protocol.MARKER}"
            self.copy([(k, key.key + k[len(moved.key) :]) for k in keys if k != marker])
            self.copy([(marker, f"{key.key}/{protocol.MARKER}")])
            self.delete_step(moved)
            log.warning("[step=%d] the new save failed: %s is back in place", step, key)
        except Exception as e:  # noqa: BLE001 - the save's own error is raised after this
            log.warning("[step=%d] could not put %s back (%s): it stays aside", step, moved, e)

    def sweep_stale(self) -> list[ObjectKey]:
        """Remove dead writers' marker-less step prefixes (see the module docstring)."""
        committed = self.committed_steps()
        if not committed:
            return []
        newest = max(committed)
        head = self.head(f"{committed[newest].key}/{protocol.MARKER}")
        if head is None:
            return []
        cutoff = min(head["last_modified"].timestamp(), time.time() - SWEEP_MIN_AGE_S)
        removed = []
        for name in self.list_dir("")[0]:
            m = protocol._STEP_RE.match(name)
            if not m or int(m.group(1)) >= newest or int(m.group(1)) in committed:
                continue
            objects = self.list(name + "/")
            if any(o["path"] == f"{name}/{protocol.MARKER}" for o in objects):
                continue  # a marker that does not verify: kept, like a corrupt local step
            if objects and all(o["last_modified"].timestamp() < cutoff for o in objects):
                self.delete([o["path"] for o in objects])
                removed.append(self / name)
        return removed

    def write_step(
        self,
        step: int,
        state: TensorDictBase,
        attributes: dict,
        *,
        chunk_bytes: int,
        compression: str | None,
        marker_extra: Callable[[dict], dict],
        reuse: dict | None = None,
    ) -> tuple[ObjectKey, dict]:
        """Steps 1-4 of the protocol; returns the committed step and its manifest.

        Args:
            step: the step number.
            state: CPU tensors to save.
            attributes: the root group's attributes.
            chunk_bytes: target chunk size.
            compression: canonical codec spec or ``None``.
            marker_extra: ``marker_extra(manifest)`` gives the marker's extra fields.
            reuse: leaves to server-side copy from the previous step instead of uploading
                (:class:`ftrain.ckpt.incremental.Reuse`; see :mod:`ftrain.ckpt.objio`).

        Raises:
            CheckpointStoreError: a request failed; FileExistsError: another writer
                committed this step first; ValueError for a state the format cannot hold.
        """
        from ftrain.ckpt.objio import upload_tree

        moved = self.clear_way(step)
        key = self / protocol.step_dirname(step)
        try:
            manifest = upload_tree(key, state, attributes, chunk_bytes, compression, reuse=reuse)
            return key, self.commit_step(key, step, manifest, marker_extra)
        except protocol.StepTakenError:
            # lost to another writer: the objects under the prefix are the winner's now
            # (its marker may still be on its way): deleting them would unmake its commit
            raise
        except BaseException:
            self.abort_step(key)
            if moved is not None:
                self.put_back(moved, step)
            raise

    def begin_step(self, step: int) -> ObjectKey:
        """Step 1 of the protocol: clear the way; returns the step's prefix to upload to."""
        self.clear_way(step)
        return self / protocol.step_dirname(step)

    def commit_step(
        self, key: ObjectKey, step: int, manifest: dict, marker_extra: Callable[[dict], dict]
    ) -> dict:
        """Steps 3-4, once every part under ``key`` is confirmed: put the manifest, then the
        marker (``If-None-Match: *``). Returns the manifest as committed.

        Raises:
            CheckpointStoreError; FileExistsError: another writer committed ``step`` first.
        """
        protocol._phase("data_written")
        manifest = dict(manifest, step=step)
        raw = json_bytes(manifest)
        # create-only, like the marker: the way was cleared, so a manifest already there is
        # a second writer's, which a plain put would unseal (its marker then no longer
        # matches: a committed step lost, and retention may have deleted the older ones)
        self.put_new(f"{key.key}/{protocol.MANIFEST}", raw)
        protocol._phase("manifest_written")
        marker = protocol.marker_document(step, raw, marker_extra(manifest))
        self.put_new(f"{key.key}/{protocol.MARKER}", json_bytes(marker))
        protocol._phase("marker_written")
        return manifest

    def abort_step(self, key: ObjectKey) -> None:
        """Best effort: delete what a failed save uploaded (never a marker in place). With
        the quick retries of :meth:`probe`: after an upload that failed in an outage, the
        cleanup's own 3 minutes of retries held back the save to the fallback location
        (280 s in all in a hunt); a leftover is swept at a later start."""
        quick = self if self.probe_store is None else replace(self, store=self.probe_store)
        try:
            objects = [m["path"] for m in quick.list(key.key + "/")]
            if f"{key.key}/{protocol.MARKER}" not in objects:
                quick.delete(objects)
        except Exception as e:  # noqa: BLE001 - the original error matters more
            log.warning("could not remove the partial upload %s: %s", key, e)


async def _put_create(store, key: str, data: bytes) -> None:
    try:
        await obstore.put_async(store, key, data, mode="create")
    except obstore.exceptions.AlreadyExistsError as e:
        # the client retries a put whose reply was lost: if the first attempt landed, the
        # object holds these very bytes (a marker's times make another writer's differ)
        if await _bytes_of(store, key) == data:
            return
        raise protocol.StepTakenError(
            f"{key} already exists: another writer of this step was first"
        ) from e
    except obstore.exceptions.NotSupportedError:
        log.warning("the store has no conditional put; writing %s unconditionally", key)
        await obstore.put_async(store, key, data)


async def _bytes_of(store, key: str) -> bytes | None:
    try:
        return bytes(await (await obstore.get_async(store, key)).bytes_async())
    except FileNotFoundError:
        return None


async def _list(store, prefix: str) -> list[dict]:
    return await obstore.list(store, prefix).collect_async()


async def _head(store, key: str) -> dict | None:
    try:
        return await obstore.head_async(store, key)
    except FileNotFoundError:
        return None


async def _each(func, items: list, limit: int) -> list:
    """``func(*item)`` for every item (a tuple or one argument), ``limit`` at a time."""
    return await gather_bounded(
        [func(*i) if isinstance(i, tuple) else func(i) for i in items], limit
    )


def _raise_if_nothing_answered(root: ObjectRoot, names: list[str], sealed: list) -> None:
    """When no step could be read at all, the store is failing (endpoint down, credentials
    revoked), not some steps: raise, rather than list nothing and start a run afresh."""
    errors = [r for r in sealed if isinstance(r, Exception)]
    if errors and len(errors) == len(names):
        raise CheckpointStoreError(f"{root.url}: {describe_error(errors[0])}") from errors[0]


async def gather_bounded(coros: list, limit: int) -> list:
    """Await ``coros`` with at most ``limit`` running; the first error cancels the rest
    (so a failed save does not keep uploading) and is raised as itself."""
    sem = asyncio.Semaphore(limit)

    async def bounded(coro):
        async with sem:
            return await coro

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(bounded(c)) for c in coros]
    except BaseExceptionGroup as group:
        first = group.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    finally:
        for c in coros:  # the ones a failure cancelled before they started
            c.close()
    return [t.result() for t in tasks]
