"""One Zarr store, many writers: every rank writes its own rows of a sharded state.

A state whose leaves are ``DTensor``s placed ``Shard(0)`` (``ftrain.sharding``) is saved
without gathering: each array keeps its **global** shape in the store (a plain
``zarr.open_group`` reader sees whole tensors), its chunk rows divide the shard rows, so a
chunk lies inside one rank's rows, and each rank writes only the chunk files of its own
rows — in parallel, no read-modify-write, no file touched by two ranks. Replicated leaves
(whole on every rank) are split chunk by chunk over the ranks (chunk ``i`` by rank
``i % world``); rank 0 writes the ``zarr.json`` documents.

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

import math
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch.distributed.tensor import DTensor, Shard

from ftrain.ckpt import commit as protocol
from ftrain.ckpt._threads import run_parallel, run_pools
from ftrain.ckpt.codecs import parse_compression
from ftrain.ckpt.documents import step_documents
from ftrain.ckpt.format import (
    DIRECT_MIN_BYTES,
    ArraySpec,
    dtype_name,
    parse_dtype,
    plan_array,
    read_chunk,
    read_chunks_into,
    tensor_bytes,
)
from ftrain.ckpt.incremental import FallbackBytes
from ftrain.ckpt.store import (
    _HAVE_SYNCFS,
    _Writer,
    allocate_tree,
    build_manifest,
    byte_view,
    check_no_links,
    check_sizes,
    flatten,
    merge_manifests,
    read_jobs,
    selected_specs,
    syncfs,
)
from ftrain.dist import broadcast_int, broadcast_json, gather_json

__all__ = [
    "plan_sharded",
    "read_owned",
    "read_rows",
    "rows_read_bytes",
    "save_all_ranks",
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
    if not _is_row_sharded(t) or t.shape[0] == 0:
        local = t.to_local() if isinstance(t, DTensor) else t
        return plan_array(key, local, chunk_bytes, compression)
    c = _shard_rows(t.shape[0], world)
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    wanted = max(1, math.ceil(c * row_bytes / chunk_bytes))  # chunks per shard, at least
    per_shard = next(d for d in range(wanted, c + 1) if c % d == 0)
    return ArraySpec(
        key,
        dtype_name(t.dtype),
        tuple(t.shape),
        (c // per_shard, *t.shape[1:]),
        compression=compression,
        separator=".",
    )


def _own_chunks(spec: ArraySpec, t: torch.Tensor, rank: int, world: int, tmp: Path) -> list:
    """``("chunk", path, key, i, payload, pad)`` jobs of the chunks this rank writes."""
    jobs = []
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
            payload = local[offset : offset + (stop - start)]
            jobs.append(_job(tmp, spec, i, payload, spec.chunk_nbytes - (stop - start)))
        return jobs
    data = tensor_bytes(t.to_local() if isinstance(t, DTensor) else t)
    for i in range(spec.n_chunks):
        if i % world == rank:
            start, stop = spec.chunk_span(i)
            jobs.append(_job(tmp, spec, i, data[start:stop], spec.chunk_nbytes - (stop - start)))
    return jobs


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
    codec = parse_compression(compression)
    spec_str = codec.spec if codec else None
    groups, leaves = flatten(state)
    specs = {k: plan_sharded(k, t, world, chunk_bytes, spec_str) for k, t in leaves.items()}
    docs = step_documents(groups, specs, attributes) if rank == 0 else {}
    meta = [("json", tmp.joinpath(*rel.split("/")), doc, None) for rel, doc in docs.items()]
    chunks = [j for k, t in leaves.items() for j in _own_chunks(specs[k], t, rank, world, tmp)]
    big = sorted(
        (j for j in chunks if len(j[4]) + j[5] >= DIRECT_MIN_BYTES), key=lambda j: -len(j[4])
    )
    meta += [j for j in chunks if len(j[4]) + j[5] < DIRECT_MIN_BYTES]
    writer = _Writer(tmp, specs, FallbackBytes({}), codec, durable=not _HAVE_SYNCFS, direct=True)
    results = run_pools([(writer.do, big, workers), (writer.do, meta, max(1, workers // 2))])
    crcs: dict[str, dict[int, int]] = {k: {} for k in specs}
    stored: dict[str, dict[int, int]] = {k: {} for k in specs}
    documents: dict[str, list[int]] = {}
    for r in results[0] + results[1]:
        if r[0] == "doc":
            documents[r[1]] = [r[2], r[3]]
        else:
            crcs[r[1]][r[2]], stored[r[1]][r[2]] = r[3], r[4]
    protocol._phase("part_written")  # fault-injection seam: this rank's chunks, not yet durable
    if _HAVE_SYNCFS:
        syncfs(tmp)  # this rank's files are durable before it reports success
    return build_manifest(groups, specs, crcs, stored, documents, spec_str)


def save_all_ranks(manager, state: TensorDictBase, step: int, attrs: dict, marker_extra):
    """The two-phase commit (see the module doc). Every rank calls it. Returns
    ``(committed path, manifest)`` on rank 0 and ``None`` on the others once the step is
    committed; raises ``OSError`` on every rank otherwise."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = manager.directory
    staging, error = None, None
    if rank == 0:
        try:
            staging = protocol.begin(root, step)
        except OSError as e:
            error = f"rank 0 cannot stage step {step} in {root}: {e}"
    path = broadcast_json(None if staging is None else str(staging.path))
    if path is None:
        raise OSError(broadcast_json(error))
    try:
        part = write_part(
            Path(path),
            state,
            attrs,
            rank=rank,
            world=world,
            chunk_bytes=manager.chunk_bytes,
            workers=manager.io_workers,
            compression=manager.compression,
        )
        report = {"ok": True, "manifest": part}
    except (OSError, ValueError) as e:
        report = {"ok": False, "error": f"rank {rank}: {e}"}
    parts = gather_json(report)
    final = _commit(staging, parts, marker_extra) if rank == 0 else None
    ok = broadcast_int(1 if final is not None else 0)
    if not ok:
        errors = [p["error"] for p in parts if not p["ok"]] if parts else []
        raise OSError(broadcast_json("; ".join(errors) or "the commit failed on rank 0"))
    broadcast_json(None)  # keeps every rank's collective sequence the same on success
    return final


