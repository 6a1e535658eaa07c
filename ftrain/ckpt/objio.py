"""Upload a TensorDict to a step prefix of an object store, and download (part of) it.

The objects are the local format's files, byte for byte (same planner, same documents,
same chunk encoding: payload + zero padding or compressed frame, then the crc32c), so a
step has one format whatever it is stored on. Encoding and verifying a chunk (crc32c,
compression) runs in worker threads; the requests run on zarr-python's I/O event loop,
``concurrency`` in flight, each awaited (confirmed) before the save moves on.

Reused leaves (:mod:`ftrain.ckpt.incremental`: the same, unchanged tensor as in the
step last committed to this location) are not uploaded: each of their chunk objects is a
server-side copy (``CopyObject``) of the previous step's, so no data leaves this process
and every step still owns all its objects: deleting an older step never touches a newer
one. The store keeps both copies (object stores have no hard links; a manifest that
referred to another step's objects would make deleting that step break this one). A copy
that fails (the source was deleted, the store refuses copies, an object over the store's
copy limit) is replaced by a normal upload of the chunk.

Restore lists the step's objects once and checks every chunk's size against the manifest
before allocating anything, then downloads chunks concurrently and verifies each crc32c
(trailer and manifest) before copying it into the result tensor.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from functools import partial

import crc32c
import obstore
from tensordict import TensorDict, TensorDictBase

from ftrain.ckpt import commit as protocol
from ftrain.ckpt.chunkio import decode_verified, encode_chunk, tensor_bytes
from ftrain.ckpt.codecs import parse_compression
from ftrain.ckpt.documents import step_documents
from ftrain.ckpt.format import ArraySpec, CorruptCheckpointError, json_bytes, plan_array
from ftrain.ckpt.incremental import FallbackBytes, Reuse
from ftrain.ckpt.location import CheckpointStoreError
from ftrain.ckpt.objstore import ObjectKey, gather_bounded
from ftrain.ckpt.reader import (
    allocate_tree,
    byte_view,
    check_array_doc,
    check_consolidated,
    check_memory,
    doc_checksum,
    selected_specs,
    specs_of,
)
from ftrain.ckpt.store import build_manifest, groups_and_arrays

__all__ = [
    "Part",
    "download_owned",
    "download_tree",
    "upload_objects",
    "upload_tree",
    "verify_objects",
]

log = logging.getLogger("ftrain.ckpt")


def _chunk_object(spec: ArraySpec, payload: memoryview, pad: int) -> tuple[bytes, int, int]:
    """``(object bytes, crc32c, bytes before the crc)`` of one chunk (in a worker thread)."""
    parts = encode_chunk(payload, pad, spec.codec, spec.itemsize)
    crc = 0
    for part in parts:
        crc = crc32c.crc32c(part, value=crc)
    body = b"".join(parts)
    return body + crc.to_bytes(4, "little"), crc, len(body)


def upload_tree(
    step,
    state: TensorDictBase,
    attributes: dict,
    chunk_bytes: int,
    compression: str | None,
    *,
    rank: int = 0,
    world: int = 1,
    reuse: dict[str, Reuse] | None = None,
) -> dict:
    """Upload ``state`` (CPU tensors) under the step prefix ``step`` (an ``ObjectKey``).

    Args:
        step: the step's :class:`~ftrain.ckpt.objstore.ObjectKey` (its prefix is empty).
        state: a nested TensorDict of CPU tensors.
        attributes: JSON metadata for the root group.
        chunk_bytes: target chunk payload size.
        compression: a canonical codec spec or ``None``.
        rank, world: which chunks this process uploads: chunk ``i`` of every array
            belongs to rank ``i % world``, and only rank 0 uploads the ``zarr.json``
            documents (the local writer's split; the coordinator merges the manifests
            with :func:`ftrain.ckpt.store.merge_manifests`, then puts manifest and marker).
        reuse: leaves whose chunk objects are server-side copied from a committed step
            of the same location (see the module docstring); their ``state`` entry only
            gives shape and dtype.

    Returns:
        This rank's manifest (as :func:`ftrain.ckpt.store.write_tree` returns it;
        ``linked_bytes`` counts the copied chunk objects).

    Raises:
        CheckpointStoreError: a request failed (after obstore's retries).
    """
    codec = parse_compression(compression)
    spec_str = codec.spec if codec else None
    reuse = reuse or {}
    groups, leaves = groups_and_arrays(state)
    specs = {
        k: reuse[k].spec if k in reuse else plan_array(k, t, chunk_bytes, spec_str)
        for k, t in leaves.items()
    }
    jobs, copies = [], []
    for k, s in specs.items():
        source = reuse[k].source if k in reuse else None
        if isinstance(source, ObjectKey) and source.root == step.root:  # same location: copy
            audit = reuse[k].audit  # read whole and checked before the copy
            copies += [(s, i, source.key, i in audit) for i in range(rank, s.n_chunks, world)]
            continue
        data = tensor_bytes(reuse[k].tensor if k in reuse else leaves[k]) if s.n_chunks else None
        for i in range(rank, s.n_chunks, world):
            start, stop = s.chunk_span(i)
            jobs.append((s, i, data[start:stop], s.chunk_nbytes - (stop - start)))
    part = Part(groups, specs, attributes, rank, spec_str)
    return upload_objects(step, part, jobs, copies, FallbackBytes(reuse))


@dataclass(frozen=True)
class Part:
    """What one rank uploads besides its chunks: the tree's groups and array specs (for
    the documents, which rank 0 uploads, and the manifest), the root attributes."""

    groups: list
    specs: dict[str, ArraySpec]
    attributes: dict
    rank: int
    compression: str | None


def upload_objects(step, part: Part, jobs: list, copies: list = (), fallback=None) -> dict:
    """Upload chunk ``jobs`` (``(spec, i, payload, pad)``), server-side ``copies``
    (``(spec, i, source prefix)``) and, on rank 0, the ``zarr.json`` documents under the
    step prefix ``step``, ``concurrency`` requests in flight, each confirmed. Returns this
    rank's manifest (:func:`ftrain.ckpt.store.build_manifest`).

    Raises:
        CheckpointStoreError: a request failed (after obstore's retries).
    """
    specs = part.specs
    docs = step_documents(part.groups, specs, part.attributes) if part.rank == 0 else {}
    docs = {rel: json_bytes(d) for rel, d in docs.items()}
    root, prefix = step.root, step.key
    store = root.store
    fallback = fallback or FallbackBytes({})

    async def put_chunk(s: ArraySpec, i: int, payload: memoryview, pad: int) -> tuple:
        obj, crc, stored = await asyncio.to_thread(_chunk_object, s, payload, pad)
        await store.set(f"{prefix}/{s.key}/{s.chunk_key(i)}", _buffer(obj))
        protocol._phase("object_uploaded")  # fault-injection seam (tests kill here)
        return s.key, i, crc, stored, False

    async def copy_chunk(s: ArraySpec, i: int, source: str, whole: bool) -> tuple:
        rel = f"{s.key}/{s.chunk_key(i)}"
        size = (s.stored[i] if s.compression else s.chunk_nbytes) + 4  # + its crc32c
        if whole and not await _intact(store.store, f"{source}/{rel}", size, s.crc32c[i]):
            # a damaged source copied forward reached every later step (ftrain.ckpt.links)
            log.warning("%s/%s/%s does not match its checksum: uploaded afresh", root, source, rel)
            return await put_chunk(s, i, *fallback.chunk(s.key, s, i))
        try:
            await obstore.copy_async(store.store, f"{source}/{rel}", f"{prefix}/{rel}")
            # the copy is the committed source's bytes: one of another size (truncated,
            # replaced) would commit a step that cannot be restored, as the local link
            # checks before it links
            copied_size = (await obstore.head_async(store.store, f"{prefix}/{rel}"))["size"]
        except (obstore.exceptions.BaseError, OSError):  # gone, refused, too large: upload
            copied_size = None
        if copied_size != size:
            return await put_chunk(s, i, *fallback.chunk(s.key, s, i))
        protocol._phase("object_uploaded")
        return s.key, i, s.crc32c[i], size - 4, True

    async def put_doc(rel: str, data: bytes) -> None:
        await store.set(f"{prefix}/{rel}", _buffer(data))

    # the largest chunks first, so the tail of the upload is small requests
    coros = [put_chunk(*j) for j in sorted(jobs, key=lambda j: -len(j[2]))]
    coros += [copy_chunk(*c) for c in copies] + [put_doc(r, d) for r, d in docs.items()]
    results = root._run(prefix, gather_bounded, coros, root.concurrency)
    crcs: dict[str, dict[int, int]] = {k: {} for k in specs}
    stored: dict[str, dict[int, int]] = {k: {} for k in specs}
    copied = 0
    for r in results:
        if r is not None:
            crcs[r[0]][r[1]], stored[r[0]][r[1]] = r[2], r[3]
            copied += r[3] + 4 if r[4] else 0
    documents = {rel: [crc32c.crc32c(d), len(d)] for rel, d in docs.items()}
    return build_manifest(part.groups, specs, crcs, stored, documents, part.compression, copied)


async def _intact(store, key: str, size: int, crc: int) -> bool:
    """The object ``key`` is ``size`` bytes whose trailer and body carry crc32c ``crc``
    (the audited chunks of an incremental save, before their copy). An object that cannot
    be read counts as intact here: the copy decides (a refused copy is an upload)."""
    try:
        raw = bytes(await (await obstore.get_async(store, key)).bytes_async())
    except (obstore.exceptions.BaseError, OSError):
        return True
    trailer = int.from_bytes(raw[-4:], "little") if len(raw) == size else -1
    return trailer == crc and crc32c.crc32c(memoryview(raw)[:-4]) == crc


def _buffer(data: bytes):
    from zarr.core.buffer import default_buffer_prototype

    return default_buffer_prototype().buffer.from_bytes(data)


def _check_objects(step, specs: dict[str, ArraySpec]) -> None:
    """Every chunk object exists with its recorded size (one listing) — before anything is
    allocated."""
    sizes = {m["path"]: m["size"] for m in step.root.list(step.key + "/")}
    for s in specs.values():
        for i in range(s.n_chunks):
            key = f"{step.key}/{s.key}/{s.chunk_key(i)}"
            want = (s.stored[i] if s.compression else s.chunk_nbytes) + 4
            if key not in sizes:
                raise CorruptCheckpointError(f"{step.root.url}/{key}: chunk object is missing")
            if sizes[key] != want:
                raise CorruptCheckpointError(
                    f"{step.root.url}/{key}: chunk is {sizes[key]} bytes, expected {want}"
                )


def _verify_into(where: str, raw: bytes, dest: memoryview, pad: int, i: int, s: ArraySpec):
    """Check one downloaded chunk object and decode it into ``dest`` (a worker thread)."""
    stored = s.stored[i] if s.compression else s.chunk_nbytes
    if len(raw) != stored + 4:
        raise CorruptCheckpointError(f"{where}: chunk is {len(raw)} bytes, expected {stored + 4}")
    decode_verified(where, raw, stored, dest, pad, s.crc32c[i], s)


def download_tree(
    step, manifest: dict, *, only: tuple[str, ...] | None = None, concurrency: int = 8
) -> TensorDict:
    """Read a committed step (an ``ObjectKey``) into a nested CPU TensorDict, verifying.

    Args:
        step: the step's :class:`~ftrain.ckpt.objstore.ObjectKey`.
        manifest: its marker-checked manifest.
        only: key paths to read; ``None`` reads all.
        concurrency: requests in flight.

    Raises:
        CorruptCheckpointError: a missing, wrongly sized or corrupt chunk object.
        CheckpointStoreError: a request failed (after obstore's retries).
    """
    specs = selected_specs(manifest, only)
    _check_objects(step, specs)
    check_memory(step, specs)  # the shapes are backed by objects: a machine limit now
    out, tensors = allocate_tree(manifest, specs, only)
    jobs = [j for k, s in specs.items() for j in _whole_jobs(s, tensors[k])]
    _fetch(step, jobs, concurrency)
    return out


def download_owned(
    step, manifest: dict, owner, *, only: tuple[str, ...] | None = None, concurrency: int = 8
) -> tuple[TensorDict, int]:
    """:func:`ftrain.ckpt.sharded.read_owned` on an object store: of every array that
    ``owner.owned_rows(key, shape)`` gives a row range for, only the chunk objects that
    overlap those rows (whole objects: a chunk's crc32c covers all of it, so a ranged read
    of part of one could not be verified; resharding reads at most two chunks per array
    beyond its rows), made into a leaf by ``owner.from_rows``; every other array whole.

    Returns:
        The tree and the chunk payload bytes this rank downloaded.
    """
    from ftrain.ckpt.sharded import copy_rows, empty_rows, overlapping, rows_read_bytes

    specs = selected_specs(manifest, only)
    owned = {k: owner.owned_rows(k, s.shape) for k, s in specs.items()}
    whole = {k: s for k, s in specs.items() if owned[k] is None}
    row_bytes = sum(r[1] * specs[k].row_nbytes for k, r in owned.items() if r)
    _check_objects(step, specs)
    check_memory(step, whole, extra_bytes=row_bytes)  # before anything is allocated
    out, tensors = allocate_tree(manifest, whole, only)
    jobs = [j for k, s in whole.items() for j in _whole_jobs(s, tensors[k])]
    rows = {k: empty_rows(specs[k], r[1]) for k, r in owned.items() if r is not None}
    for k, local in rows.items():
        s, (start, length) = specs[k], owned[k]
        into = byte_view(local) if local.numel() else None
        for i in overlapping(s, start, length):
            c0, c1 = s.chunk_span(i)
            chunk = memoryview(bytearray(c1 - c0))  # verified whole, then its rows copied
            keep = partial(copy_rows, s, i, dest=into, start=start, length=length)
            jobs.append((s, i, chunk, s.chunk_nbytes - (c1 - c0), keep))
    _fetch(step, jobs, concurrency)
    for k, local in rows.items():
        out[tuple(k.split("/"))] = owner.from_rows(local, specs[k].shape)
    read = sum(s.nbytes for s in whole.values())
    return out, read + sum(rows_read_bytes(specs[k], *owned[k]) for k in rows)


def _whole_jobs(s: ArraySpec, tensor) -> list[tuple]:
    """``(spec, i, dest, pad, None)`` of every chunk of an array read whole into ``tensor``."""
    dest = byte_view(tensor) if s.n_chunks else None
    jobs = []
    for i in range(s.n_chunks):
        start, stop = s.chunk_span(i)
        jobs.append((s, i, dest[start:stop], s.chunk_nbytes - (stop - start), None))
    return jobs


def _fetch(step, jobs: list[tuple], concurrency: int) -> None:
    """GET every ``(spec, i, dest, pad, then)`` chunk object, ``concurrency`` in flight;
    verify and decode each into ``dest``, then call ``then(dest)`` if given (in a worker
    thread, like the decoding)."""
    root, store = step.root, step.root.store
    from zarr.core.buffer import default_buffer_prototype

    proto = default_buffer_prototype()

    async def get_chunk(s: ArraySpec, i: int, dest: memoryview, pad: int, then) -> None:
        key = f"{step.key}/{s.key}/{s.chunk_key(i)}"
        buf = await store.get(key, proto)
        if buf is None:
            raise CorruptCheckpointError(f"{root.url}/{key}: chunk object is missing")
        raw = buf.to_bytes()
        want = (s.stored[i] if s.compression else s.chunk_nbytes) + 4
        if len(raw) != want:  # listed at its size just before: the transfer, not the object
            raw = await _get_again(store, key, proto, want, root.url)
        await asyncio.to_thread(_verify_into, f"{root.url}/{key}", raw, dest, pad, i, s)
        if then is not None:
            then(dest)

    coros = [get_chunk(*j) for j in sorted(jobs, key=lambda j: -len(j[2]))]
    root._run(step.key, gather_bounded, coros, concurrency)


async def _get_again(store, key: str, proto, want: int, url: str) -> bytes:
    """A GET whose body was not the object's listed size: once more; a second short body
    is a transfer fault (a proxy, a cut connection), not a corrupt step: restore falling
    back to an older step for it had the next save set the intact one aside."""
    buf = await store.get(key, proto)
    raw = buf.to_bytes() if buf is not None else b""
    if len(raw) != want:
        raise CheckpointStoreError(
            f"{url}/{key}: the store sent {len(raw)} bytes of a {want}-byte object, twice "
            "(it is listed at its size): a transfer fault, not the checkpoint's; retry"
        )
    return raw


def verify_objects(step, manifest: dict) -> int:
    """Verify every document and chunk of an object-store step (``python -m ftrain.ckpt
    verify``); returns the payload bytes. Downloads the whole step into memory once.

    Raises:
        CorruptCheckpointError: any metadata or chunk fails verification.
    """
    specs = specs_of(manifest)
    docs = {}
    for g in manifest["groups"]:
        rel = f"{g}/zarr.json" if g else "zarr.json"
        docs[g] = step.read_document(rel, checksum=doc_checksum(manifest, rel))
    for s in specs.values():
        rel = f"{s.key}/zarr.json"
        docs[s.key] = step.read_document(rel, checksum=doc_checksum(manifest, rel))
        check_array_doc(step / rel, docs[s.key], s, manifest["format_version"])
    check_consolidated(step / "zarr.json", docs)
    download_tree(step, manifest, concurrency=step.root.concurrency)
    return sum(s.nbytes for s in specs.values())
