"""The journal of a history being moved aside: ``DIR/.setting-aside.json``.

Why. After a resume that went back (``resume=50`` on a run that reached 60), the first
save moves the old history's later steps aside, one rename per step. A rename is atomic,
several are not: a kill between them left some of the old history listed (50 and the
old 60, a hole at 55), and the next plain restart resumed the abandoned step 60 and
reported the run done, the training from 50 gone without a word.

What. Before moving two or more steps, the manager writes, in every location involved,
the names of its steps being moved with each one's seal (its marker's
``manifest_crc32c``), written whole, then renamed into place and fsync'd; the listing
(:func:`ftrain.ckpt.commit.committed_steps`) skips a step named there *whose seal still
matches*, so from that moment the abandoned steps are out of every listing, restore and
retention, kill or not, while a step the new history commits under one of those names
(another seal) is listed even if the journal outlives its moves (a removal that failed).
The manager removes the journal once every move is done, and the next save finishes a
journal a kill left (:func:`pending`, then ``set_aside``). On an object store
the journal is the object ``PREFIX/.setting-aside.json`` (one put is atomic; a step's
set-aside there is a copy and a delete per object, so the window is wider than a rename's).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from ftrain.ckpt.format import CorruptCheckpointError, read_bytes_nofollow
from ftrain.ckpt.store import fsync_dir

__all__ = ["JOURNAL", "done", "leaving", "pending", "write"]

JOURNAL = ".setting-aside.json"


def write(root, sealed: dict[str, object]) -> None:
    """Record (durably) that the step directories named in ``sealed`` (name -> seal) of
    ``root`` (a directory or an ``ObjectRoot``) are being moved aside."""
    data = json.dumps({"steps": dict(sorted(sealed.items()))}).encode()
    if not isinstance(root, Path):
        root.put(JOURNAL, data)
        return
    tmp = root / f"{JOURNAL}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, root / JOURNAL)
    fsync_dir(root)


def pending(root) -> dict[str, object]:
    """``{step directory name: seal}`` of the journal in ``root`` (none: empty).

    A journal that is not one ftrain wrote (damaged) names nothing: the steps are listed
    as they would be without it.

    Raises:
        CheckpointReadError: a machine limit (EMFILE, ...) while reading it: the listing
            cannot tell which steps count.
        CheckpointStoreError: an object store failing.
    """
    if not isinstance(root, Path):
        raw = root.get(JOURNAL)
        return {} if raw is None else _names(raw)
    try:  # never through a link, never blocking on a FIFO, bounded: a FIFO in its place
        # hung every listing (so every start), a link to /dev/zero read until memory ran out
        raw = read_bytes_nofollow(root / JOURNAL)
    except CorruptCheckpointError:  # missing or not a file ftrain wrote: names nothing
        return {}
    return _names(raw)  # a limit of the machine or a permission is raised: nothing judged


def _names(raw: bytes) -> dict[str, object]:
    try:
        steps = json.loads(raw)["steps"]
    except (ValueError, TypeError, KeyError):
        return {}
    if not isinstance(steps, dict):
        return {}
    return {n: seal for n, seal in steps.items() if isinstance(n, str)}


def leaving(journal: dict[str, object], name: str, marker: dict) -> bool:
    """Whether the step directory ``name``, whose marker is ``marker``, is one the journal
    names for moving aside: the name *and* the seal (a step committed since under that
    name is another)."""
    return name in journal and journal[name] == marker.get("manifest_crc32c")


def done(root) -> None:
    """Every step the journal names is moved aside: remove it."""
    if not isinstance(root, Path):
        root.delete([JOURNAL])
        return
    (root / JOURNAL).unlink(missing_ok=True)
    fsync_dir(root)
