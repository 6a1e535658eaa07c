"""``run.overwrite=true``: move an old run out of the new one's way, never deleting it."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig

from ftrain.ckpt.location import is_object_url, parse_location
from ftrain.ckpt.owner import OWNER
from ftrain.ckpt.writerlock import LOCK_NAME as WRITER_LOCK
from ftrain.cli.errors import ResumeError
from ftrain.cli.places import RUN_FILES, logger_places
from ftrain.runlock import LOCK_NAME

__all__ = ["RUN_RECORDS", "move_run_aside"]


def _claim_stays(moved: Path, directory: Path) -> None:
    """This run's claim record moved out with the old steps goes back: the location stays
    claimed while the new run writes there."""
    if (moved / OWNER).exists():
        directory.mkdir(parents=True, exist_ok=True)
        (moved / OWNER).rename(directory / OWNER)


# What a run writes into run.dir besides checkpoints: moved aside together on overwrite.
RUN_RECORDS = (
    *RUN_FILES,
    "metrics.csv",  # the default places of the logger group's files (ftrain/conf/logger)
    "tensorboard",
    "wandb",
)


def move_run_aside(cfg: DictConfig) -> Path | None:
    """run.overwrite=true: move the old run out of this run's way, records and checkpoints
    together, so resume reports, the plot and the advisor never mix two runs. Never deletes.

    Everything goes into ``RUN_DIR/overwritten-<time>/`` (``metrics.jsonl``, heartbeats,
    ``training.png``, hang dumps, the loggers' ``metrics.csv``, ``tensorboard/``, ``wandb/``,
    and ``checkpoint.dir`` when it lies inside ``run.dir``); a checkpoint or fallback
    directory elsewhere keeps its place, its entries go into ``DIR/overwritten-<time>/``.
    The locks stay. Returns the folder, or None if nothing was there.
    """
    run_dir = Path(cfg.run.dir)
    places = _local_checkpoint_dirs(cfg, run_dir)  # refusals first: nothing moved yet
    asides = _Asides(_stamp())
    with _interrupt_after_the_move():
        try:
            moved = _move_run(cfg, run_dir, places, asides)
        except OSError as e:
            to = f" to {e.filename2}" if e.filename2 else ""
            raise ResumeError(
                f"run.overwrite=true could not move {e.filename}{to}: {e.strerror}; nothing "
                f"was deleted (moved so far: {asides.names()}); fix that and run the same "
                "command again: it moves the rest into the same folders"
            ) from e
        asides.finish(_local_dirs(cfg, run_dir))
    return asides.of(run_dir) if moved else None


def _local_dirs(cfg: DictConfig, run_dir: Path) -> list[Path]:
    """run.dir and the local checkpoint and fallback directories, empty ones included."""
    named = (cfg.checkpoint.dir, cfg.checkpoint.fallback_dir)
    return [run_dir, *(Path(d) for d in named if d and not is_object_url(str(d)))]


@contextmanager
def _interrupt_after_the_move():
    """Ctrl-C waits for the move (renames: milliseconds), then interrupts as usual. Mid-way
    it split the old run: the records in one ``overwritten-<time>`` folder, and the
    restart's overwrite moved the steps into another."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread; the CLI moves on it
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
    if caught:
        raise KeyboardInterrupt


def _move_run(cfg: DictConfig, run_dir: Path, places: list[Path], asides: _Asides) -> bool:
    moved = False
    for pattern in RUN_RECORDS:
        for path in sorted(run_dir.glob(pattern)):
            moved |= _move_into(path, asides.of(run_dir) / path.name)
    here = run_dir.resolve()
    moved |= _move_logger_places(cfg, run_dir, asides, places)
    for d in places:
        if not d.is_dir():
            continue  # inside a place moved before it (a fallback under checkpoint.dir)
        there = d.resolve()
        if there == here:  # checkpoints in run.dir itself: its entries go, the lock stays
            moved |= _move_entries(run_dir, asides.of(run_dir))
        elif there.is_relative_to(here):
            inside = asides.of(run_dir) / there.relative_to(here)
            moved |= _move_into(d, inside)
            _claim_stays(inside, d)
        elif _move_entries(d, asides.of(d)):
            print(f"run.overwrite=true: moved the old steps in {d} to {asides.of(d)}")
    return moved


UNFINISHED = ".unfinished"  # in an overwritten-<time> folder while the move fills it


class _Asides:
    """The ``overwritten-<time>`` folder of each directory the move takes entries from
    (``run.dir``; a checkpoint or fallback directory outside it keeps its place, a mount
    point too, and its entries move into ``DIR/overwritten-<time>/``: renaming it beside
    itself failed on a mount point with ``EBUSY``, after the records had moved). Made on
    first use and marked unfinished until the whole move is done; a move cut short (a
    rename refused, a kill) left its folders marked, and the rerun fills those, so the
    old run is never split between two folders."""

    def __init__(self, stamp: str) -> None:
        self.stamp, self.made = stamp, {}

    def of(self, directory: Path) -> Path:
        key = directory.resolve()
        if key not in self.made:
            folder = _unfinished(directory) or _free(directory / f"overwritten-{self.stamp}")
            folder.mkdir(parents=True, exist_ok=True)
            (folder / UNFINISHED).touch()
            self.made[key] = folder
        return self.made[key]

    def names(self) -> str:
        return ", ".join(map(str, self.made.values())) or "nothing"

    def finish(self, places: list[Path]) -> None:
        """The move is whole: no folder is unfinished, in ``places`` either (one a move cut
        short filled completely: left marked, a later overwrite of another run would have
        filled it with that run's entries, two runs in one folder)."""
        for folder in self.made.values():
            (folder / UNFINISHED).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                folder.rmdir()  # nothing was moved into it
        for place in places:
            for marker in place.glob(f"overwritten-*/{UNFINISHED}"):
                marker.unlink(missing_ok=True)


