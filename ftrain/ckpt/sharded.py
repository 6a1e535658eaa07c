"""One Zarr store, many writers: every rank writes its own rows of a sharded state.

A state whose leaves are ``DTensor``s placed ``Shard(0)`` (``ftrain.sharding``) is saved
without gathering: each array keeps its **global** shape in the store (a plain
``zarr.open_group`` reader sees whole tensors), its chunk rows divide the shard rows, so a
chunk lies inside one rank's rows, and each rank writes only the chunk files of its own
rows — in parallel, no read-modify-write, no file touched by two ranks. Replicated
parameters and optimizer leaves (whole and identical on every rank) are split chunk by
chunk over the ranks (chunk ``i`` by rank ``i % world``); other replicated leaves (buffers,
which may differ per rank) are rank 0's, whole; rank 0 writes the ``zarr.json`` documents.

Two-phase commit: the coordinator creates the staging directory (and holds its lock) and
broadcasts its path; every rank writes and makes its part durable (``syncfs``) and reports
its chunk checksums, or its error, to the coordinator (JSON over the process group); only
when every rank succeeded does the coordinator merge the parts into one manifest and
write it and the marker (the ordinary commit protocol); otherwise it aborts. A rank that
dies before that leaves no committed step: the survivors' collective fails and the next
start sweeps the staging directory. The outcome is broadcast, so every rank agrees.

Restore on any world size: :func:`read_owned` reads, on each rank, only the chunks that
overlap the rows it now owns of every sharded array (:func:`read_rows`, each chunk checked
against its crc32c) and the replicated arrays whole, and builds the DTensor leaves from
the rows. Which step every rank restores is agreed by the caller (``ftrain.cli.resume``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch.distributed.tensor import DTensor, Shard

from ftrain.ckpt import commit as protocol
from ftrain.ckpt._threads import run_parallel, run_pools
from ftrain.ckpt.chunkio import read_chunk, read_chunks_into, tensor_bytes
from ftrain.ckpt.codecs import parse_compression
from ftrain.ckpt.documents import step_documents
from ftrain.ckpt.format import DIRECT_MIN_BYTES, ArraySpec, dtype_name, parse_dtype, plan_array
from ftrain.ckpt.incremental import FallbackBytes
from ftrain.ckpt.reader import (
    allocate_tree,
    byte_view,
    check_no_links,
    check_sizes,
    chunk_files,
    prefetching,
    read_jobs,
    selected_specs,
)
from ftrain.ckpt.store import (
    _HAVE_SYNCFS,
    FsSync,
    _Writer,
    build_manifest,
    fsync_dirs,
    groups_and_arrays,
    merge_manifests,
)
from ftrain.dist import broadcast_int, broadcast_json, gather_json

log = logging.getLogger(__name__)

__all__ = [
    "plan_sharded",
    "read_owned",
    "read_rows",
    "rows_read_bytes",
    "save_all_ranks",
    "upload_part",
    "write_part",
]


def _is_row_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and t.ndim > 0 and tuple(t.placements) == (Shard(0),)


def _shard_rows(n: int, world: int) -> int:
    """Rows of every rank's shard but the last (``torch.chunk``'s rule)."""
    return math.ceil(n / world) if n else 0


def plan_sharded(key: str, t: torch.Tensor, world: int, chunk_bytes: int, compression) -> ArraySpec:
    """The spec of one leaf: global shape; for a row-sharded DTensor chunk rows that divide
    the shard rows (so no chunk spans two ranks), as close to ``chunk_bytes`` as that allows."""
    if t.numel() == 0:  # the global shape: a sharded (4, 0) leaf is (2, 0) on each rank
        return plan_array(key, torch.empty(t.shape, dtype=t.dtype, device="meta"), 1, compression)
    if not _is_row_sharded(t):
        local = t.to_local() if isinstance(t, DTensor) else t
        return plan_array(key, local, chunk_bytes, compression)
    c = _shard_rows(t.shape[0], world)
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    # chunks per shard; one row per chunk where a row is wider than chunk_bytes
    wanted = min(c, max(1, math.ceil(c * row_bytes / chunk_bytes)))
    fewest = math.ceil(c * row_bytes / min(4 * chunk_bytes, MAX_SHARD_CHUNK_BYTES))
    per_shard = _chunks_per_shard(c, wanted, min(wanted, fewest))
    return ArraySpec(
        key,
        dtype_name(t.dtype),
        tuple(t.shape),
        (c // per_shard, *t.shape[1:]),
        compression=compression,
        separator=".",
    )


# a sharded chunk larger than chunk_bytes (see _chunks_per_shard) stays under this: Blosc
# refuses buffers over 2 GiB, and a restore holds a whole chunk at once
MAX_SHARD_CHUNK_BYTES = 1 << 30


def _chunks_per_shard(rows: int, wanted: int, fewest: int) -> int:
    """Chunks per shard: the first divisor of ``rows`` at or above ``wanted`` (chunks at
    most ``chunk_bytes``), unless that makes chunks under 1/16 of the size asked for;
    then the divisor nearest ``wanted`` by ratio among those of at least ``fewest``
    chunks (chunks at most 4 x ``chunk_bytes`` and :data:`MAX_SHARD_CHUNK_BYTES`).

    Chunk rows must divide a shard's rows so no chunk spans two ranks. With the first
    rule alone a prime row count (a 50,254-row, 768-wide embedding on 2 ranks: 25,127
    rows each) gave one-row chunks: 25,127 files of 3 KiB per rank for one moment. One
    chunk per shard, above ``chunk_bytes``, costs far less.

    Example:
        >>> _chunks_per_shard(25127, 3, 1), _chunks_per_shard(25129, 3, 1)
        (1, 13)
        >>> _chunks_per_shard(64007, 71, 18)  # a prime 2.2 GiB shard: never one chunk
        64007
    """
    small = [d for d in range(1, math.isqrt(rows) + 1) if rows % d == 0]
    divisors = sorted({*small, *(rows // d for d in small)})
    above = next(d for d in divisors if d >= wanted)
    if above <= 16 * wanted:
        return above
    fits = [d for d in divisors if d >= fewest]
    return min(fits, key=lambda d: (abs(math.log(d / wanted)), d))


def own_slices(spec: ArraySpec, t: torch.Tensor, rank: int, world: int) -> list[tuple]:
    """``(i, payload, pad)`` of the chunks this rank writes: those inside its own rows of a
    row-sharded leaf; of a leaf every rank holds whole, see :func:`_replicated_chunks`."""
    out = []
    if _is_row_sharded(t) and spec.shape[0]:
        c = _shard_rows(spec.shape[0], world)
        local = tensor_bytes(t.to_local())
        row_bytes = spec.chunk_nbytes // spec.chunk_shape[0]
        for i in range(spec.n_chunks):
            first = i * spec.chunk_shape[0]
            if first // c != rank:
                continue
            start, stop = spec.chunk_span(i)
            offset = (first - rank * c) * row_bytes
            out.append(
                (i, local[offset : offset + (stop - start)], spec.chunk_nbytes - (stop - start))
            )
        return out
    data = tensor_bytes(t.to_local() if isinstance(t, DTensor) else t)
    for i in _replicated_chunks(spec, rank, world):
        start, stop = spec.chunk_span(i)
        out.append((i, data[start:stop], spec.chunk_nbytes - (stop - start)))
    return out


# Replicated leaves the step keeps identical on every rank: the parameters and the
# optimizer state, made from the same all-reduced gradients. Their chunks are spread over
# the ranks to balance the write. Any other replicated leaf (a BatchNorm's running stats,
# which each rank updates from its own batches) is rank 0's whole, as in a one-writer save:
# spread chunk by chunk, a leaf that differs per rank would be stored as a mix of ranks.
_SPREAD_GROUPS = ("params", "opt")


def splits_replicated(key: str) -> bool:
    """Whether the chunks of replicated leaf ``key`` are spread over the ranks (see above)."""
    return key.split("/", 1)[0] in _SPREAD_GROUPS


def _replicated_chunks(spec: ArraySpec, rank: int, world: int) -> range:
    """The chunks of a replicated leaf this rank writes: every ``world``-th from ``rank``
    (parameters, optimizer state), or all of them on rank 0 (anything else)."""
    if splits_replicated(spec.key):
        return range(rank, spec.n_chunks, world)
    return range(0 if rank else spec.n_chunks)


def _own_chunks(spec: ArraySpec, t: torch.Tensor, rank: int, world: int, tmp: Path) -> list:
    """``("chunk", path, key, i, payload, pad)`` jobs of the chunks this rank writes."""
    return [_job(tmp, spec, *c) for c in own_slices(spec, t, rank, world)]


def _job(tmp: Path, spec: ArraySpec, i: int, payload, pad: int) -> tuple:
    path = tmp.joinpath(*spec.key.split("/"), *spec.chunk_key(i).split("/"))
    return ("chunk", path, spec.key, i, payload, pad)


def write_part(
    tmp: Path,
    state: TensorDictBase,
    attributes: dict,
    *,
    rank: int,
    world: int,
    chunk_bytes: int,
    workers: int,
    compression: str | None = None,
) -> dict:
    """Write this rank's part of ``state`` (CPU tensors and CPU DTensors) into ``tmp``.

    Returns:
        This rank's manifest (checksums of its own chunks; ``None`` for the others'), for
        :func:`ftrain.ckpt.store.merge_manifests`.
    """
    codec, groups, leaves, specs = _plan(state, world, chunk_bytes, compression)
    spec_str = codec.spec if codec else None
    docs = step_documents(groups, specs, attributes) if rank == 0 else {}
    meta = [("json", tmp.joinpath(*rel.split("/")), doc, None) for rel, doc in docs.items()]
    chunks = [j for k, t in leaves.items() for j in _own_chunks(specs[k], t, rank, world, tmp)]
    big = sorted(
        (j for j in chunks if len(j[4]) + j[5] >= DIRECT_MIN_BYTES), key=lambda j: -len(j[4])
    )
    meta += [j for j in chunks if len(j[4]) + j[5] < DIRECT_MIN_BYTES]
    writer = _Writer(tmp, specs, FallbackBytes({}), codec, durable=not _HAVE_SYNCFS, direct=True)
    with FsSync.opened(tmp, _HAVE_SYNCFS) as watch:  # before anything is written
        results = run_pools([(writer.do, big, workers), (writer.do, meta, max(1, workers // 2))])
        protocol._phase("part_written")  # fault-injection seam: this rank's chunks, not yet durable
        if watch is not None:
            watch.sync()  # this rank's files are durable before it reports success
        else:
            fsync_dirs(tmp, groups, list(specs.values()), workers)  # the names, too
    crcs: dict[str, dict[int, int]] = {k: {} for k in specs}
    stored: dict[str, dict[int, int]] = {k: {} for k in specs}
    documents: dict[str, list[int]] = {}
    for r in results[0] + results[1]:
        if r[0] == "doc":
            documents[r[1]] = [r[2], r[3]]
        else:
            crcs[r[1]][r[2]], stored[r[1]][r[2]] = r[3], r[4]
    return build_manifest(groups, specs, crcs, stored, documents, spec_str)


def _plan(state: TensorDictBase, world: int, chunk_bytes: int, compression: str | None):
    """``(codec, groups, leaves, specs)`` of a sharded save of ``state`` over ``world`` ranks."""
    codec = parse_compression(compression)
    groups, leaves = groups_and_arrays(state)
    spec_str = codec.spec if codec else None
    specs = {k: plan_sharded(k, t, world, chunk_bytes, spec_str) for k, t in leaves.items()}
    return codec, groups, leaves, specs


def upload_part(
    step,
    state: TensorDictBase,
    attributes: dict,
    *,
    rank: int,
    world: int,
    chunk_bytes: int,
    compression: str | None = None,
) -> dict:
    """:func:`write_part` for an object store: upload this rank's chunks (and, on rank 0,
    the documents) under the step prefix ``step`` (an ``ObjectKey``), each request
    confirmed; returns this rank's manifest."""
    from ftrain.ckpt.objio import Part, upload_objects

    codec, groups, leaves, specs = _plan(state, world, chunk_bytes, compression)
    jobs = [(specs[k], *c) for k, t in leaves.items() for c in own_slices(specs[k], t, rank, world)]
    part = Part(groups, specs, attributes, rank, codec.spec if codec else None)
    manifest = upload_objects(step, part, jobs)
    protocol._phase("part_written")  # fault-injection seam, as on a local directory
    return manifest


