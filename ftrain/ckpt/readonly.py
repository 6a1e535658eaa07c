"""Read part of another run's checkpoint without touching its directory.

``CheckpointManager`` owns a directory: it sweeps dead writers' staging, maintains the
index, retains and sets steps aside. Starting a fine-tune from a base run (``init.from``)
or exporting must not do any of that to someone else's run, which may still be training,
so this reader only lists committed steps and reads (and verifies) the selected arrays.
"""

from __future__ import annotations

import glob
import logging
import re
from collections.abc import Mapping
from pathlib import Path

from tensordict import TensorDictBase

from ftrain.ckpt import commit as protocol
from ftrain.ckpt.format import CorruptCheckpointError
from ftrain.ckpt.location import parse_location
from ftrain.ckpt.meta import read_root_attributes
from ftrain.ckpt.reader import read_tree, specs_of
from ftrain.ckpt.target import check_only

__all__ = [
    "committed_steps_at",
    "locations_of",
    "read_model",
    "read_subtree",
    "run_locations",
    "saved_elsewhere",
    "split_step",
]

log = logging.getLogger("ftrain.ckpt")


Locations = str | Path | list  # one checkpoint location, or a run's primary and fallback


def missing_directory(root: Path) -> str:
    """Why ``root`` is no checkpoint directory: absent, or something else of that name."""
    if root.exists() or root.is_symlink():
        what = "a file" if root.is_file() else "a dangling link or a special file"
        return f"{root} is {what}, not a checkpoint directory: give a run directory or its checkpoints/"
    return f"{root}: no such checkpoint directory"


def committed_steps_at(
    location: Locations, storage: Mapping | None = None, invalid: list | None = None
) -> dict[int, object]:
    """``{step: path}`` of the committed steps at a checkpoint location (read-only), or
    over a list of them (a run's primary and fallback, as :func:`run_locations` gives:
    a step held in both is the copy saved last, as the manager reads it); ``storage``:
    object-store options (:func:`ftrain.ckpt.location.parse_location`); ``invalid``
    collects the reasons (naming each) of the step directories that do not count."""
    from ftrain.ckpt.manager import _newest_copy_first

    locations = location if isinstance(location, list) else [location]
    found: dict[int, list] = {}
    for i, where in enumerate(locations):
        root = parse_location(where, storage)
        if isinstance(root, Path) and not root.is_dir():
            if i == 0 and _colon_hint(root):
                raise StepSpecError(f"{root}: no such checkpoint directory{_colon_hint(root)}")
            if i == 0:
                raise FileNotFoundError(missing_directory(root))
            continue  # a fallback the run never had to write to
        if not isinstance(root, Path):
            root.probe()  # an endpoint that does not answer: said in seconds, not minutes
        why = (
            None
            if invalid is None
            else (lambda p, r: invalid.append(r if p.name in r else f"{p.name}: {r}"))
        )
        for step, path in protocol.committed_steps(root, on_invalid=why).items():
            found.setdefault(step, []).append(path)
    return {
        s: _newest_copy_first(ps)[0] if len(ps) > 1 else ps[0] for s, ps in sorted(found.items())
    }


def run_locations(run_dir: Path) -> list[str]:
    """A run directory's checkpoint locations that exist: its ``checkpoints/`` (or the
    directory itself when the steps are there), and the ``checkpoint.fallback_dir`` the
    run used, from its start records or its newest step's config, when that is an
    absolute path (a relative one was relative to wherever the run was started; the
    primary's recorded path is never taken: after ``mv runs/a runs/a_old`` it names the
    next run's). Reading only ``checkpoints/`` took an older step as the newest when saves
    had gone to the fallback (a full disk)."""
    from ftrain.metrics import read_records

    primary = run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir
    named = [r["checkpoint_dirs"] for r in read_records(run_dir) if r.get("checkpoint_dirs")]
    fallbacks = [*(named[-1][1:] if named else []), _recorded_fallback(primary)]
    out = [str(primary)]
    for d in fallbacks:
        if isinstance(d, str) and (d.startswith("/") or "://" in d):
            there = d if "://" in d else str(Path(d).resolve())
            if ("://" in d or Path(d).is_dir()) and there not in out:
                out.append(there)
    return out


