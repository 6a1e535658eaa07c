"""Where a run writes, and the logger places that would overwrite the run's own files.

A logger's file or directory is the user's to choose (``logger.csv.path=/data/m.csv``),
but never at a place ftrain itself writes: a CSV logger at ``${run.dir}/metrics.jsonl``
or inside ``checkpoint.dir`` would have its header check set the run's records or steps
aside, and the run could not restart. Checked at start, before anything is written.
"""

from __future__ import annotations

import fnmatch
import os

from omegaconf import DictConfig

from ftrain.ckpt.location import is_object_url
from ftrain.ckpt.owner import OWNER
from ftrain.config import ConfigError
from ftrain.runlock import LOCK_NAME

__all__ = ["LOGGER_PLACES", "RUN_FILES", "check_logger_places", "logger_places"]

# The keys of a logger entry that name where it writes.
LOGGER_PLACES = ("path", "log_dir", "dir")

# What ftrain itself writes into run.dir (patterns): no logger file may take one of them.
RUN_FILES = ("metrics.jsonl", "heartbeat*.json", "heartbeat*.json.tmp", "training.png", "hang-*")


def logger_places(cfg: DictConfig) -> dict[str, str]:
    """Where each configured logger writes: ``{"logger.csv.path": "...", ...}``."""
    out = {}
    for name, entry in (cfg.get("logger") or {}).items():
        if isinstance(entry, DictConfig):
            out |= {f"logger.{name}.{k}": str(v) for k in LOGGER_PLACES if (v := entry.get(k))}
    return out


def check_logger_places(cfg: DictConfig) -> None:
    """Refuse a logger place that is one of the run's own: a checkpoint or fallback
    directory or a place inside one, run.dir itself or a record ftrain writes there
    (``metrics.jsonl``, heartbeats, the lock) for a logger's file, a directory above
    run.dir or a checkpoint directory for a logger's file, or one place for two loggers.

    Raises:
        ConfigError: naming the key, its value, what it collides with and the fix.
    """
    run_dir = os.path.abspath(cfg.run.dir)
    ckpts = {
        key: os.path.abspath(d)
        for key in ("checkpoint.dir", "checkpoint.fallback_dir")
        if (d := cfg.checkpoint.get(key.split(".")[1])) and not is_object_url(str(d))
    }
    taken: dict[str, str] = {}
    for key, place in logger_places(cfg).items():
        if is_object_url(place):
            continue
        path = os.path.abspath(place)
        clash = _clash(key, path, run_dir, ckpts) or taken.get(path)
        if clash:
            raise ConfigError(
                f"{key}={place} would write into {clash}: ftrain would overwrite or set aside "
                f"the run's own files there. Leave {key} at its default or point it at a "
                f"place of its own ({key}='${{run.dir}}/...' with a new name)"
            )
        taken[path] = f"{key}={place}"


def _clash(key: str, path: str, run_dir: str, ckpts: dict[str, str]) -> str | None:
    """What ``path`` (logger place ``key``) collides with, or None."""
    for ckpt_key, ckpt in ckpts.items():
        if _within(path, ckpt):
            return f"{ckpt_key}={ckpt}"
    if not key.endswith(".path"):  # a logger's directory (wandb.dir=${run.dir}) may hold them
        return None
    for dir_key, directory in [("run.dir", run_dir), *ckpts.items()]:
        if _within(directory, path):
            return f"{dir_key}={directory}"
    if os.path.dirname(path) == run_dir and _is_run_file(os.path.basename(path)):
        return f"run.dir's {os.path.basename(path)}"
    return None


def _is_run_file(name: str) -> bool:
    return name in (LOCK_NAME, OWNER) or any(fnmatch.fnmatch(name, p) for p in RUN_FILES)


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)
