"""Start or resume a run: pick the step, restore it, refuse incompatible configs, report.

``resume=latest`` restores the newest committed step that verifies (a corrupt newest one
is reported and skipped); ``resume=none`` starts fresh but refuses a run directory that
already has checkpoints unless ``run.overwrite=true``; ``resume=N`` restores exactly step N.
In a distributed run the coordinator decides the step and broadcasts it; every rank then
restores that step and checks it got it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig
from tensordict import TensorDictBase

from ftrain.ckpt import CheckpointManager, CheckpointNotFoundError, CorruptCheckpointError
from ftrain.config import config_hash, to_plain
from ftrain.dist import World, broadcast_int
from ftrain.metrics import read_records

__all__ = [
    "saved_horizon",
    "ResumeError",
    "ResumeReport",
    "checkpoint_metadata",
    "compat_diff",
    "move_aside",
    "start_state",
]

# Config keys that may change between a checkpoint and its resume: they change how long
# and how visibly the run goes on, not what a step computes.
SAFE_PREFIXES = (
    "trainer.max_steps",
    "trainer.eval_every",
    "trainer.eval_batches",
    "trainer.log_every",
    "trainer.device",
    "trainer.donate",
    "trainer.grad_accum",
    "trainer.on_nonfinite",  # only what happens after a bad step (switch to skip, resume)
    "trainer.hang_timeout_s",
    "checkpoint.",
    "dist.",
    "run.",
    "resume",
    "data.prefetch",
    "data.path",  # where the data lives may change; the fingerprint checks what it is
    "data.cache_dir",
    "data.allow_changed",
    "schedule.decay_steps",
)


class ResumeError(RuntimeError):
    """The requested resume cannot be done as asked (the message says what to do)."""


@dataclass
class ResumeReport:
    """What a start did: fresh or resumed, from where, and what will be redone."""

    resumed: bool
    step: int = 0
    reason: str = "fresh start"
    next_lr: float | None = None
    epoch: int = 0
    position: int = 0
    redo: tuple[int, int] | None = None
    fingerprints: dict = field(default_factory=dict)
    changes: list[str] = field(default_factory=list)
    restore_s: float | None = None
    checkpoint_bytes: int | None = None
    horizon: int | None = None

    def lines(self) -> list[str]:
        if not self.resumed:
            return [f"starting fresh ({self.reason})"]
        out = [
            f"resumed from step {self.step} ({self.reason}) in {self.restore_s or 0:.2f}s",
            f"next step {self.step + 1}: lr={self.next_lr:.6g}, data epoch={self.epoch} position={self.position}",
            f"checkpoint config hash={self.fingerprints.get('config_hash')} data={self.fingerprints.get('data')}",
        ]
        if self.horizon is not None:
            out.append(
                f"lr schedule decays over {self.horizon} steps (as recorded; set schedule.decay_steps to change it)"
            )
        if self.redo:
            out.append(
                f"steps {self.redo[0]}..{self.redo[1]} ran before but were not committed: they will be redone"
            )
        out += [f"accepted change: {c}" for c in self.changes]
        return out


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out |= _flat(v, key + ".") if isinstance(v, dict) else {key: v}
    return out


def compat_diff(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(incompatible, safe) differences between a checkpoint's config and the current one."""
    a, b = _flat(saved), _flat(current)
    bad, safe = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            line = f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}"
            (safe if key.startswith(SAFE_PREFIXES) else bad).append(line)
    return bad, safe


_LATEST = -3  # "the newest step that verifies", resolved by restoring
_FAILED = -2  # the coordinator refused; broadcast so other ranks stop too


def _pick_step(cfg: DictConfig, manager: CheckpointManager) -> int | None:
    """The step to restore: None = fresh, _LATEST, or an exact committed step."""
    steps = manager.all_steps()
    if cfg.resume == "none":
        if steps:
            raise ResumeError(
                f"resume=none but {manager.directory} already holds committed steps {steps}; "
                "resume with resume=latest (the default), pick one with resume=STEP, or start over "
                "with run.overwrite=true (the old checkpoints are moved aside, not deleted)"
            )
        return None
    if cfg.resume == "latest":
        return _LATEST if steps else None
    if cfg.resume not in steps:
        raise ResumeError(
            f"resume={cfg.resume} but step {cfg.resume} is not committed; available steps: {steps or 'none'}"
        )
    return int(cfg.resume)


def _restore_agreed(cfg, manager, fresh, world: World):
    """Coordinator picks and restores; the step is broadcast; the other ranks restore it.

    The config check runs on the candidate's metadata *before* restoring, so a changed
    model shape is reported as a config diff rather than as a shape mismatch.
    """
    state, chosen = None, None
    if world.is_coordinator:
        try:
            chosen = _pick_step(cfg, manager)
            if chosen is not None:
                meta = _candidate_metadata(manager, chosen)
                if meta is not None:
                    _check_compat(cfg, meta)
                state = _restore(manager, None if chosen == _LATEST else chosen, fresh)
                chosen = int(state["step"])
        except BaseException:
            broadcast_int(_FAILED)
            raise
    chosen = broadcast_int(chosen)
    if chosen == _FAILED:
        raise ResumeError(
            "the coordinator (rank 0) refused to resume; its message says why and what to change"
        )
    if state is None and chosen is not None:
        state = _restore(manager, chosen, fresh)
    if state is not None and int(state["step"]) != chosen:
        raise ResumeError(
            f"rank {world.rank} restored step {int(state['step'])} but the coordinator chose {chosen}"
        )
    return state