def _unfinished(directory: Path) -> Path | None:
    marked = [p for p in directory.glob("overwritten-*") if (p / UNFINISHED).exists()]
    return max(marked, key=lambda p: p.stat().st_mtime_ns, default=None)


# a logger entry's keys that name where it writes (ftrain/conf/logger: csv.path,
# tensorboard.log_dir, wandb.dir)
def _move_logger_places(cfg: DictConfig, run_dir: Path, asides: _Asides, ckpts: list[Path]) -> bool:
    """The loggers' files at places of the user's (``logger.csv.path=/data/m.csv``): into
    ``aside`` when inside run.dir, else renamed beside themselves. Left in place, the new
    run's CSV appended to the old run's rows, whose later steps then counted as the new
    run's. A place that holds run.dir (``wandb.dir=${run.dir}``) or a checkpoint directory
    ``ckpts`` is not moved: those move as such, with this run's claim kept in place."""
    here, moved = run_dir.resolve(), False
    holds = [here, *(d.resolve() for d in ckpts)]
    for key, place in logger_places(cfg).items():
        path = Path(place)
        if is_object_url(place) or not path.exists():
            continue
        there = path.resolve()
        if any(inner.is_relative_to(there) for inner in holds):
            continue  # run.dir, a checkpoint dir or above one: moved as such
        if _is_wandb_dir(cfg, key) and not there.is_relative_to(here):
            # wandb's dir elsewhere: its offline-run-*-ID folders are per W&B run and the
            # id lives in run.dir, so nothing mixes; it may be shared with other runs,
            # whose folders a rename took along
            continue
        if there.is_relative_to(here):
            moved |= _move_into(path, asides.of(run_dir) / there.relative_to(here))
        else:
            target = _free(path.with_name(f"{path.name}.overwritten-{_stamp()}"))
            path.rename(target)
            print(f"run.overwrite=true: moved {key}={path} to {target}")
    return moved


def _is_wandb_dir(cfg: DictConfig, key: str) -> bool:
    """``logger.NAME.dir`` of ftrain's W&B logger (not a logger of the user's own)."""
    _, name, field = key.split(".", 2)
    target = str(cfg.logger[name].get("_target_", ""))
    return field == "dir" and target == "ftrain.metrics.loggers.WandbLogger"


def _local_checkpoint_dirs(cfg: DictConfig, run_dir: Path) -> list[Path]:
    """The non-empty local checkpoint and fallback directories to move aside, after the
    checks that refuse an overwrite (before anything is moved): an object store holding
    steps (no rename there), a directory that contains run.dir (it would take the run's
    directory and lock along)."""
    out = []
    for d in filter(None, (cfg.checkpoint.dir, cfg.checkpoint.fallback_dir)):
        if is_object_url(d):
            if parse_location(d, cfg.checkpoint.storage).committed_steps():
                raise ResumeError(
                    f"run.overwrite=true: {d} holds committed steps and an object store cannot "
                    f"move them aside; point checkpoint.dir at a new prefix (e.g. {d}-2) or "
                    "delete them first"
                )
            continue
        d = Path(d)
        if not (d.is_dir() and any(_is_old_entry(p) for p in d.iterdir())):
            continue
        here, there = run_dir.resolve(), d.resolve()
        if there != here and here.is_relative_to(there):
            raise ResumeError(
                f"run.overwrite=true: checkpoint directory {d} contains run.dir={run_dir}; "
                "moving it aside would move this run's directory and its lock with it. Keep "
                "checkpoints inside run.dir (the default) or beside it, or move the old run "
                "away by hand"
            )
        out.append(d)
    return out


def _move_entries(run_dir: Path, aside: Path) -> bool:
    """Everything in ``run_dir`` into ``aside``, except the locks (held by this start, or
    waited on: a second trainer must still find them), this run's claim and earlier
    overwrites' folders."""
    entries = [p for p in sorted(run_dir.iterdir()) if _is_old_entry(p)]
    for path in entries:
        _move_into(path, aside / path.name)
    return bool(entries)


# the locks, this run's claim, and a volume's own lost+found (root's, 0700: a rename
# of it by another user failed, after the records had moved)
_STAYS = (LOCK_NAME, OWNER, WRITER_LOCK, "lost+found")


def _is_old_entry(path: Path) -> bool:
    """An entry of the old run's to move aside: not a lock, this run's claim, or an earlier
    overwrite's folder."""
    return path.name not in _STAYS and not path.name.startswith("overwritten-")


def _move_into(path: Path, target: Path) -> bool:
    """Rename ``path`` to ``target``, or beside it when taken (a rerun filling the folder of
    a move cut short: rename() would replace a file there without a word)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    path.rename(_free(target))
    return True


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _free(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``... if it exists (two overwrites in one second)."""
    n, candidate = 2, path
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}-{n}"), n + 1
    return candidate
