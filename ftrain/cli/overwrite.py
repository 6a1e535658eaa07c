"""``run.overwrite=true``: move an old run out of the new one's way, never deleting it."""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig

from ftrain.ckpt.location import is_object_url, parse_location
from ftrain.ckpt.owner import OWNER
from ftrain.ckpt.writerlock import LOCK_NAME as WRITER_LOCK
from ftrain.cli.errors import ResumeError
from ftrain.cli.places import RUN_FILES, logger_places
from ftrain.runlock import LOCK_NAME

__all__ = ["RUN_RECORDS", "move_aside", "move_run_aside"]


_NOT_STEPS = (OWNER, WRITER_LOCK)  # alone, a directory holds no steps to keep


def move_aside(directory: Path) -> Path | None:
    """Rename a non-empty directory to ``NAME.overwritten-<time>`` beside it (never delete).

    This run's claim on the directory (``.owner.json``, :mod:`ftrain.ckpt.owner`) stays
    with the directory, not with the old run's steps (alone, it is not "non-empty")."""
    if not directory.is_dir() or all(p.name in _NOT_STEPS for p in directory.iterdir()):
        return None
    target = _free(directory.with_name(f"{directory.name}.overwritten-{_stamp()}"))
    directory.rename(target)
    _claim_stays(target, directory)
    return target


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
    directory elsewhere is renamed beside itself to ``NAME.overwritten-<time>``. The run
    lock stays. Returns the folder, or None if nothing was there.
    """
    run_dir = Path(cfg.run.dir)
    places = _local_checkpoint_dirs(cfg, run_dir)  # refusals first: nothing moved yet
    aside = _free(run_dir / f"overwritten-{_stamp()}")
    moved = False
    for pattern in RUN_RECORDS:
        for path in sorted(run_dir.glob(pattern)):
            moved |= _move_into(path, aside / path.name)
    here = run_dir.resolve()
    moved |= _move_logger_places(cfg, run_dir, aside, places)
    for d in places:
        there = d.resolve()
        if there == here:  # checkpoints in run.dir itself: its entries go, the lock stays
            moved |= _move_entries(run_dir, aside)
        elif there.is_relative_to(here):
            moved |= _move_into(d, aside / there.relative_to(here))
            _claim_stays(aside / there.relative_to(here), d)
        else:
            print(f"run.overwrite=true: moved {d} to {move_aside(d)}")
    return aside if moved else None


# a logger entry's keys that name where it writes (ftrain/conf/logger: csv.path,
# tensorboard.log_dir, wandb.dir)
def _move_logger_places(cfg: DictConfig, run_dir: Path, aside: Path, ckpts: list[Path]) -> bool:
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
            moved |= _move_into(path, aside / there.relative_to(here))
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
        if not (d.is_dir() and any(p.name != OWNER for p in d.iterdir())):
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
    """Everything in ``run_dir`` into ``aside``, except the run lock (held by this start:
    a second trainer must still find it), this run's claim and earlier overwrites' folders."""
    keep = {LOCK_NAME, OWNER, aside.name}  # the lock and this run's claim stay
    entries = [
        p
        for p in sorted(run_dir.iterdir())
        if p.name not in keep and not p.name.startswith("overwritten-")
    ]
    for path in entries:
        _move_into(path, aside / path.name)
    return bool(entries)


def _move_into(path: Path, target: Path) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    path.rename(target)
    return True


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _free(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``... if it exists (two overwrites in one second)."""
    n, candidate = 2, path
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}-{n}"), n + 1
    return candidate
