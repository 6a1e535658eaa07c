"""``checkpoints.json``: a cache of per-step facts, rebuilt from the steps themselves.

The index lists every committed step (in the primary and the fallback directory) with
its time, metrics, bytes, save timings and "best" flags. It is a cache, never the source
of truth: an entry is read again from its step's ``COMMITTED`` marker and root
``zarr.json`` whenever the index is missing or unreadable, or the entry names another path
or another copy of the step (its ``seal``, the marker's manifest crc32c: a step redone at
the same path, with the run killed before the index was rewritten, must not keep the old
copy's metrics, which retention's ``BestN`` judges by).
It is replaced atomically (write a temp file, fsync, rename).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from ftrain import _json
from ftrain.ckpt.commit import read_committed
from ftrain.ckpt.format import CheckpointReadError, CorruptCheckpointError, read_bytes_nofollow
from ftrain.ckpt.meta import read_root_attributes
from ftrain.ckpt.policies import BestN, StepInfo, finite_number

__all__ = ["INDEX", "entry_for", "load_or_rebuild", "mark_best", "reuse_or_read", "write_index"]

INDEX = "checkpoints.json"
INDEX_VERSION = 1


def entry_for(step: int, path: Path, *, save_seconds: float | None = None) -> dict:
    """The index entry of one committed step, read from its marker and root attributes.

    Raises:
        CorruptCheckpointError: the step's metadata cannot be read.
    """
    marker, manifest = read_committed(path)
    attrs = read_root_attributes(path, manifest)
    try:
        return {
            "step": step,
            "path": str(path),
            "time": float(attrs.get("time", marker.get("time", 0.0))),
            "metrics": attrs.get("metrics", {}),
            "bytes": byte_count(marker.get("bytes", 0)),
            "blocking_seconds": marker.get("blocking_seconds"),
            "save_seconds": save_seconds
            if save_seconds is not None
            else marker.get("write_seconds"),
            "best": {},
            # which copy of the step the entry describes: a redone step at the same path
            # (an old index written before a kill) must not lend it the old copy's metrics
            "seal": marker.get("manifest_crc32c"),
        }
    except (TypeError, ValueError, OverflowError) as e:  # a marker field of the wrong type
        raise CorruptCheckpointError(f"{path}: unreadable marker field ({e})") from e


def byte_count(value: object) -> int | None:
    """The marker's byte count, a figure for people under no checksum: ``None`` unless a
    count (``1e400`` there overflowed ``int()`` in every manager's constructor)."""
    return value if type(value) is int and value >= 0 else None


def load_or_rebuild(
    index_path: Path, steps: dict[int, Path], seals: dict[str, object] | None = None
) -> dict[int, dict]:
    """Entries for ``steps`` (``{step: committed path}``): each from the index where it
    describes that path (and, given ``seals`` — ``{path: marker's manifest crc32c}`` —
    that very copy of the step), else read from the step (unreadable steps left out)."""
    try:  # locally never through a link nor blocking on a FIFO in its place
        raw = read_bytes_nofollow(index_path) if isinstance(index_path, Path) else None
        doc = _json.loads(raw if raw is not None else index_path.read_bytes())
        current = doc.get("version") == INDEX_VERSION
        cached = {int(e["step"]): e for e in doc["entries"]} if current else {}
    except (OSError, ValueError, KeyError, TypeError, OverflowError, CorruptCheckpointError):
        cached = {}
    return reuse_or_read(cached, steps, seals)


def _well_formed(entry: object) -> bool:
    """An entry retention can rank (a hand-edited index's entry without a numeric
    ``time`` or with ``metrics`` not an object failed every later save): else re-read."""
    return (
        isinstance(entry, dict)
        and finite_number(entry.get("time")) is not None
        and isinstance(entry.get("metrics"), dict)
        and isinstance(entry.get("best", {}), dict)
    )


def reuse_or_read(
    cached: dict[int, dict],
    steps: dict[int, Path],
    seals: dict[str, object] | None,
    on_unreadable: Callable[[int, Path, Exception], None] | None = None,
) -> dict[int, dict]:
    """:func:`load_or_rebuild` on entries already in memory; ``on_unreadable(step, path,
    error)`` hears of each step left out."""
    out = {}
    for step, path in steps.items():
        e = cached.get(step)
        same_path = _well_formed(e) and e.get("path") == str(path)
        if same_path and (seals is None or e.get("seal") == seals.get(str(path))):
            out[step] = e
            continue
        try:
            out[step] = entry_for(step, path)
        except (CorruptCheckpointError, CheckpointReadError) as err:  # kept, not judged
            if on_unreadable is not None:
                on_unreadable(step, path, err)
    return out


def mark_best(entries: dict[int, dict], best: list[BestN]) -> None:
    """Set ``entry["best"][metric] = True`` on the top-n steps of each ``BestN``."""
    infos = [StepInfo(s, e["time"], e.get("metrics") or {}) for s, e in entries.items()]
    for e in entries.values():
        e["best"] = {}
    for b in best:
        for s in b.ranked(infos)[: b.n]:
            entries[s]["best"][b.metric] = True


def write_index(index_path: Path, entries: dict[int, dict]) -> None:
    """Atomically replace the index. Raises ``OSError`` (callers treat it as non-fatal)."""
    doc = {"version": INDEX_VERSION, "entries": [entries[s] for s in sorted(entries)]}
    if not isinstance(index_path, Path):  # an object (ftrain.ckpt.objstore): one atomic put
        index_path.write_bytes(json.dumps(doc, indent=1).encode())
        return
    # the writer's pid in the name lets a later start sweep what a killed writer left
    tmp = index_path.with_name(f".{INDEX}.{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, index_path)
    finally:
        tmp.unlink(missing_ok=True)