def locations_of(where: str) -> str | list[str]:
    """What the readers read for ``where`` (the ckpt tools, export, eval, init.from): a run
    directory's locations (:func:`run_locations`), else ``where`` itself, alone (a copy
    of a checkpoint directory, or one set aside by ``run.overwrite``, records a fallback
    that may hold another history now). A run directory is one with ``checkpoints/`` or
    whose records name its checkpoint directories: a run that saved to a
    ``checkpoint.dir`` elsewhere and, its disk full, to a fallback inside the run
    directory was read as holding nothing, and the primary it pointed to showed an older
    step as the newest."""
    if "://" in where:
        return where
    run = Path(where)
    if _set_aside(run) is not None:  # its records' fallback may hold the new run's steps
        return str(run / "checkpoints") if (run / "checkpoints").is_dir() else where
    if (run / "checkpoints").is_dir() or _records_locations(run):
        found = run_locations(run)
        return found if len(found) > 1 else found[0]
    return where


def _set_aside(path: Path) -> str | None:
    """The ``overwritten-<time>`` folder name ``path`` lies in (or is), if any."""
    return next((p for p in reversed(path.parts) if p.startswith("overwritten-")), None)


def _records_locations(run_dir: Path) -> bool:
    from ftrain.metrics import read_records

    try:
        return run_dir.is_dir() and any(r.get("checkpoint_dirs") for r in read_records(run_dir))
    except OSError:
        return False


def saved_elsewhere(location: Locations) -> str:
    """A hint for a run directory whose run saved to another ``checkpoint.dir``: its
    records name it (only named, never read from: after ``mv`` it may be another run's)."""
    first = location[0] if isinstance(location, list) else location
    if not isinstance(first, str | Path) or "://" in str(first):
        return ""
    from ftrain.metrics import read_records

    try:
        named = [
            r["checkpoint_dirs"] for r in read_records(Path(first)) if r.get("checkpoint_dirs")
        ]
    except OSError:
        return ""
    where = named[-1][0] if named and isinstance(named[-1], list) and named[-1] else None
    if not isinstance(where, str):
        return ""
    aside = _set_aside(Path(first))
    if aside is not None and "://" not in where and (Path(where) / aside).is_dir():
        # an old run set aside: run.overwrite moved its steps within that directory too
        return (
            f"; this run directory's run saved its checkpoints to {where}, and run.overwrite "
            f"moved them to {Path(where) / aside}: pass that"
        )
    if "://" not in where and (
        not Path(where).is_dir() or Path(where).resolve() == Path(first).resolve()
    ):
        return ""  # the same directory, or one gone since: nothing to point at
    return f"; this run directory's run saved its checkpoints to {where}: pass that"


def moved_aside(location: Locations, *, with_step: bool = True) -> str:
    """A hint for a location whose steps ``run.overwrite=true`` moved aside (into
    ``RUN/overwritten-<time>/`` as ``checkpoints/``, or as the steps themselves when the
    run saved into its own directory, or ``DIR/overwritten-<time>/`` for a directory
    elsewhere; before 2026-12-07 that was renamed ``DIR.overwritten-<time>``): a fine-tune
    with ``init.from`` naming the run it overwrote, killed before its first commit, found no
    base at its restart and did not say where the base went. ``with_step``: advise
    ``DIR:STEP`` (init.from, eval, export), else the directory (list, verify, show)."""
    first = location[0] if isinstance(location, list) else location
    if not isinstance(first, str | Path) or "://" in str(first):
        return ""
    here = Path(first)
    name = glob.escape(here.name)
    copies = [
        *here.parent.glob(f"overwritten-*/{name}"),
        *here.glob("overwritten-*/checkpoints"),
        *here.glob("overwritten-*"),
        *here.parent.glob(f"{name}.overwritten-*"),
    ]
    for copy in sorted(set(copies), key=_mtime, reverse=True):
        try:
            steps = sorted(protocol.committed_steps(copy))
        except OSError:
            continue
        if steps:
            how = f"pass {copy}:{steps[-1]} to read them" if with_step else "give that directory"
            listed = ", ".join(map(str, steps))
            return f"; run.overwrite=true moved earlier steps ({listed}) to {copy}: {how}"
    return ""


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _recorded_fallback(checkpoints: Path) -> str | None:
    """``checkpoint.fallback_dir`` as the newest step there records it (None: none)."""
    steps = protocol.committed_steps(checkpoints)
    if not steps:
        return None
    path = steps[max(steps)]
    try:
        attrs = read_root_attributes(path, protocol.read_committed(path)[1])
    except (CorruptCheckpointError, OSError, ValueError):
        return None  # the reader reports that step itself
    config = attrs.get("config")
    fallback = (
        config.get("checkpoint", {}).get("fallback_dir") if isinstance(config, dict) else None
    )
    return fallback if isinstance(fallback, str) else None


_STEP_SUFFIX = re.compile(r"^(?P<where>.+):(?P<step>\d+)$")