def _candidate_metadata(manager: CheckpointManager, chosen: int) -> dict | None:
    """The metadata of the step about to be restored, or None if it is unreadable (then the
    restore below reports it and falls back to an older step, which is checked after)."""
    try:
        return manager.metadata(manager.latest_step() if chosen == _LATEST else chosen)
    except (CorruptCheckpointError, OSError, ValueError):
        return None


def _restore(manager: CheckpointManager, step: int | None, fresh: TensorDictBase) -> TensorDictBase:
    try:
        return manager.restore(step, target=fresh)
    except ValueError as err:  # the checkpoint does not fit the configured model/optimizer
        raise ResumeError(
            f"{err}\n  the checkpoint was written for a different model or optimizer; resume with its config "
            "or start a new run (another run.name, or resume=none run.overwrite=true)"
        ) from None


def _restore_host_rng(meta: dict, world: World) -> None:
    """Put back the global Python/NumPy/torch RNG states recorded for this rank, for user code
    that draws from them (ftrain itself only uses the key chain)."""
    from ftrain.ckpt import hostrng

    states = (meta.get("host_rng") or {}).get(str(world.rank))
    if states:
        hostrng.restore(states)


def saved_horizon(cfg: DictConfig, manager: CheckpointManager) -> int | None:
    """The LR-schedule horizon recorded by the checkpoint a resume would start from."""
    if cfg.resume == "none":
        return None
    step = manager.latest_step() if cfg.resume == "latest" else int(cfg.resume)
    if step is None:
        return None
    try:
        return manager.metadata(step).get("schedule_horizon")
    except (CorruptCheckpointError, CheckpointNotFoundError, OSError, ValueError):
        return None


def _redo_range(run_dir: Path, step: int) -> tuple[int, int] | None:
    seen = [
        r["step"]
        for r in read_records(run_dir)
        if r.get("kind") == "step" and isinstance(r.get("step"), int)
    ]
    beyond = [s for s in seen if s > step]
    return (step + 1, max(beyond)) if beyond else None


def _check_compat(cfg: DictConfig, meta: dict) -> list[str]:
    saved = meta.get("config")
    if saved is None:
        return []
    bad, safe = compat_diff(saved, to_plain(cfg))
    if bad and not cfg.run.allow_config_change:
        raise ResumeError(
            f"the config differs from step {meta.get('step')}'s checkpoint in ways that change what a step computes:\n    "
            + "\n    ".join(bad)
            + "\n  resume with the checkpoint's values, start a new run (another run.name or resume=none "
            "run.overwrite=true), or accept the change with run.allow_config_change=true"
        )
    return bad + safe


def start_state(
    cfg: DictConfig,
    manager: CheckpointManager,
    fresh: TensorDictBase,
    world: World,
    tx,
    data_fp: str,
):
    """Restore (or not) per ``cfg.resume``; returns ``(state, report, metadata_of_checkpoint)``."""
    from ftrain.data import check_fingerprint

    t0 = time.perf_counter()
    state = _restore_agreed(cfg, manager, fresh, world)
    restore_s = time.perf_counter() - t0
    if state is None:
        return (
            fresh,
            ResumeReport(
                False, reason="resume=none" if cfg.resume == "none" else "no checkpoint yet"
            ),
            {},
        )
    step = int(state["step"])
    meta = manager.metadata(step)
    _restore_host_rng(meta, world)
    changes = _check_compat(cfg, meta)
    check_fingerprint(meta.get("data_fingerprint"), data_fp, bool(cfg.data.allow_changed))
    if meta.get("data_fingerprint") not in (None, data_fp):
        changes.append(
            f"data fingerprint {meta.get('data_fingerprint')} -> {data_fp} (data.allow_changed=true)"
        )
    report = ResumeReport(
        True,
        step=step,
        reason=f"resume={cfg.resume}",
        next_lr=float(tx.lr(state["opt"])) if tx.lr is not None else float("nan"),
        epoch=int(state["data"]["epoch"]),
        position=int(state["data"]["position"]),
        redo=_redo_range(Path(cfg.run.dir), step),
        fingerprints={"config_hash": meta.get("config_hash"), "data": meta.get("data_fingerprint")},
        changes=changes,
        restore_s=restore_s,
        horizon=meta.get("schedule_horizon"),
        checkpoint_bytes=(meta.get("save") or {}).get("bytes"),
    )
    return state, report, meta


def move_aside(directory: Path) -> Path | None:
    """run.overwrite=true: rename the old run's checkpoints out of this run's way (never delete)."""
    if not directory.exists() or not any(directory.iterdir()):
        return None
    target = directory.with_name(f"{directory.name}.overwritten-{time.strftime('%Y%m%d-%H%M%S')}")
    directory.rename(target)
    return target


def checkpoint_metadata(
    cfg: DictConfig, data_fp: str, data_desc: dict, world: World, horizon: int
) -> dict:
    """The JSON facts stored with every checkpoint of this run."""
    plain = to_plain(cfg)
    return {
        "schedule_horizon": horizon,
        "config": plain,
        "config_hash": config_hash(
            {k: v for k, v in plain.items() if k in ("model", "optim", "schedule", "data")}
        ),
        "data_fingerprint": data_fp,
        "data": data_desc,
        "world_size": world.size,
        "layout": "replicated",
    }
