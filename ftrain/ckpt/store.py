"""Write a whole TensorDict into a step directory (reading it back:
:mod:`ftrain.ckpt.reader`).

The writer fans chunk writes out over two thread pools side by side (``os.write`` releases
the GIL): large chunks (O_DIRECT, disk-bound) largest first, and the metadata-bound rest
(``zarr.json`` documents, small chunks, and the directories they need, made on demand by
whichever job needs one first). Creating the ~800 directories and ~1,100 small files of a
GPT-2 state costs about as long as writing its data on a VM disk; overlapping the two
hides most of it. Durability:
on Linux one ``syncfs`` of the staging directory's file system after all files are written
(a GPT-2 state has ~2,000 files and directories; fsync-ing each one costs more than the
data); elsewhere every file is fsync'd in its worker (overlapping with other writes) and
every directory bottom-up.

Multi-rank seam: :func:`write_tree` takes ``rank`` and ``world``. Chunk ``i`` of every
array belongs to rank ``i % world``; only rank 0 writes ``zarr.json`` documents. Each
rank returns the crc values of its own chunks; the coordinator merges them into one
manifest (:func:`merge_manifests`) before committing. World size 1 is all that is
exercised today.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import re
import sys
from pathlib import Path

import crc32c
import torch
from tensordict import TensorDictBase

from ftrain.ckpt._threads import run_parallel, run_pools
from ftrain.ckpt.chunkio import tensor_bytes, write_chunk
from ftrain.ckpt.codecs import parse_compression
from ftrain.ckpt.documents import step_documents
from ftrain.ckpt.format import (
    DEFAULT_CHUNK_BYTES,
    DIRECT_MIN_BYTES,
    FORMAT_VERSION,
    MAX_NDIM,
    NAME_RE,
    ArraySpec,
    CorruptCheckpointError,
    json_bytes,
    plan_array,
    write_json,
)
from ftrain.ckpt.incremental import FallbackBytes, Reuse
from ftrain.ckpt.links import DAMAGED, LINKED, link_chunk, link_document
from ftrain.state.tree import nodes_and_leaves

__all__ = [
    "check_chunk_sizes",
    "check_key_lengths",
    "check_path_lengths",
    "groups_and_arrays",
    "merge_manifests",
    "write_tree",
]

log = logging.getLogger("ftrain.ckpt")

RESERVED = {"zarr.json"}
ROOT_RESERVED = {"manifest.json", "COMMITTED"}
DEFAULT_WORKERS = 4


def groups_and_arrays(td: TensorDictBase) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The step's Zarr nodes: groups (``""`` = root, empty sub-dicts included, parents
    first) and leaves keyed by ``"a/b/c"``, both in the library's one sorted walk
    (:func:`ftrain.state.tree.nodes_and_leaves`), each name checked.

    Raises:
        ValueError: a key that cannot be a Zarr node name (contains ``/``, is empty, starts
            with ``__`` or is reserved), or a leaf that is not a dense tensor with data.
    """
    nodes, keys, values = nodes_and_leaves(td)
    for path in nodes[1:] + keys:
        _check_name(path)
    arrays = {}
    for key, value in zip(keys, values, strict=True):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"leaf {'/'.join(key)!r} is a {type(value).__name__}, not a tensor")
        _check_storable("/".join(key), value)
        arrays["/".join(key)] = value
    return ["/".join(n) for n in nodes], arrays


def _check_storable(key: str, t: torch.Tensor) -> None:
    """A dense tensor: a quantized one committed without its scale and zero point, a
    sparse one failed in the background writer. (Meta tensors pass: the incremental
    save's host snapshot uses them as shape-only placeholders of linked device leaves.)"""
    if t.is_quantized:
        raise ValueError(f"leaf {key!r} is quantized ({t.dtype}); save t.dequantize()")
    if t.dim() > MAX_NDIM:  # committed, then refused by every reader as corrupt
        raise ValueError(
            f"leaf {key!r} has {t.dim()} dimensions; a checkpoint array has at most {MAX_NDIM}: "
            "save a reshaped view (t.flatten(0, k)) and reshape it back after restore"
        )
    if t.layout != torch.strided:
        raise ValueError(f"leaf {key!r} is {t.layout}, not dense; save t.to_dense()")


