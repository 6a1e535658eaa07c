"""``checkpoints.json``: a cache of per-step facts, rebuilt from the steps themselves.

The index lists every committed step (in the primary and the fallback directory) with
its time, metrics, bytes, save timings and "best" flags. It is a cache, never the source
of truth: it is rebuilt from each step's ``COMMITTED`` marker and root ``zarr.json``
whenever it is missing, unreadable or lists a different set of steps than the disk.
It is replaced atomically (write a temp file, fsync, rename).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from ftrain.ckpt.commit import read_committed
from ftrain.ckpt.format import CorruptCheckpointError
from ftrain.ckpt.meta import read_root_attributes
from ftrain.ckpt.policies import BestN, StepInfo

__all__ = ["INDEX", "entry_for", "load_or_rebuild", "mark_best", "write_index"]

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
            "bytes": int(marker.get("bytes", 0)),
            "blocking_seconds": marker.get("blocking_seconds"),
            "save_seconds": save_seconds
            if save_seconds is not None
            else marker.get("write_seconds"),
            "best": {},
        }
    except (TypeError, ValueError) as e:  # a marker field of the wrong type
        raise CorruptCheckpointError(f"{path}: unreadable marker field ({e})") from e


def load_or_rebuild(index_path: Path, steps: dict[int, Path]) -> dict[int, dict]:
    """Entries for ``steps`` (``{step: committed path}``): from the index if it is current,
    else rebuilt from the steps (unreadable steps are left out)."""
    try:
        doc = json.loads(index_path.read_bytes())
        entries = {int(e["step"]): e for e in doc["entries"]}
        if doc.get("version") == INDEX_VERSION and {s: e["path"] for s, e in entries.items()} == {
            s: str(p) for s, p in steps.items()
        }:
            return entries
    except (OSError, ValueError, KeyError, TypeError):
        pass
    out = {}
    for step, path in steps.items():
        try:
            out[step] = entry_for(step, path)
        except CorruptCheckpointError:
            continue
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
