"""Read part of another run's checkpoint without touching its directory.

``CheckpointManager`` owns a directory: it sweeps dead writers' staging, maintains the
index, retains and sets steps aside. Starting a fine-tune from a base run (``init.from``)
or exporting must not do any of that to someone else's run, which may still be training,
so this reader only lists committed steps and reads (and verifies) the selected arrays.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from tensordict import TensorDictBase

from ftrain.ckpt import commit as protocol
from ftrain.ckpt.format import CorruptCheckpointError
from ftrain.ckpt.location import parse_location
from ftrain.ckpt.meta import read_root_attributes
from ftrain.ckpt.reader import read_tree, specs_of
from ftrain.ckpt.target import check_only

__all__ = ["committed_steps_at", "read_model", "read_subtree"]

log = logging.getLogger("ftrain.ckpt")


def committed_steps_at(location: str | Path, storage: Mapping | None = None) -> dict[int, object]:
    """``{step: path}`` of the committed steps at a checkpoint location (read-only);
    ``storage``: object-store options (:func:`ftrain.ckpt.location.parse_location`)."""
    root = parse_location(location, storage)
    if isinstance(root, Path) and not root.is_dir():
        raise FileNotFoundError(f"{root}: no such checkpoint directory")
    return protocol.committed_steps(root)


def read_subtree(
    location: str | Path,
    step: int | None = None,
    only: tuple[str, ...] = ("params",),
    storage: Mapping | None = None,
) -> tuple[int, TensorDictBase, dict]:
    """Read the subtrees ``only`` of ``step`` (default: the newest step that verifies).

    Args:
        location: a checkpoints directory or object-store URL.
        step: the step to read; an explicit step that does not verify is an error.
        only: key paths to read, e.g. ``("params",)``.
        storage: object-store options for a URL ``location`` (endpoint, credentials...).

    Returns:
        ``(step, tree, root attributes)``; the tree holds CPU tensors, verified.

    Raises:
        FileNotFoundError: no such directory, no committed step, or not ``step``.
        CorruptCheckpointError: the explicit ``step``, or every step, fails verification.
        ValueError: ``only`` names nothing in the checkpoint.
    """
    steps = committed_steps_at(location, storage)
    if not steps:
        raise FileNotFoundError(f"{location}: no committed checkpoints")
    if step is not None and step not in steps:
        raise FileNotFoundError(
            f"step {step} is not committed in {location}; available: {sorted(steps)}"
        )
    for _ in range(_RELISTS):
        try:
            return _read_first(location, steps, step, only)
        except _DeletedMeanwhile as gone:  # a live run's retention: list again
            steps = committed_steps_at(location, storage)
            if step is not None or not steps:
                raise FileNotFoundError(
                    f"step {gone.step} of {location} was deleted while being read (a live "
                    f"run's retention); available now: {sorted(steps)}"
                ) from None
    return _read_first(location, steps, step, only)


_RELISTS = 5  # a run deleting the newest step on every listing is not reading's to outrun


class _DeletedMeanwhile(Exception):
    def __init__(self, step: int) -> None:
        self.step = step


def _read_first(location, steps: dict, step: int | None, only) -> tuple:
    """The first of ``step`` (or every step, newest first) that verifies; a step that
    vanished after the listing is :class:`_DeletedMeanwhile`, not corruption."""
    problems = []
    for s in [step] if step is not None else sorted(steps, reverse=True):
        try:
            _, manifest = protocol.read_committed(steps[s])
            specs_of(manifest)
            attrs = read_root_attributes(steps[s], manifest)
            check_only(manifest, only)
            return s, read_tree(steps[s], manifest, only=only), attrs
        except CorruptCheckpointError as e:
            if _vanished(steps[s]):
                raise _DeletedMeanwhile(s) from None
            problems.append(f"step {s}: {e}")
            log.warning("[step=%d] %s is corrupt (%s)", s, steps[s], e)
    raise CorruptCheckpointError(f"{location}: no step verifies: " + "; ".join(problems))


def _vanished(path) -> bool:
    """The step's marker is gone (deleted or set aside since the listing)."""
    if isinstance(path, Path):
        return not (path / protocol.MARKER).exists()
    return False  # an object store: a deleted step reads as missing objects, reported


def read_model(
    location: str | Path, step: int | None = None, storage: Mapping | None = None
) -> tuple[int, TensorDictBase, dict]:
    """:func:`read_subtree` of ``params`` and ``buffers`` (a BatchNorm's statistics are
    part of a trained model), or of ``params`` alone for a checkpoint without buffers."""
    try:
        return read_subtree(location, step, only=("params", "buffers"), storage=storage)
    except ValueError:  # no buffers group (a state saved through the API as params only)
        return read_subtree(location, step, only=("params",), storage=storage)