def _check_name(path: tuple[str, ...]) -> None:
    name, prefix = path[-1], "/".join(path[:-1])
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name.startswith("__"):
        raise ValueError(
            f"key {name!r} under {prefix or '/'!r} is not a valid node name: use "
            "letters, digits, '_', '-' and '.' (not first), no '/', not starting with '__'"
        )
    if name in RESERVED or (not prefix and name in ROOT_RESERVED):
        raise ValueError(f"key {name!r} is reserved by the checkpoint format; rename it")
    if len(name.encode()) > _NAME_MAX:  # ENAMETOOLONG deep in the writer (async: later)
        raise ValueError(
            f"key {name[:40]!r}... under {prefix or '/'!r} is {len(name.encode())} bytes long: "
            f"a node is a directory, whose name may have at most {_NAME_MAX} bytes; shorten it"
        )


_NAME_MAX = 255  # bytes in a file name: Linux's NAME_MAX (ext4, xfs, tmpfs)
_PATH_MAX = 4096  # bytes in a path given to the kernel, its NUL included (Linux)
# what a chunk's path adds beyond DIR and the key: the staging or set-aside step name
# (step_00000400.tmp-<pid>-<hex>, .replaced-<hex>); the file names are added per leaf
_STEP_NAME_ROOM = 64


def check_path_lengths(directory: Path, arrays: dict[str, torch.Tensor]) -> None:
    """Every chunk file's path fits the kernel's PATH_MAX under ``directory``: past it,
    the writer failed later (at ``wait()``, an async save) with ``ENAMETOOLONG`` naming a
    4 KB path, not the key, and the failure sent the save to the fallback directory."""
    base = len(os.fsencode(os.path.abspath(directory))) + _STEP_NAME_ROOM
    for key, need in _needs(base, arrays):
        if need >= _PATH_MAX:
            raise ValueError(
                f"leaf {key[:60]!r}... needs a path of about {need} bytes under "
                f"{_shown(directory)}; the kernel takes at most {_PATH_MAX - 1}: shorten its "
                "keys or nest them less (or save into a directory with a shorter path)"
            )


_OBJECT_KEY_MAX = 1024  # bytes in an object's key: S3, Google Cloud Storage, Azure Blob


def check_key_lengths(url: str, arrays: dict[str, torch.Tensor]) -> None:
    """Every chunk's object key fits the stores' 1,024 bytes under the location ``url``
    (``s3://bucket/prefix``): past it every save failed at its first upload and went to
    the fallback, or failed, ``checkpoint.every_steps`` of compute lost each time."""
    from urllib.parse import urlsplit

    base = len(urlsplit(url).path.strip("/").encode()) + 1 + _STEP_NAME_ROOM
    for key, need in _needs(base, arrays):
        if need > _OBJECT_KEY_MAX:
            raise ValueError(
                f"leaf {key[:60]!r}... needs an object key of about {need} bytes under "
                f"{_shown(url)}; object stores take at most {_OBJECT_KEY_MAX}: shorten its "
                "keys or nest them less (or use a shorter prefix)"
            )


def _needs(base: int, arrays: dict[str, torch.Tensor]):
    """``(key, bytes)``: the longest name a leaf's files take, ``base`` bytes under it."""
    for key, t in arrays.items():
        first = len(str(max(t.shape[0] - 1, 0))) if t.dim() else 1  # chunks split dim 0
        chunk = 3 + first + 2 * max(t.dim() - 1, 0)  # "/c.11.0": one file name per chunk
        yield key, base + len(key.encode()) + max(chunk, len("/zarr.json"))


def _shown(where) -> str:
    return str(where) if len(str(where)) <= 80 else f"{str(where)[:60]}..."