class _LocalTarget:
    """The two-phase commit's steps on a local directory: a staging dir, renamed."""

    def __init__(self, manager, root) -> None:
        self.manager, self.root = manager, root  # root: the location being written

    def begin(self, step: int):
        return protocol.begin(self.root, step)

    def name(self, staging) -> str:
        return str(staging.path)

    def write(self, where: str, state, attrs: dict, rank: int, world: int) -> dict:
        m = self.manager
        return write_part(
            Path(where),
            state,
            attrs,
            rank=rank,
            world=world,
            chunk_bytes=m.chunk_bytes,
            workers=m.io_workers,
            compression=m.compression,
        )

    def commit(self, staging, step: int, manifest: dict, marker_extra) -> tuple:
        return protocol.commit(staging, manifest, marker_extra(manifest)), manifest

    def abort(self, staging) -> None:
        protocol.abort(staging)

    def abandon(self, staging) -> None:
        """After losing the commit to another writer: the staging directory is ours alone."""
        protocol.abort(staging)


class _ObjectTarget(_LocalTarget):
    """The same steps on an object store: the step's final prefix, the marker put last."""

    def begin(self, step: int):
        return self.root.begin_step(step)

    def name(self, key) -> str:
        return key.key

    def write(self, where: str, state, attrs: dict, rank: int, world: int) -> dict:
        m = self.manager
        return upload_part(
            self.root / where,
            state,
            attrs,
            rank=rank,
            world=world,
            chunk_bytes=m.chunk_bytes,
            compression=m.compression,
        )

    def commit(self, key, step: int, manifest: dict, marker_extra) -> tuple:
        return key, self.root.commit_step(key, step, manifest, marker_extra)

    def abort(self, key) -> None:
        self.root.abort_step(key)

    def abandon(self, key) -> None:
        """After losing the commit to another writer: the objects under the step's prefix
        are the winner's (its marker may still be on its way), so nothing is deleted."""