def split_step(spec: str) -> tuple[str, int | None]:
    """``WHERE[:STEP]`` -> ``(WHERE, STEP or None)``. A local path that exists as written
    is never split: a sweep over ``init.from=b64:4,b64:6`` names its job directories
    ``...init.from=b64\\:4``, and reading that run took ``:4`` for a step."""
    m = _STEP_SUFFIX.match(spec)
    if m is None or ("://" not in spec and Path(spec).exists()):
        return spec, None
    return m["where"], int(m["step"])


class StepSpecError(FileNotFoundError):
    """``RUN:abc``: a path whose ``:STEP`` is not a step number (a usage error, exit 2)."""


def _colon_hint(root: Path) -> str:
    """``RUN:abc`` (not a step number) for ``RUN:STEP``: say what the colon takes."""
    where, colon, after = str(root).rpartition(":")
    if not colon or not Path(where).exists():
        return ""
    return f" ({where} exists: the part after ':' must be a step number, got {after!r})"


def name_of(location: Locations) -> str:
    """How a location (or a run's list of them) is named in messages."""
    return " + ".join(map(str, location)) if isinstance(location, list) else str(location)


def read_subtree(
    location: Locations,
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
    invalid: list[str] = []
    steps = committed_steps_at(location, storage, invalid)
    if not steps:  # a damaged marker hid the only step: say so, it is not "never saved"
        first = location[0] if isinstance(location, list) else location
        hint = protocol.step_dir_hint(Path(first)) if isinstance(first, str | Path) else None
        invalid = invalid[:3] + ([hint] if hint and "://" not in str(first) else [])
        why = f" ({'; '.join(invalid)})" if invalid else ""
        raise FileNotFoundError(
            f"{name_of(location)}: no committed checkpoints{why}{saved_elsewhere(location)}"
            f"{moved_aside(location)}"
        )
    if step is not None and step not in steps:
        why = "; ".join(_damage_of(invalid, lambda s: s == step))
        raise FileNotFoundError(
            f"step {step} is not committed in {name_of(location)}"
            f"{f' ({why})' if why else ''}; available: {sorted(steps)}"
        )
    if step is None:  # a damaged marker or manifest hid newer steps: read past them, said
        for why in _damage_of(invalid, lambda s: s > max(steps)):
            log.warning("%s: passed over, not committed (%s)", name_of(location), why)
    for _ in range(_RELISTS):
        try:
            return _read_first(location, steps, step, only)
        except _DeletedMeanwhile as gone:  # a live run's retention: list again
            steps = committed_steps_at(location, storage)
            if step is not None or not steps:
                raise FileNotFoundError(
                    f"step {gone.step} of {name_of(location)} was deleted while being read (a live "
                    f"run's retention); available now: {sorted(steps)}"
                ) from None
    raise FileNotFoundError(
        f"{name_of(location)}: the newest step was deleted while being read {_RELISTS} times "
        "(a live run's retention); try again, or name a step it keeps"
    )


def _damage_of(invalid: list[str], which) -> list[str]:
    """The reasons (each naming its ``step_*`` directory) of the step directories that do
    not count whose step number ``which`` takes."""
    numbers = (re.search(r"step_(\d+): ", why) for why in invalid)  # the name, not a parent
    return [why for why, n in zip(invalid, numbers, strict=True) if n and which(int(n[1]))]


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
            if protocol.step_vanished(steps[s]):
                raise _DeletedMeanwhile(s) from None
            problems.append(f"step {s}: {e}")
            log.warning("[step=%d] %s is corrupt (%s)", s, steps[s], e)
    if step is None:
        raise CorruptCheckpointError(
            f"{name_of(location)}: no step verifies: " + "; ".join(problems)
        )
    others = sorted(s for s in steps if s != step)
    raise CorruptCheckpointError(
        f"{name_of(location)}: step {step} does not verify ({problems[0].split(': ', 1)[1]}); "
        + (
            f"the other committed steps ({', '.join(map(str, others))}) were not read: name one, "
            "or leave the step out for the newest that verifies"
            if others
            else "no other step is committed"
        )
    )


def read_model(
    location: Locations, step: int | None = None, storage: Mapping | None = None
) -> tuple[int, TensorDictBase, dict]:
    """:func:`read_subtree` of ``params`` and ``buffers`` (a BatchNorm's statistics are
    part of a trained model), or of ``params`` alone for a checkpoint without buffers."""
    try:
        return read_subtree(location, step, only=("params", "buffers"), storage=storage)
    except ValueError:  # no buffers group (a state saved through the API as params only)
        return read_subtree(location, step, only=("params",), storage=storage)