def check_chunk_sizes(
    arrays: dict[str, torch.Tensor],
    chunk_bytes: int,
    compression: str | None,
    rows_only: bool = False,
) -> None:
    """Every chunk fits the codec's largest buffer (Blosc: just under 2 GiB). A chunk is
    at least one row of dim 0, so a leaf whose row is that large failed in the background
    writer after ``save()`` had returned, naming neither the leaf nor the fix.
    ``rows_only``: check one row (a sharded save plans its chunks by rank, at most 1 GiB
    of whole rows)."""
    codec = parse_compression(compression)
    limit = codec.max_chunk_bytes if codec else None
    if limit is None:
        return
    for key, t in arrays.items():
        if t.dim() == 0 or t.numel() == 0:
            continue
        row = t.numel() // t.shape[0] * t.element_size()
        chunk = row if rows_only else plan_array(key, t, chunk_bytes, codec.spec).chunk_nbytes
        if chunk > limit:
            fix = (
                "a view with more, smaller rows (t.reshape(-1, n))"
                if chunk == row
                else "a smaller chunk_bytes"
            )
            raise ValueError(
                f"leaf {key!r} needs chunks of {chunk} bytes ({chunk // row} row(s) of its "
                f"first dimension), past the {limit} bytes {codec.spec} compresses at once: "
                f"save it with compression='zstd' or none, or {fix}"
            )


def _chunk_jobs(tmp: Path, spec: ArraySpec, data: memoryview, rank: int, world: int) -> list:
    jobs = []
    for i in range(spec.n_chunks):
        if i % world != rank:
            continue
        start, stop = spec.chunk_span(i)
        pad = spec.chunk_nbytes - (stop - start)
        path = tmp.joinpath(*spec.key.split("/"), *spec.chunk_key(i).split("/"))
        jobs.append((path, spec.key, i, data[start:stop], pad))
    return jobs


def _all_dirs(tmp: Path, groups: list[str], specs: list[ArraySpec]) -> list[Path]:
    """Every directory of the step, parents before children (for per-directory fsync)."""
    made = [tmp] + [tmp.joinpath(*rel.split("/")) for rel in groups[1:] + [s.key for s in specs]]
    for s in specs:
        for i in range(s.n_chunks):
            parts = s.chunk_key(i).split("/")[:-1]
            for j in range(1, len(parts) + 1):
                made.append(tmp.joinpath(*s.key.split("/"), *parts[:j]))
    return sorted(set(made), key=lambda d: len(d.parts))


def fsync_dirs(tmp: Path, groups: list[str], specs: list[ArraySpec], workers: int) -> None:
    """fsync every directory of the step that exists, children first (the per-file path:
    without ``syncfs`` a file's name is durable only once its directory is). A rank of a
    sharded save sees only the directories that exist when it is done (its own and those
    made before); each rank syncs the ones its files are in."""
    dirs = [d for d in reversed(_all_dirs(tmp, groups, specs)) if d.is_dir()]
    run_parallel(fsync_dir, dirs, workers)


class _Dirs:
    """Creates directories on demand, from any thread: the first job that needs a directory
    makes it (and its parents), so no mkdir phase delays the first data write."""

    def __init__(self, tmp: Path) -> None:
        self._made = {tmp}

    def ensure(self, d: Path) -> None:
        if d in self._made:
            return
        self.ensure(d.parent)
        try:
            os.mkdir(d)
        except FileExistsError:  # another thread made it first (or a re-used staging dir)
            if not d.is_dir():
                raise
        self._made.add(d)