def save_all_ranks(
    manager, state: TensorDictBase, step: int, attrs: dict, marker_extra, group=None, root=None
):
    """The two-phase commit (see the module doc). Every rank calls it. Returns
    ``(committed path, manifest)`` on rank 0 and ``None`` on the others once the step is
    committed; raises ``OSError`` on every rank otherwise (the same message: every rank
    then tries the same next location). ``group``: the process group of its collectives
    (one of its own when it runs in a background thread); ``root``: the location to write
    (default: the manager's primary)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = manager.directory if root is None else root
    target = (_LocalTarget if isinstance(root, Path) else _ObjectTarget)(manager, root)
    handle, error = None, None
    if rank == 0:
        try:
            manager._set_aside_old_history(step)  # before the commit: see the manager
            handle = target.begin(step)
        except Exception as e:  # noqa: BLE001 - any failure must reach the broadcast
            error = f"rank 0 cannot stage step {step} in {root}: {e}"
    where = broadcast_json(None if handle is None else target.name(handle), group=group)
    if where is None:
        raise OSError(broadcast_json(error, group=group))
    try:
        report = {"ok": True, "manifest": target.write(where, state, attrs, rank, world)}
    except Exception as e:  # noqa: BLE001 - any failure must reach the gather, or the others hang
        why = str(e)
        if not isinstance(e, (OSError, ValueError)):  # unexpected: keep its traceback
            log.exception("rank %d: writing its part of step %d failed", rank, step)
            why = f"{type(e).__name__}: {e}" if str(e) else repr(e)
        report = {"ok": False, "error": f"rank {rank}: {why}"}
    parts = gather_json(report, group)
    final = _commit(target, handle, step, parts, marker_extra) if rank == 0 else None
    lost = bool(parts) and any(p.get("lost") for p in parts)
    ok = broadcast_int(1 if final is not None else 2 if lost else 0, group=group)
    if ok != 1:
        errors = [p["error"] for p in parts if not p["ok"]] if parts else []
        why = broadcast_json("; ".join(errors) or "the commit failed on rank 0", group=group)
        # every rank raises the same: a lost commit is no reason to try the fallback
        raise protocol.StepTakenError(why) if ok == 2 else OSError(why)
    broadcast_json(None, group=group)  # keeps every rank's collective sequence the same on success
    return final


def _commit(target, handle, step: int, parts: list[dict], marker_extra) -> tuple | None:
    """Rank 0: merge and commit when every rank succeeded, else abort. ``(path, manifest)``."""
    if not all(p["ok"] for p in parts):
        target.abort(handle)
        return None
    try:
        manifest = merge_manifests([p["manifest"] for p in parts])
    except ValueError as e:  # a chunk no rank wrote: never seal it
        parts.append({"ok": False, "error": f"rank 0: {e}"})
        target.abort(handle)
        return None
    try:
        return target.commit(handle, step, manifest, marker_extra)
    except protocol.StepTakenError as e:  # another writer committed the step first
        parts.append({"ok": False, "error": f"rank 0: {e}", "lost": True})
        target.abandon(handle)
        return None
    except OSError:
        target.abort(handle)
        return None


def overlapping(spec: ArraySpec, start: int, length: int) -> range:
    """The chunks of ``spec`` that hold any of rows ``[start, start + length)``."""
    if not length or not spec.nbytes:
        return range(0)
    rows = spec.chunk_shape[0]
    return range(start // rows, (start + length - 1) // rows + 1)


def rows_read_bytes(spec: ArraySpec, start: int, length: int) -> int:
    """The chunk payload bytes :func:`read_rows` reads for those rows (whole chunks)."""
    return sum(c1 - c0 for c0, c1 in map(spec.chunk_span, overlapping(spec, start, length)))


def empty_rows(spec: ArraySpec, length: int) -> torch.Tensor:
    """The destination of ``length`` rows of the array ``spec``."""
    return torch.empty((length, *spec.shape[1:]), dtype=parse_dtype(spec.dtype))


def copy_rows(spec: ArraySpec, i: int, chunk, dest: memoryview, start: int, length: int) -> None:
    """Copy the rows of ``[start, start + length)`` that the verified payload ``chunk`` of
    chunk ``i`` holds into ``dest`` (the bytes of those rows)."""
    rows = spec.chunk_shape[0]
    row_bytes = spec.chunk_nbytes // rows
    c0, c1 = spec.chunk_span(i)
    first, last = max(start, i * rows), min(start + length, i * rows + (c1 - c0) // row_bytes)
    src = (first - i * rows) * row_bytes
    dest[(first - start) * row_bytes : (last - start) * row_bytes] = chunk[
        src : src + (last - first) * row_bytes
    ]


def read_rows(root: Path, spec: ArraySpec, start: int, length: int) -> torch.Tensor:
    """Rows ``[start, start + length)`` of a committed array (``spec`` from its verified
    manifest), read from the chunks that overlap them only, each checked (size, crc32c).

    Raises:
        CorruptCheckpointError: a chunk is missing, the wrong size, or fails its crc32c.
    """
    out = empty_rows(spec, length)
    if not out.numel():
        return out
    dest = byte_view(out)
    for i in overlapping(spec, start, length):
        c0, c1 = spec.chunk_span(i)
        chunk = bytearray(c1 - c0)
        path = root.joinpath(*spec.key.split("/"), *spec.chunk_key(i).split("/"))
        stored = spec.stored[i] if spec.compression else None
        read_chunk(
            (path, memoryview(chunk), spec.chunk_nbytes - (c1 - c0), spec.crc32c[i], stored, spec)
        )
        copy_rows(spec, i, chunk, dest, start, length)
    return out


def read_owned(
    root: Path, manifest: dict, owner, *, only: tuple[str, ...] | None = None, workers: int
) -> tuple[TensorDict, int]:
    """One rank's restore of a sharded state: of every array that
    ``owner.owned_rows(key, shape)`` gives a row range for, only the chunks that overlap
    those rows, made into a leaf by ``owner.from_rows(local, shape)``; every other array
    whole. Every chunk read is checked (size, crc32c), as by :func:`~ftrain.ckpt.reader.read_tree`.

    Args:
        root: the committed step directory; ``manifest`` its verified manifest.
        owner: a :class:`ftrain.sharding.Sharder` (or anything with those two methods).
        only: key paths to read (``None``: all).

    Returns:
        The tree and the chunk payload bytes this rank read (its share of the sharded
        arrays, whole chunks, plus the whole arrays).

    Raises:
        CorruptCheckpointError: a chunk this rank reads is missing, the wrong size, or fails
            its crc32c; the step does not fit in memory.
    """
    specs = selected_specs(manifest, only)
    owned = {k: owner.owned_rows(k, s.shape) for k, s in specs.items()}
    whole = {k: s for k, s in specs.items() if owned[k] is None}
    sharded = [k for k in specs if owned[k] is not None]
    mine = chunk_files(
        root, {k: specs[k] for k in sharded}, lambda s: overlapping(s, *owned[s.key])
    )
    check_no_links(root)  # first: nothing is opened, not even for a hint, through a link
    with prefetching(chunk_files(root, whole) + mine):
        local_bytes = sum(r[1] * specs[k].row_nbytes for k in sharded if (r := owned[k]))
        check_sizes(root, whole, extra_bytes=local_bytes)  # before anything is allocated
        out, tensors = allocate_tree(manifest, whole, only)
        read_jobs(
            root,
            [j for k, s in whole.items() for j in read_chunks_into(root, s, byte_view(tensors[k]))],
            workers,
        )
        rows = run_parallel(lambda k: read_rows(root, specs[k], *owned[k]), sharded, workers)
    for k, local in zip(sharded, rows, strict=True):
        out[tuple(k.split("/"))] = owner.from_rows(local, specs[k].shape)
    read = sum(s.nbytes for s in whole.values())
    return out, read + sum(rows_read_bytes(specs[k], *owned[k]) for k in sharded)