def _commit(staging, parts: list[dict], marker_extra) -> tuple | None:
    """Rank 0: merge and commit when every rank succeeded, else abort. ``(path, manifest)``."""
    if not all(p["ok"] for p in parts):
        protocol.abort(staging)
        return None
    manifest = merge_manifests([p["manifest"] for p in parts])
    try:
        return protocol.commit(staging, manifest, marker_extra(manifest)), manifest
    except OSError:
        protocol.abort(staging)
        return None


def _overlapping(spec: ArraySpec, start: int, length: int) -> range:
    """The chunks of ``spec`` that hold any of rows ``[start, start + length)``."""
    if not length or not spec.nbytes:
        return range(0)
    rows = spec.chunk_shape[0]
    return range(start // rows, (start + length - 1) // rows + 1)


def rows_read_bytes(spec: ArraySpec, start: int, length: int) -> int:
    """The chunk payload bytes :func:`read_rows` reads for those rows (whole chunks)."""
    return sum(c1 - c0 for c0, c1 in map(spec.chunk_span, _overlapping(spec, start, length)))


def read_rows(root: Path, spec: ArraySpec, start: int, length: int) -> torch.Tensor:
    """Rows ``[start, start + length)`` of a committed array (``spec`` from its verified
    manifest), read from the chunks that overlap them only, each checked (size, crc32c).

    Raises:
        CorruptCheckpointError: a chunk is missing, the wrong size, or fails its crc32c.
    """
    out = torch.empty((length, *spec.shape[1:]), dtype=parse_dtype(spec.dtype))
    if not length or not out.numel():
        return out
    dest = byte_view(out)
    row_bytes = len(dest) // length
    rows = spec.chunk_shape[0]
    for i in _overlapping(spec, start, length):
        c0, c1 = spec.chunk_span(i)
        chunk = bytearray(c1 - c0)
        path = root.joinpath(*spec.key.split("/"), *spec.chunk_key(i).split("/"))
        stored = spec.stored[i] if spec.compression else None
        read_chunk(
            (path, memoryview(chunk), spec.chunk_nbytes - (c1 - c0), spec.crc32c[i], stored, spec)
        )
        first, last = max(start, i * rows), min(start + length, i * rows + (c1 - c0) // row_bytes)
        src = (first - i * rows) * row_bytes
        dest[(first - start) * row_bytes : (last - start) * row_bytes] = chunk[
            src : src + (last - first) * row_bytes
        ]
    return out


def read_owned(
    root: Path, manifest: dict, owner, *, only: tuple[str, ...] | None = None, workers: int
) -> tuple[TensorDict, int]:
    """One rank's restore of a sharded state: of every array that
    ``owner.owned_rows(key, shape)`` gives a row range for, only the chunks that overlap
    those rows, made into a leaf by ``owner.from_rows(local, shape)``; every other array
    whole. Every chunk read is checked (size, crc32c), as by :func:`~ftrain.ckpt.store.read_tree`.

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
    check_no_links(root)
    owned = {k: owner.owned_rows(k, s.shape) for k, s in specs.items()}
    whole = {k: s for k, s in specs.items() if owned[k] is None}
    local_bytes = sum(r[1] * (s.nbytes // s.shape[0]) for k, s in specs.items() if (r := owned[k]))
    check_sizes(root, whole, extra_bytes=local_bytes)  # before anything is allocated
    out, tensors = allocate_tree(manifest, whole, only)
    read_jobs(
        root,
        [j for k, s in whole.items() for j in read_chunks_into(root, s, byte_view(tensors[k]))],
        workers,
    )
    sharded = [k for k in specs if owned[k] is not None]
    rows = run_parallel(lambda k: read_rows(root, specs[k], *owned[k]), sharded, workers)
    for k, local in zip(sharded, rows, strict=True):
        out[tuple(k.split("/"))] = owner.from_rows(local, specs[k].shape)
    read = sum(s.nbytes for s in whole.values())
    return out, read + sum(rows_read_bytes(specs[k], *owned[k]) for k in sharded)