def write_tree(
    tmp: Path,
    state: TensorDictBase,
    attributes: dict,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    workers: int = DEFAULT_WORKERS,
    durable: bool = True,
    rank: int = 0,
    world: int = 1,
    compression: str | None = None,
    direct: bool = True,
    reuse: dict[str, Reuse] | None = None,
) -> dict:
    """Write ``state`` (CPU tensors) into the existing directory ``tmp``.

    Args:
        tmp: the step's staging directory (already created).
        state: a nested TensorDict of CPU tensors.
        attributes: JSON metadata for the root group's attributes.
        chunk_bytes: target chunk payload size.
        workers: I/O threads.
        durable: fsync every file and directory written.
        rank, world: which chunks this process writes (see the module docstring).
        compression: a codec spec (:func:`ftrain.ckpt.codecs.parse_compression`) or None.
        direct: write large raw chunks with O_DIRECT where supported (see ``_direct``).
        reuse: leaves whose chunk files are hard-linked from a committed step instead of
            written (:mod:`ftrain.ckpt.incremental`); a chunk that cannot be linked is
            written from ``Reuse.tensor``. Their ``state`` entry only gives shape and dtype.

    Returns:
        This rank's manifest: ``{"format_version", "groups", "arrays", "nbytes",
        "linked_bytes", "compression"}`` (``nbytes``: bytes of this rank's chunk files,
        ``linked_bytes`` of them hard-linked rather than written).

    Raises:
        OSError: from the file system; ValueError for a state the format cannot hold.
    """
    codec = parse_compression(compression)
    spec_str = codec.spec if codec else None
    reuse = reuse or {}
    groups, leaves = groups_and_arrays(state)
    specs = {
        k: reuse[k].spec if k in reuse else plan_array(k, t, chunk_bytes, spec_str)
        for k, t in leaves.items()
    }
    jobs = _document_jobs(tmp, groups, specs, attributes, reuse) if rank == 0 else []
    links: list = []
    for k, s in specs.items():
        if not s.n_chunks:
            continue
        if k in reuse and isinstance(reuse[k].source, Path):
            links += _link_jobs(tmp, reuse[k], rank, world)
        else:
            data = tensor_bytes(reuse[k].tensor if k in reuse else leaves[k])
            jobs += [("chunk", *j) for j in _chunk_jobs(tmp, s, data, rank, world)]
    # Two pools side by side: large chunks (disk-bound, O_DIRECT) largest first, and the
    # metadata-bound rest (zarr.json documents, small chunks, the directories they need).
    # Creating ~800 directories and ~1,100 small files costs about as long as writing the
    # data on this VM; overlapping the two hides most of it.
    is_big = [j[0] == "chunk" and len(j[4]) + j[5] >= DIRECT_MIN_BYTES for j in jobs]
    big = sorted((j for j, b in zip(jobs, is_big, strict=True) if b), key=lambda j: -len(j[4]))
    big += links  # metadata work, but the data pool is idle when most leaves are linked
    meta = [j for j, b in zip(jobs, is_big, strict=True) if not b]  # documents first
    per_file = durable and not _HAVE_SYNCFS
    w = _Writer(tmp, specs, FallbackBytes(reuse), codec, durable=per_file, direct=direct)
    with FsSync.opened(tmp, durable and not per_file) as watch:  # before anything is written
        # ``workers`` threads for the data, half as many again for metadata (4 + 2
        # measured best on 2 cores: 3 + 1, 4 + 1 and 5 + 2 were slower).
        results = run_pools([(w.do, big, workers), (w.do, meta, max(1, workers // 2))])
        if watch is not None:
            watch.sync()
    _say_damaged(w.damaged, tmp)
    crcs: dict[str, dict[int, int]] = {k: {} for k in specs}
    stored: dict[str, dict[int, int]] = {k: {} for k in specs}
    documents: dict[str, list[int]] = {}
    linked = 0
    for r in results[0] + results[1]:
        if r[0] == "doc":
            documents[r[1]] = [r[2], r[3]]
        else:
            crcs[r[1]][r[2]] = r[3]
            stored[r[1]][r[2]] = r[4]
            linked += r[4] + 4 if r[5] else 0
    if per_file:
        fsync_dirs(tmp, groups, list(specs.values()), workers)
    return build_manifest(groups, specs, crcs, stored, documents, spec_str, linked)


class _Writer:
    """Runs one job of :func:`write_tree` (from any thread): writes a ``zarr.json``, writes
    a chunk, or hard-links a chunk or document of the step the reused leaves come from
    (writing it instead where the link is impossible)."""

    def __init__(self, tmp, specs, fallback, codec, *, durable: bool, direct: bool) -> None:
        self.tmp, self.specs, self.fallback, self.codec = tmp, specs, fallback, codec
        self.durable, self.direct = durable, direct
        self.mk = _Dirs(tmp)
        self.damaged: list[str] = []  # source files that failed their check, written afresh

    def do(self, job: tuple) -> tuple:
        """``job`` = ``(kind, destination path, ...)``; returns what was recorded."""
        kind, path = job[0], job[1]
        self.mk.ensure(path.parent)
        if kind == "json":
            return self._document(*job[1:])
        if kind == "link":
            _, path, key, i, src, whole = job
            s = self.specs[key]
            stored = s.stored[i] if s.compression else s.chunk_nbytes
            got = link_chunk(src, path, stored + 4, s.crc32c[i], whole=whole)
            if got == LINKED:
                return "chunk", key, i, s.crc32c[i], stored, True
            self._note(got, src)
            job = ("chunk", path, key, i, *self.fallback.chunk(key, s, i))
        _, path, key, i, payload, pad = job
        crc, stored = write_chunk(
            path,
            payload,
            pad,
            durable=self.durable,
            codec=self.codec,
            itemsize=self.specs[key].itemsize,
            direct=self.direct,
        )
        return "chunk", key, i, crc, stored, False

    def _document(self, path: Path, doc: dict, src: str | None) -> tuple:
        rel = path.relative_to(self.tmp).as_posix()
        if src is not None:
            data = json_bytes(doc)
            got = link_document(src, path, data)
            if got == LINKED:
                return "doc", rel, crc32c.crc32c(data), len(data)
            self._note(got, src)
        crc, length = write_json(path, doc, durable=self.durable)
        return "doc", rel, crc, length

    def _note(self, outcome: str, src: str) -> None:
        if outcome == DAMAGED:
            self.damaged.append(src)  # list.append: atomic under the GIL, any thread


def _say_damaged(damaged: list[str], tmp: Path) -> None:
    """Name the files of an earlier step that failed their check before a link."""
    if damaged:
        shown = ", ".join(sorted(damaged)[:5]) + (" ..." if len(damaged) > 5 else "")
        log.warning(
            "%d file(s) of an earlier step do not match their checksums and were written "
            "afresh into %s instead of linked: %s. The steps that share them are damaged: "
            "`python -m ftrain.ckpt verify DIR` names them",
            len(damaged),
            tmp.name,
            shown,
        )


def _document_jobs(
    tmp: Path, groups: list[str], specs: dict[str, ArraySpec], attributes: dict, reuse: dict
) -> list:
    """The ``zarr.json`` jobs, the root (consolidated, the largest) first. A document of
    a reused array, or of a group holding only reused arrays (a frozen subtree), has the
    same bytes as in the step they come from (documents depend only on the layout, which
    reuse requires to be the same; groups carry no attributes): it is hard-linked from
    there, like the chunks. The root's attributes change every step: always written."""
    sources = {r.source for r in reuse.values()}
    source = sources.pop() if len(sources) == 1 else None
    same = _unchanged_nodes(groups, specs, reuse) if isinstance(source, Path) else set()
    jobs = []
    for rel, doc in step_documents(groups, specs, attributes).items():
        src = f"{source}/{rel}" if rel.rpartition("/")[0] in same else None
        jobs.append(("json", tmp.joinpath(*rel.split("/")), doc, src))
    return jobs


def _unchanged_nodes(groups: list[str], specs: dict, reuse: dict) -> set[str]:
    """The reused arrays and the groups with nothing but reused arrays below them."""
    changed = {""}
    for key in specs:
        if key not in reuse:
            parts = key.split("/")
            changed.update("/".join(parts[:j]) for j in range(1, len(parts)))
    return set(reuse) | {g for g in groups if g not in changed}


def _link_jobs(tmp: Path, reuse: Reuse, rank: int, world: int) -> list:
    spec, jobs = reuse.spec, []
    for i in range(rank, spec.n_chunks, world):
        rel = f"{spec.key}/{spec.chunk_key(i)}"  # the source as a string: no Path to parse
        src, whole = f"{reuse.source}/{rel}", i in reuse.audit
        jobs.append(("link", tmp.joinpath(*rel.split("/")), spec.key, i, src, whole))
    return jobs


def build_manifest(
    groups: list[str],
    specs: dict[str, ArraySpec],
    crcs: dict[str, dict[int, int]],
    stored: dict[str, dict[int, int]],
    documents: dict[str, list[int]],
    compression: str | None,
    linked_bytes: int = 0,
) -> dict:
    """One writer's manifest from what it wrote (every backend builds it here).

    Args:
        groups, specs: the tree's groups and planned arrays.
        crcs, stored: ``{key: {chunk: crc32c}}`` and ``{key: {chunk: bytes before the crc}}``
            of the chunks this writer wrote (missing chunks: ``None``, merged later).
        documents: ``{relative path: [crc32c, length]}`` of the ``zarr.json`` it wrote.
        compression: the canonical codec spec or ``None``.
        linked_bytes: bytes of those chunk files that were linked or copied from an
            earlier step instead of written (:mod:`ftrain.ckpt.incremental`).
    """
    arrays = {}
    for k, s in specs.items():
        arrays[k] = s.to_json() | {"crc32c": [crcs[k].get(i) for i in range(s.n_chunks)]}
        if compression:
            arrays[k]["stored_nbytes"] = [stored[k].get(i) for i in range(s.n_chunks)]
    nbytes = sum(n + 4 for per in stored.values() for n in per.values())
    return {
        "format_version": FORMAT_VERSION,
        "groups": groups,
        "arrays": arrays,
        "documents": documents,  # crc32c and length of every zarr.json: metadata is checked too
        "nbytes": nbytes,
        "linked_bytes": linked_bytes,
        "compression": compression,
    }


def merge_manifests(parts: list[dict]) -> dict:
    """Merge per-rank manifests (each holds crc values for its own chunks only).

    Raises:
        ValueError: the parts list different arrays, or a chunk that no rank wrote (a step
            with a hole must not be committed).
    """
    keys = [sorted(p["arrays"]) for p in parts]
    if any(k != keys[0] for k in keys):
        raise ValueError("the ranks' parts list different arrays; the ranks saved different states")
    merged = parts[0] | {"arrays": {k: dict(v) for k, v in parts[0]["arrays"].items()}}
    merged["nbytes"] = sum(p["nbytes"] for p in parts)
    merged["linked_bytes"] = sum(p.get("linked_bytes", 0) for p in parts)
    merged["documents"] = {k: v for p in parts for k, v in p.get("documents", {}).items()}
    for part in parts[1:]:
        for k, v in part["arrays"].items():
            for field in ("crc32c", "stored_nbytes"):
                if field not in v:
                    continue
                mine = merged["arrays"][k][field] = list(merged["arrays"][k][field])
                mine[:] = [a if a is not None else b for a, b in zip(mine, v[field], strict=True)]
    _check_complete(merged)
    return merged


def _check_complete(manifest: dict) -> None:
    for name, spec in manifest["arrays"].items():
        for field in ("crc32c", "stored_nbytes"):
            holes = [i for i, v in enumerate(spec.get(field) or []) if v is None]
            if holes:
                raise ValueError(
                    f"array {name!r}: no rank wrote chunk(s) {holes[:5]} (its {field} is "
                    "missing); the ranks' shardings do not cover the array"
                )
        try:  # the reader's own check: never commit a step no restore would accept
            ArraySpec.from_json(name, spec)
        except CorruptCheckpointError as e:
            raise ValueError(f"the merged manifest is not one a restore accepts: {e}") from e


def _load_syncfs():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.syncfs if sys.platform.startswith("linux") else None
    except (OSError, AttributeError):
        return None


def _kernel_at_least(major: int, minor: int) -> bool:
    found = re.match(r"(\d+)\.(\d+)", os.uname().release) if hasattr(os, "uname") else None
    return found is not None and (int(found[1]), int(found[2])) >= (major, minor)


_SYNCFS = _load_syncfs()
# before Linux 5.8 syncfs returns 0 even when a write-back failed: fsync every file there
_HAVE_SYNCFS = _SYNCFS is not None and _kernel_at_least(5, 8)


class FsSync:
    """One ``syncfs`` of the file system holding ``path`` (one call replaces thousands of
    per-file fsyncs), through a descriptor opened at construction, i.e. before the save
    writes anything. Linux reports to ``syncfs`` the write-back errors recorded since its
    descriptor was opened: one opened after the writes would miss an error that another
    process's ``syncfs`` (a shared file system) saw first, and a lost write would commit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))

    def sync(self) -> None:
        """Flush and report; the descriptor is closed either way."""
        try:
            if _SYNCFS(self.fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"syncfs failed: {os.strerror(err)}", str(self.path))
        finally:
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @classmethod
    @contextlib.contextmanager
    def opened(cls, path: Path, enabled: bool):
        """``with FsSync.opened(tmp, enabled) as watch``: a watch (None when not enabled)
        whose descriptor is closed on leaving the block; call ``watch.sync()`` inside it."""
        watch = cls(path) if enabled else None
        try:
            yield watch
        finally:
            if watch is not None:
                watch.close()


def fsync_dir(path: Path) -> None:
    """fsync a directory so the names in it are durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
