"""Read (part of) a committed step back, and verify one: the reading half of
:mod:`ftrain.ckpt.store`.

The reader trusts the manifest (sealed by the marker) for shapes, dtypes and checksums
(:func:`specs_of` validates every field before anything acts on it), checks every chunk's
size before allocating, queues every chunk file's read with the kernel
(:func:`prefetching`), and checks each chunk's crc32c while reading straight into freshly
allocated tensors, the large chunks and the small ones on thread pools side by side (the
writer's split). :func:`verify_tree` also checks every ``zarr.json`` document against its
checksum and the manifest.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tensordict import TensorDict

from ftrain.ckpt._threads import run_parallel, run_pools
from ftrain.ckpt.chunkio import read_chunk, read_chunks_into
from ftrain.ckpt.format import (
    DIRECT_MIN_BYTES,
    ArraySpec,
    CheckpointReadError,
    CorruptCheckpointError,
    array_zarr_json,
    check_key,
    parse_dtype,
    read_json,
    unreadable,
)
from ftrain.ckpt.store import DEFAULT_WORKERS

__all__ = [
    "allocate_tree",
    "byte_view",
    "check_array_doc",
    "check_consolidated",
    "check_memory",
    "check_no_links",
    "check_sizes",
    "doc_checksum",
    "chunk_files",
    "prefetching",
    "read_jobs",
    "read_tree",
    "selected_specs",
    "specs_of",
    "verify_tree",
]


def specs_of(manifest: dict) -> dict[str, ArraySpec]:
    """Every array of a manifest, validated (keys, groups, shapes, checksums) before use."""
    arrays, groups = manifest.get("arrays"), manifest.get("groups")
    if not isinstance(arrays, dict) or not isinstance(groups, list):
        raise CorruptCheckpointError("manifest has no 'arrays'/'groups'")
    for g in groups:
        if g != "":
            check_key(g)
    if "" not in groups:
        raise CorruptCheckpointError("manifest lists no root group")
    docs = manifest.get("documents", {})
    if not isinstance(docs, dict) or not all(_is_checksum(v) for v in docs.values()):
        raise CorruptCheckpointError("manifest 'documents' is not {path: [crc32c, length]}")
    specs = {k: ArraySpec.from_json(k, v) for k, v in arrays.items()}
    _check_hierarchy(groups, specs, docs if "documents" in manifest else None)
    return specs


def _check_hierarchy(groups: list, specs: dict, docs: dict | None) -> None:
    """The node lists agree with each other: every array sits in a listed group, no name is
    both, and (when recorded) exactly the listed nodes have checksummed documents — so a
    group added to or dropped from the manifest cannot change the restored tree."""
    names = set(groups)
    if len(names) != len(groups) or names & set(specs):
        raise CorruptCheckpointError("manifest lists a node twice")
    for key in list(specs) + [g for g in groups if g]:
        parent = key.rpartition("/")[0]
        if parent not in names:
            raise CorruptCheckpointError(f"manifest node {key!r} has no parent group {parent!r}")
    if docs is not None:
        want = {f"{n}/zarr.json" if n else "zarr.json" for n in list(names) + list(specs)}
        if set(docs) != want:
            odd = sorted(set(docs) ^ want)[:3]
            raise CorruptCheckpointError(f"manifest documents do not match its nodes: {odd}")


def _is_checksum(v: object) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v)


def doc_checksum(manifest: dict, rel: str) -> list | None:
    """The ``[crc32c, length]`` recorded for the document ``rel`` (``None``: a step written
    before documents were checksummed)."""
    docs = manifest.get("documents")
    if docs is None:
        return None
    if rel not in docs:
        raise CorruptCheckpointError(f"manifest has no checksum for {rel}")
    return docs[rel]


def _check_array_meta(root: Path, spec: ArraySpec, manifest: dict) -> dict:
    rel = f"{spec.key}/zarr.json"
    path = root.joinpath(*spec.key.split("/"), "zarr.json")
    doc = read_json(path, checksum=doc_checksum(manifest, rel))
    check_array_doc(path, doc, spec, manifest["format_version"])
    return doc


# what a plain Zarr v3 reader reads of an array's document, and must agree with the manifest
_READ_FIELDS = ("zarr_format", "node_type", "shape", "data_type", "chunk_grid", "codecs")
_READ_FIELDS += ("chunk_key_encoding",)
# fields a v3 document may hold beside those; any other must say must_understand: false
_OTHER_FIELDS = {"fill_value", "attributes", "storage_transformers", "dimension_names"}


def check_array_doc(where: object, doc: dict, spec: ArraySpec, fmt: int) -> None:
    """An array's ``zarr.json`` agrees with its manifest entry (what plain readers use), as
    format ``fmt`` (the step's, which the marker sealed) writes it: every field a reader
    acts on, ftrain's own dtype attribute, and no extension a reader must understand.

    Raises:
        CorruptCheckpointError: a field differs; the message names it and both values.
    """
    want = array_zarr_json(spec, fmt)
    for field in _READ_FIELDS:
        if doc.get(field) != want[field]:
            raise CorruptCheckpointError(
                f"{where}: {field} is {doc.get(field)!r}, the manifest says {want[field]!r}"
            )
    problem = _doc_extras(doc, spec)
    if problem:
        raise CorruptCheckpointError(f"{where}: {problem}")


def _doc_extras(doc: dict, spec: ArraySpec) -> str | None:
    """What else in an array's document a reader would act on wrongly, or refuse."""
    if doc.get("storage_transformers", []) != []:
        return f"storage_transformers is {doc['storage_transformers']!r}, ftrain writes none"
    names = doc.get("dimension_names")
    if names is not None and (not isinstance(names, list) or len(names) != len(spec.shape)):
        return f"dimension_names is {names!r}, not one per dimension of {list(spec.shape)}"
    ours = (
        doc.get("attributes", {}).get("ftrain") if isinstance(doc.get("attributes"), dict) else None
    )
    if not isinstance(ours, dict) or ours.get("dtype") != spec.dtype:
        return f"attributes.ftrain is {ours!r}, the manifest's dtype is {spec.dtype!r}"
    for field in sorted(set(doc) - set(_READ_FIELDS) - _OTHER_FIELDS):
        value = doc[field]
        if not (isinstance(value, dict) and value.get("must_understand") is False):
            return f"field {field!r} is an extension a reader must understand ({value!r})"
    return None


def check_consolidated(where: object, docs: dict[str, dict]) -> None:
    """The root document's consolidated metadata (what ``zarr.open_group`` reads by
    default, instead of each node's document) describes exactly the step's nodes as their
    own documents do; a step without it (an older format) has nothing to check.

    Raises:
        CorruptCheckpointError: a node missing from it, one it adds, or one it describes
            otherwise (a plain reader read another dtype or shape, silently).
    """
    inline = docs.get("", {}).get("consolidated_metadata")
    if inline is None:
        return
    entries = inline.get("metadata") if isinstance(inline, dict) else None
    nodes = {path: doc for path, doc in docs.items() if path}
    if not isinstance(entries, dict) or set(entries) != set(nodes):
        shown = sorted(entries)[:5] if isinstance(entries, dict) else entries
        raise CorruptCheckpointError(
            f"{where}: its consolidated metadata does not list the step's nodes ({shown!r})"
        )
    for path, doc in nodes.items():
        entry = entries[path]
        if doc.get("node_type") == "group" and isinstance(entry, dict):
            entry = {k: v for k, v in entry.items() if k != "consolidated_metadata"}
        if entry != doc:
            raise CorruptCheckpointError(
                f"{where}: its consolidated metadata of {path!r} differs from "
                f"{path}/zarr.json (plain Zarr readers use the consolidated copy)"
            )


def check_no_links(root: Path) -> None:
    """Refuse a step that contains symbolic links: ftrain never writes them, and following
    one could read (or, for cleanup, delete) outside the step directory."""
    stack = [root]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError as e:
            raise unreadable(root, e, "cannot list") from e
        for e in entries:
            if e.is_symlink():
                raise CorruptCheckpointError(f"{e.path}: symbolic link inside a checkpoint")
            if e.is_dir(follow_symlinks=False):
                stack.append(Path(e.path))


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(where: object, specs: dict[str, ArraySpec], extra_bytes: int = 0) -> None:
    """Refuse a step whose arrays (plus ``extra_bytes``: the rows of other arrays a rank
    reads) do not fit in the memory available now, before anything is allocated: a
    :class:`CheckpointReadError` (ENOMEM), a condition of this machine, so the step is not
    judged corrupt (judged so, restore passed over an intact step and the next save set it
    aside). Callers check the chunk sizes first, so a manifest declaring shapes its files
    do not back is corruption, found before this."""
    total = sum(s.nbytes for s in specs.values()) + extra_bytes
    avail = _available_memory()
    if total > avail:
        raise CheckpointReadError(
            errno.ENOMEM,
            f"{where}: restoring needs {total:,} bytes of memory, only {avail:,} are "
            "available: a limit of this machine, not a fault of the checkpoint, which is "
            "left as it is; free memory (or use a machine with more) and retry",
        )


def chunk_files(
    root: Path, specs: dict[str, ArraySpec], which: Callable[[ArraySpec], range] | None = None
) -> list[tuple[Path, int]]:
    """``(path, size)`` of the chunk files of ``specs`` as the manifest records them: all,
    or chunks ``which(spec)`` of each."""
    return [
        (
            root.joinpath(*s.key.split("/"), *s.chunk_key(i).split("/")),
            (s.stored[i] if s.compression else s.chunk_nbytes) + 4,
        )
        for s in specs.values()
        for i in (range(s.n_chunks) if which is None else which(s))
    ]


def check_sizes(
    root: Path, specs: dict[str, ArraySpec], extra_bytes: int = 0, *, memory: bool = True
) -> None:
    """Before allocating anything: every chunk file exists with its recorded size (so the
    declared shapes are backed by bytes on disk), and (``memory``) the whole result (plus
    ``extra_bytes``) fits in memory; a mapped restore needs none of it."""
    for path, want in chunk_files(root, specs):
        try:
            size = os.lstat(path).st_size
        except OSError as e:
            raise unreadable(path, e, "chunk file is missing") from e
        if size != want:
            raise CorruptCheckpointError(f"{path}: chunk is {size} bytes, expected {want}")
    if memory:
        check_memory(root, specs, extra_bytes)  # the shapes are backed: a machine limit now


@contextlib.contextmanager
def prefetching(files: list[tuple[Path, int]]) -> Iterator[None]:
    """For the block: a thread asks the kernel to start reading the ``(path, size)``
    files in the order given (``POSIX_FADV_WILLNEED``), up to half the available memory.

    Why: each I/O thread waits on one chunk at a time, so without it the disk sees only a
    few requests in flight; with it the whole restore is queued from the start, while the
    size checks, the allocation and the first chunks' crc run (cold mapped restore of the
    GPT-2 state 0.88x -> 0.71x safetensors, docs/benchmarks.md). Hints only: what is read
    is verified as always, and a hint never opens through a final symbolic link or blocks
    on a FIFO."""
    hints = threading.Thread(
        target=run_parallel, args=(_prefetch_file, _within_half_memory(files), 1), daemon=True
    )
    hints.start()
    try:
        yield
    finally:
        hints.join()


def _within_half_memory(files: list[tuple[Path, int]]) -> list[tuple[Path, int]]:
    budget, todo = _available_memory() // 2, []
    for path, size in files:
        if budget < size:
            break
        todo.append((path, size))
        budget -= size
    return todo


def _prefetch_file(job: tuple[Path, int]) -> None:
    path, size = job
    try:  # O_NONBLOCK: a FIFO planted in a chunk's place must not stall the hint
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # missing or a link: the verified read reports it
    try:
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass  # not a regular file (ESPIPE): likewise
    finally:
        os.close(fd)


def _selected(key: str, only: tuple[str, ...] | None) -> bool:
    return only is None or any(key == p or key.startswith(p + "/") for p in only)


def read_tree(
    root: Path,
    manifest: dict,
    *,
    only: tuple[str, ...] | None = None,
    workers: int = DEFAULT_WORKERS,
) -> TensorDict:
    """Read a committed step into a nested CPU TensorDict, verifying as it goes.

    Args:
        root: the step directory.
        manifest: its parsed ``manifest.json``.
        only: key paths (``"params"``, ``"opt/mu"``) to read; ``None`` reads all.
        workers: I/O threads.

    Raises:
        CorruptCheckpointError: any metadata or chunk fails verification.
    """
    if not isinstance(root, Path):  # an object-store step (ftrain.ckpt.objstore)
        return root.read_tree(manifest, only=only)
    specs = selected_specs(manifest, only)
    check_no_links(root)  # first: nothing is opened, not even for a hint, through a link
    with prefetching(chunk_files(root, specs)):
        check_sizes(root, specs)
        out, tensors = allocate_tree(manifest, specs, only)
        chunks = []
        for k, s in specs.items():
            if s.n_chunks:
                chunks += read_chunks_into(root, s, byte_view(tensors[k]))
        read_jobs(root, chunks, workers)
    return out


def selected_specs(manifest: dict, only: tuple[str, ...] | None) -> dict[str, ArraySpec]:
    """The validated specs of the arrays ``only`` selects (``None``: all)."""
    return {k: s for k, s in specs_of(manifest).items() if _selected(k, only)}


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor (the destination of chunk reads)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def allocate_tree(
    manifest: dict, specs: dict[str, ArraySpec], only: tuple[str, ...] | None
) -> tuple[TensorDict, dict[str, torch.Tensor]]:
    """The result tree of a restore, with empty destination tensors (sizes already
    checked), and ``{key: tensor}`` to read the chunks into."""
    out = TensorDict({}, batch_size=[])
    for g in manifest["groups"]:
        if g and (_selected(g, only) or any(p.startswith(g + "/") for p in only or ())):
            out[tuple(g.split("/"))] = TensorDict({}, batch_size=[])
    tensors = {}
    for k, s in specs.items():
        tensors[k] = out[tuple(k.split("/"))] = _empty(s.shape, parse_dtype(s.dtype))
    return out, tensors


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A destination tensor. (Huge-page mappings per tensor were measured slower here:
    1.18 s vs 0.73 s for the GPT-2 state, THP defrag=madvise; see docs/benchmarks.md.)"""
    return torch.empty(shape, dtype=dtype)


def read_jobs(root: Path, chunks: list, workers: int) -> None:
    """Large chunks on ``workers`` threads, largest first; side by side, the small chunks on
    half as many (the same split as the writer: the ~450 small reads would otherwise form a
    phase of their own). Restore trusts the manifest for shapes, dtypes and checksums, so it
    does not read the arrays' ``zarr.json`` documents (``verify`` checks them)."""
    big = sorted(
        (j for j in chunks if len(j[1]) + j[2] >= DIRECT_MIN_BYTES), key=lambda j: -len(j[1])
    )
    rest = [j for j in chunks if len(j[1]) + j[2] < DIRECT_MIN_BYTES]
    run_pools([(read_chunk, big, workers), (read_chunk, rest, max(1, workers // 2))])


def verify_tree(root: Path, manifest: dict, *, workers: int = DEFAULT_WORKERS) -> int:
    """Verify every document and chunk of a step without keeping the data; returns the
    payload bytes.

    Raises:
        CorruptCheckpointError: any metadata or chunk fails verification.
    """
    if not isinstance(root, Path):  # an object-store step (ftrain.ckpt.objstore)
        return root.verify_tree(manifest)
    specs = specs_of(manifest)
    check_no_links(root)
    docs = {}
    for g in manifest["groups"]:
        rel = f"{g}/zarr.json" if g else "zarr.json"
        docs[g] = read_json(root.joinpath(*rel.split("/")), checksum=doc_checksum(manifest, rel))
    arrays = run_parallel(lambda s: _check_array_meta(root, s, manifest), specs.values(), workers)
    docs |= dict(zip(specs, arrays, strict=True))
    check_consolidated(root / "zarr.json", docs)
    for s in specs.values():  # one array's buffer at a time: verifying needs little memory
        if s.n_chunks:
            check_sizes(root, {s.key: s})
            run_parallel(
                read_chunk, read_chunks_into(root, s, memoryview(bytearray(s.nbytes))), workers
            )
    return sum(s.nbytes for s in specs.values())
