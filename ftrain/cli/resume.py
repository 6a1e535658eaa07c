"""Start or resume a run: pick the step, restore it, refuse incompatible configs, report.

``resume=latest`` restores the newest committed step that verifies (a corrupt newest one
is reported and skipped); ``resume=none`` starts fresh but refuses a run directory that
already has checkpoints unless ``run.overwrite=true``; ``resume=N`` restores exactly step N.
In a distributed run the coordinator decides the step and broadcasts it; every rank then
restores that step and checks it got it.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, read_write
from tensordict import TensorDictBase

from ftrain.ckpt import (
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointStoreError,
    CorruptCheckpointError,
)
from ftrain.ckpt.index import byte_count
from ftrain.ckpt.location import parse_location
from ftrain.ckpt.mapped import mapped_bytes
from ftrain.cli.errors import ResumeError, ResumeReadError
from ftrain.cli.overwrite import move_run_aside
from ftrain.cli.redo import last_run_ended, recorded_commits, redo_range
from ftrain.cli.startup import host_rng_start, schedule_line
from ftrain.config import config_hash, flat_config, recorded_config
from ftrain.dist import World, broadcast_json, gather_json
from ftrain.metrics.history import read_history
from ftrain.optim import refresh_hyperparams
from ftrain.state.tree import flatten, replace
from ftrain.step import learning_rate_metrics

__all__ = [
    "host_rng_start",
    "saved_horizon",
    "schedule_line",
    "ResumeError",
    "ResumeReport",
    "checkpoint_metadata",
    "compat_diff",
    "keep_saved_seed",
    "move_run_aside",
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
    "trainer.compile",  # the compiled step matches the eager one to 1e-5
    "optim.fused",  # the same Adam formula, rounded in another order (1e-6 relative)
    "checkpoint.",
    "dist.",
    "run.",
    "resume",
    "data.prefetch",
    "data.path",  # where the data lives may change; the fingerprint checks what it is
    "data.cache_dir",
    "data.allow_changed",
    "init.",  # read on a fresh start only; a resume continues its own params
    "trainer.seed",  # read on a fresh start only; a resume continues the saved streams
    "schedule.decay_steps",
)

# Safe keys a resume does not read at all: their change line says so (an "accepted change:
# trainer.seed: 0 -> 7" told a user re-seeding past a bad stretch that it had worked)
FRESH_START_ONLY = {
    "trainer.seed": "the random streams (step keys, data order, host RNGs) continue from "
    "the checkpoint; a fresh start (init.from=RUN:STEP in a new run.dir) takes a new seed",
    "init.": "a resume continues its own params",
}


@dataclass
class ResumeReport:
    """What a start did: fresh or resumed, from where, and what will be redone."""

    resumed: bool
    step: int = 0
    reason: str = "fresh start"
    next_lr: float | None = None
    epoch: int = 0
    position: int = 0
    # (epoch, position) where each rank's part of the next batch begins (a resume)
    rank_starts: list[tuple[int, int]] | None = None
    redo: tuple[int, int] | None = None
    fingerprints: dict = field(default_factory=dict)
    changes: list[str] = field(default_factory=list)
    restore_s: float | None = None
    checkpoint_bytes: int | None = None
    horizon: int | None = None
    compiled: bool | None = None  # the step was compiled (recorded; None: not recorded)
    # committed steps newer than the restored one that did not verify: {step: why}
    skipped: dict[int, str] = field(default_factory=dict)
    # committed steps newer than an explicit resume=N: the history this run leaves
    left_behind: list[int] = field(default_factory=list)
    # step directories that do not count as checkpoints (no valid marker): "path: why"
    ignored: list[str] = field(default_factory=list)
    world_sizes: tuple[int, int] | None = None  # (checkpoint's, this run's) when they differ
    host_rng: str | None = None  # how this rank's global RNGs were set (restored or seeded)
    notes: list[str] = field(default_factory=list)  # init.from, parameter groups
    schedule: str | None = None  # the LR schedule's horizon as used (see schedule_line)
    rows_read: int | None = None  # chunk bytes this rank read of a sharded restore (its rows)
    mapped: int = 0  # checkpoint.mmap_restore: bytes of the state mapping the step's files
    resharded: bool = False  # the checkpoint or this run holds rows per rank
    init_step: int | None = None  # the step of init.from's base read (ftrain.cli.basestep)

    def _ranks_line(self) -> str:
        """Where each rank's part of the next batch begins, when there are several."""
        if not self.rank_starts or len(self.rank_starts) < 2:
            return ""
        shown = ", ".join(f"{e}:{p}" for e, p in self.rank_starts[:8])
        more = f", ... ({len(self.rank_starts)} ranks)" if len(self.rank_starts) > 8 else ""
        return f" (ranks: {shown}{more} as epoch:position)"

    def lines(self) -> list[str]:
        ignored = [f"ignored {line}" for line in self.ignored]
        rng_line = [self.host_rng] if self.host_rng else []
        if not self.resumed:
            schedule = [self.schedule] if self.schedule else []
            redo = [self._redo_line()] if self.redo else []  # a crash before the first commit
            return [
                f"starting fresh ({self.reason})",
                *redo,
                *schedule,
                *self.notes,
                *rng_line,
                *ignored,
            ]
        out = [
            f"resumed from step {self.step} ({self.reason}) in {self.restore_s or 0:.2f}s"
            + (
                f", {self.mapped:,} bytes of it mapped (checkpoint.mmap_restore)"
                if self.mapped
                else ""
            ),
            f"next step {self.step + 1}: lr={self.next_lr:.6g}, data epoch={self.epoch} "
            f"position={self.position}{self._ranks_line()}",
            f"checkpoint config hash={self.fingerprints.get('config_hash')} data={self.fingerprints.get('data')}",
        ]
        if self.schedule:
            out.append(self.schedule)
        elif self.horizon is not None:
            out.append(
                f"lr schedule decays over {self.horizon} steps (as recorded; set schedule.decay_steps to change it)"
            )
        out += [
            f"step {s} was committed but is unreadable, skipped in favour of step {self.step}: {why}"
            for s, why in sorted(self.skipped.items())
        ]
        if self.redo:
            out.append(self._redo_line())
        if self.world_sizes:
            old, new = self.world_sizes
            out.append(
                f"world size changed: checkpoint written by {old} rank(s), resumed on {new} "
                "(the data cursor continues the same global sample order)"
            )
            if self.resharded:
                out.append(f"resharded from {old} to {new} ranks")
        if self.rows_read is not None:
            out.append(
                f"read {self.rows_read:,} of the step's {self.checkpoint_bytes or 0:,} bytes: "
                "this rank's rows of the sharded leaves, the other leaves whole"
            )
        out += self.notes + rng_line + ignored
        shown = _first(self.changes, "accepted changes (all in metrics.jsonl's resume record)")
        out += [f"accepted change: {c}" if i < _SHOWN else c for i, c in enumerate(shown)]
        return out

    def _redo_line(self) -> str:
        a, b = self.redo
        committed = []
        if self.skipped:
            bad = ", ".join(map(str, sorted(self.skipped)))
            committed.append(f"step(s) {bad} were committed but are unreadable (see above)")
        if self.left_behind:
            left = ", ".join(map(str, self.left_behind))
            committed.append(
                f"step(s) {left} were committed in the history resume={self.step} leaves: "
                "they are moved aside (superseded, not deleted) at this run's first commit"
            )
        span, they = (f"step {a}", "it") if a == b else (f"steps {a}..{b}", "they")
        if not committed:
            return f"{span} ran before but {'was' if a == b else 'were'} not committed: {they} will be redone"
        return (
            f"{span} ran before and will be redone: {'; '.join(committed)}; any "
            "others were never committed"
        )


def _builtin(group: str, key: str = "_target_"):
    """What a built-in option of ``group`` (by its recorded ``name``) meant for ``key``
    before options named it: the value its YAML sets now."""
    from ftrain.cli.targets import BUILTIN_TARGETS

    loss = {"gpt2": "ftrain.recipes.gpt2.lm_loss"}
    table = loss if key == "loss" else BUILTIN_TARGETS[group]
    return lambda saved: table.get(saved.get(f"{group}.name"))


# Keys added to the config after checkpoints were already being written, with the value
# that means "as before": a checkpoint without the key is compared as if it had this value
# (a function of the checkpoint's flat config where it depends on the option: the target
# of the built-in option the checkpoint recorded by name). The target itself is only ever
# compared, never imported: a checkpoint's recorded config runs no code.
ADDED_KEYS = {
    "model._target_": _builtin("model"),
    "model.loss": _builtin("model", "loss"),
    "optim._target_": _builtin("optim"),
    "schedule._target_": _builtin("schedule"),
    "data._target_": _builtin("data"),
    "model.lora.rank": 0,
    "model.lora.alpha": 16.0,
    "model.lora.targets": ["c_attn", "c_proj"],
    "model.lora.dropout": 0.0,
    "optim.freeze": [],
    "optim.fused": False,
    "init.from": None,
    "init.from_hf": None,
}


def compat_diff(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(incompatible, safe) differences between a checkpoint's config and the current one."""
    a, b = flat_config(saved), flat_config(current)
    a = {k: v(a) if callable(v) else v for k, v in ADDED_KEYS.items() if k in b} | a
    bad, safe = [], []
    for key in sorted((set(a) | set(b)) - {"resume"}):  # how a start picks its step
        if a.get(key) == b.get(key) or _read_by_neither(a, b, key):
            continue
        if not _same_place(key, a.get(key), b.get(key)):
            line = f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}"
            (safe if key.startswith(SAFE_PREFIXES) else bad).append(line + _no_effect(key))
    bad += _group_order_change(saved, current)
    return bad, safe


def _no_effect(key: str) -> str:
    why = next((w for k, w in FRESH_START_ONLY.items() if key.startswith(k)), None)
    return f" (no effect on a resume: {why})" if why else ""


def _read_by_neither(a: dict, b: dict, key: str) -> bool:
    """A setting neither config reads, so nothing a step computes changed (refused as if it
    had): a LoRA setting while LoRA is off (``model.lora.rank=0``) before and after, or one
    the option both chose ignores (``optim.momentum`` under adamw, ``data.dtype`` of the
    byte-level corpora)."""
    from ftrain.cli.targets import unused_keys

    if key.startswith("model.lora."):
        return a.get("model.lora.rank") == 0 == b.get("model.lora.rank")
    parts = key.split(".")
    group, leaf = parts[0], parts[-1]
    in_group = len(parts) == 2 or (group == "optim" and len(parts) == 4 and parts[1] == "groups")
    target = a.get(f"{group}._target_")
    same = isinstance(target, str) and target == b.get(f"{group}._target_")
    return in_group and same and leaf in unused_keys(group, target)


def _group_order_change(saved: dict, current: dict) -> list[str]:
    """``optim.groups`` given in another order: the first matching group takes a parameter,
    so the order is part of the optimizer's layout (compared as mappings, a reorder was no
    change, and the restore then failed with dozens of "missing in checkpoint" lines)."""
    orders = []
    for config in (saved, current):
        groups = (config.get("optim") or {}).get("groups") if isinstance(config, dict) else None
        orders.append(list(groups) if isinstance(groups, dict) else [])
    old, new = orders
    if old == new or sorted(old) != sorted(new):
        return []  # no reorder (an added or removed group shows as its own key)
    return [f"optim.groups order: {old} -> {new} (the first matching group takes a parameter)"]


# where the run's own files are: a relative and an absolute spelling of one place are no
# change (the checkpoints were just found there). Resolved from this start's working
# directory, so data paths are not among them: a relative data.path from another
# directory may be other data, and the report keeps showing that change
_PATH_KEYS = ("run.dir", "checkpoint.dir", "checkpoint.fallback_dir")


def _same_place(key: str, old: object, new: object) -> bool:
    if key not in _PATH_KEYS or not (isinstance(old, str) and isinstance(new, str)):
        return False
    return os.path.abspath(os.path.expanduser(old)) == os.path.abspath(os.path.expanduser(new))


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
        if not steps:
            _refuse_lost_steps(cfg, manager)
            return None
        _refuse_newer_elsewhere(cfg, manager, steps[-1])
        return _LATEST
    if cfg.resume not in steps:
        raise ResumeError(
            f"resume={cfg.resume} but step {cfg.resume} is not committed"
            f"{_why_unlisted(cfg, manager, int(cfg.resume))}; available steps: {steps or 'none'}"
        )
    return int(cfg.resume)


def _why_unlisted(cfg: DictConfig, manager: CheckpointManager, step: int) -> str:
    """For a step asked for that is not listed: its directory, if one is there that does
    not count (no valid marker: a save killed before its commit, or damage); else, if the
    run's records show it committed, that it is gone since (the keep policy, or by hand)."""
    name = f"step_{step:08d}"
    there = [(p, why) for p, why in manager.invalid_steps().items() if Path(str(p)).name == name]
    if there:
        return f" ({there[0][0]} is there but does not count: {there[0][1]})"
    if step in recorded_commits(Path(cfg.run.dir)):
        return (
            " any more (the run's records show it committed; the keep policy, "
            "checkpoint.keep_last/keep_every/keep_best, deleted it since, or it was removed)"
        )
    return ""


def _refuse_lost_steps(cfg: DictConfig, manager: CheckpointManager) -> None:
    """No committed step where this start looks, but the run directory's records show
    commits: a changed ``checkpoint.dir``, an unmounted volume, deleted checkpoints. A
    fresh start there trained from step 0 as if nothing had been saved (and reported the
    old steps as never committed).

    Raises:
        ResumeError: naming the newest recorded commit, where it was saved (runs that
            record it), where this start looked, and the ways on.
    """
    records = read_history(Path(cfg.run.dir))
    committed = [r["step"] for r in records if r.get("kind") == "committed"]
    if not committed:
        return
    saved_to = [r["checkpoint_dirs"] for r in records if r.get("checkpoint_dirs")]
    there = f" (saved to {', '.join(saved_to[-1])})" if saved_to else ""
    looked = [str(d) for d in filter(None, (cfg.checkpoint.dir, cfg.checkpoint.fallback_dir))]
    raise ResumeError(
        f"run.dir={cfg.run.dir} records committed steps up to {max(committed)}{there}, but "
        f"{' and '.join(looked)} {'hold' if len(looked) > 1 else 'holds'} no committed step. Point checkpoint.dir (and "
        "checkpoint.fallback_dir) where they are, mount that storage, or start this run "
        "over with resume=none run.overwrite=true (the old records are moved aside)"
    )


def _refuse_newer_elsewhere(cfg: DictConfig, manager: CheckpointManager, newest: int) -> None:
    """The run's records show a step committed after ``newest`` (the newest listed where
    this start looks) in the history it continues, and its directory is not here at all:
    a restart without the ``checkpoint.fallback_dir`` that took saves on a full disk, or
    with another ``checkpoint.dir``. Resuming from ``newest`` redid every step since (and
    said they were never committed).

    Raises:
        ResumeError: naming the newest recorded commit, where the run saved, where this
            start looked, and the ways on (``resume=newest`` goes back on purpose).
    """
    run_dir = Path(cfg.run.dir)
    missing = {s for s in recorded_commits(run_dir) if s > newest}
    if not missing:  # the usual start: one read of the records, no listing
        return
    missing -= _unlisted_commits(cfg, manager)  # there but damaged: restore says so
    # moved aside (a go-back's old history, whose records may lag: a kill before the save
    # record was written) or being moved (the journal): not lost, left on purpose
    missing -= set(manager.set_aside_steps())
    if not missing:
        return
    saved_to = [r["checkpoint_dirs"] for r in read_history(run_dir) if r.get("checkpoint_dirs")]
    there = f" (the run saved to {', '.join(saved_to[-1])})" if saved_to else ""
    looked = " and ".join(
        str(d) for d in filter(None, (cfg.checkpoint.dir, cfg.checkpoint.fallback_dir))
    )
    raise ResumeError(
        f"run.dir={cfg.run.dir} records step {max(missing)} committed{there}, but the "
        f"newest step in {looked} is {newest}: resuming there would train steps "
        f"{newest + 1}..{max(missing)} again. Point checkpoint.fallback_dir (and "
        f"checkpoint.dir) where step {max(missing)} is, mount that storage, or go back to "
        f"step {newest} on purpose with resume={newest}"
    )


def _first_choice(
    cfg: DictConfig,
    manager: CheckpointManager,
    fresh: TensorDictBase | None = None,
    data_fp: str | None = None,
) -> int | None:
    """Coordinator: :func:`_pick_step`, with the config checked on the candidate's metadata
    *before* restoring, so a changed model shape is reported as a config diff rather than
    as a shape mismatch (and, given the ``fresh`` state, as one that changes shapes)."""
    chosen = _pick_step(cfg, manager)
    if chosen is not None:
        meta = _candidate_metadata(manager, chosen)
        if meta is not None:
            _check_compat(cfg, meta, lambda: _reshaped(manager, meta, fresh), data_fp)
    return chosen


def _reshaped(manager: CheckpointManager, meta: dict, fresh: TensorDictBase | None) -> list[str]:
    """How the params and optimizer state this config makes differ in keys or shapes from
    the step's (its manifest; a replicated layout only): [] when they fit or it cannot tell."""
    if fresh is None or meta.get("layout") != "replicated" or not isinstance(meta.get("step"), int):
        return []
    try:
        saved = manager.arrays(meta["step"])
    except (OSError, ValueError):
        return []  # the restore says what is wrong with the step
    ours = {"/".join(k): tuple(t.shape) for k, t in zip(*flatten(fresh), strict=True)}
    ours = {k: v for k, v in ours.items() if k.startswith(("params/", "opt/"))}
    theirs = {k: v[0] for k, v in saved.items() if k.startswith(("params/", "opt/"))}
    said = {
        k: f"{theirs[k]} -> {ours[k]}" for k in ours.keys() & theirs.keys() if theirs[k] != ours[k]
    }
    said |= dict.fromkeys(theirs.keys() - ours.keys(), "only in the checkpoint")
    said |= dict.fromkeys(ours.keys() - theirs.keys(), "not in the checkpoint")
    params_first = sorted(said, key=lambda k: (not k.startswith("params/"), k))
    return [f"{k}: {said[k]}" for k in params_first]


_REFUSED = "the coordinator (rank 0) refused to resume; its message says why and what to change"


def _coordinator_decides(world: World, decide, send):
    """``decide()`` on the coordinator, its result sent to every rank by ``send``
    (``broadcast_int`` or ``broadcast_json``); if the coordinator raises, every rank stops."""
    value = None
    if world.is_coordinator:
        try:
            value = decide()
        except BaseException:
            send(_FAILED)
            raise
    value = send(value)
    if value == _FAILED:
        raise ResumeError(_REFUSED)
    return value


def _restore_agreed(cfg, manager, fresh, world: World, sharder=None, data_fp=None):
    """Coordinator picks and restores; the step and the copy it read are broadcast; the
    other ranks restore that copy (with a primary and a fallback location holding two
    copies of one step, every rank reads the coordinator's). A sharded state
    (``sharder``): :func:`_restore_rows_agreed`."""
    if sharder is not None:
        return _restore_rows_agreed(cfg, manager, fresh, world, sharder, data_fp)
    restored, mmap = {}, bool(cfg.checkpoint.mmap_restore)

    def pick() -> list | None:
        chosen = _first_choice(cfg, manager, fresh, data_fp)
        if chosen is None:
            return None
        step = None if chosen == _LATEST else chosen
        restored["state"] = _restore(manager, step, fresh, mmap=mmap)
        return [int(restored["state"]["step"]), manager.restored_copy]

    decided = _coordinator_decides(world, pick, broadcast_json)
    chosen, copy = decided if decided is not None else (None, None)
    state, outcome, error = restored.get("state"), {"ok": True}, None
    if state is None and chosen is not None:
        state, outcome, error = _restore_copy(manager, chosen, fresh, copy, mmap)
    if world.active:  # every rank learns if one failed: none goes on to train alone
        decision = broadcast_json(_decide(gather_json(outcome)))
        if decision["do"] != "take":
            raise _stop_error(  # on every rank alike (the failed one's own error, an
                # OSError say, was a traceback and exit 1 there while the others said why)
                decision,
                f"cannot resume step {chosen} on every rank: {decision['why']}",
            ) from error
    return state


def _restore_copy(manager, step: int, fresh, copy, mmap: bool) -> tuple:
    """A non-coordinator rank's restore of the coordinator's copy of ``step``:
    ``(state, outcome, error)``, the outcome (JSON) ``{"ok"}`` or ``{"error": why}``. Any
    failure stops the resume: the coordinator already vouched for this copy, so a rank that
    cannot read it sees another file system or another file, not an older good step."""
    try:
        state = _restore(manager, step, fresh, copy=copy, mmap=mmap)
    except Exception as err:
        return None, _error_outcome(err), err
    if int(state["step"]) != step:
        why = f"it restored step {int(state['step'])}, the coordinator chose {step}"
        return None, {"error": why}, None
    return state, {"ok": True}, None


def _restore_rows_agreed(cfg, manager, fresh, world: World, sharder, data_fp=None):
    """A sharded resume: every rank reads only its own rows (``manager.restore(rows=...)``),
    so no rank alone can vouch for a step. The coordinator lists the candidates
    (``resume=latest``: every committed step, newest first) and broadcasts them; every rank
    tries the same candidate and reports to the coordinator, which decides for all
    (:func:`_decide`): take it, skip to the next older one (a rank's rows did not verify:
    no rank keeps that step), or stop. So every rank resumes from one step, or every rank
    fails with the same message; none is left waiting in a collective."""

    def candidates() -> list[list] | None:
        chosen = _first_choice(cfg, manager, fresh, data_fp)
        if chosen is None:
            return None
        copies = manager.committed_copies()  # every rank tries the same copy, in turn
        return [[s, c] for s, c in copies if chosen in (_LATEST, s)]

    copies = _coordinator_decides(world, candidates, broadcast_json)
    skipped: dict[int, str] = {}
    for step, copy in copies or ():
        state, outcome, error = _restore_rows(manager, step, fresh, sharder, copy)
        decision = broadcast_json(_decide(gather_json(outcome)))
        if decision["do"] == "take":
            _SKIPPED.clear()  # for the report: why each newer step was passed over
            _SKIPPED.update({s: why for s, why in skipped.items() if s != step})
            return state
        if decision["do"] == "stop":
            raise _stop_error(decision, f"cannot restore step {step}: {decision['why']}") from error
        # two copies of one step skipped: both reasons
        skipped[step] = "; ".join(filter(None, (skipped.get(step), decision["why"])))
    if skipped:
        raise CheckpointNotFoundError(
            "no committed step verifies on every rank:\n  "
            + "\n  ".join(f"step {s}: {why}" for s, why in skipped.items())
        )
    return None


def _restore_rows(manager, step: int, fresh, sharder, copy=None) -> tuple:
    """This rank's try of its rows of ``step``: ``(state, outcome, error)``; ``outcome``
    (JSON, for the coordinator) is ``{"ok"}``, ``{"corrupt": why}`` or ``{"error": why}``."""
    try:
        state = _restore(manager, step, fresh, rows=sharder, copy=copy)
    except CheckpointNotFoundError as err:  # a chunk of its rows, or the metadata, is bad
        return None, {"corrupt": "; ".join(getattr(err, "problems", None) or [str(err)])}, None
    except Exception as err:  # e.g. the checkpoint does not fit the model: no use trying older
        return None, _error_outcome(err, name=False), err
    if int(state["step"]) != step:
        return None, {"corrupt": f"it holds step {int(state['step'])}"}, None
    return state, {"ok": True}, None


def _error_outcome(err: Exception, name: bool = True) -> dict:
    """A rank's failed restore as its outcome (JSON): ``{"error": why}``, with ``"io"``
    when it was the disk's or the machine's (an ``OSError``: every rank then stops with
    exit 1, a supervisor retries; anything else is the config's, exit 2)."""
    why = f"{type(err).__name__}: {err}" if name else str(err)
    return {"error": why, "io": _of_the_moment(err)}


def _of_the_moment(err: BaseException) -> bool:
    """An ``OSError`` of the disk or the machine (EIO, a file system gone), not one of
    ftrain's own: no step found (a rank seeing other storage), an object store refusing
    (a bucket, credentials) or a permission denied say something about the config."""
    return isinstance(err, OSError) and not isinstance(
        err, CheckpointNotFoundError | CheckpointStoreError | PermissionError
    )  # a permission stays refused: a retry would loop


def _decide(outcomes: list[dict] | None) -> dict | None:
    """Coordinator: what every rank does after each reported its outcome of one candidate
    (``None`` on the other ranks, which receive the decision)."""
    if outcomes is None:
        return None
    for kind, do in (("error", "stop"), ("corrupt", "skip")):
        bad = [f"rank {r}: {o[kind]}" for r, o in enumerate(outcomes) if kind in o]
        if bad:
            io = kind == "error" and all(o.get("io") for o in outcomes if "error" in o)
            return {"do": do, "why": "; ".join(bad), "io": io}
    return {"do": "take"}


def _stop_error(decision: dict, message: str) -> Exception:
    """The error every rank raises for a "stop" decision: a read error of the moment
    (exit 1) when every failed rank's was, else a refusal (exit 2)."""
    return ResumeReadError(message) if decision.get("io") else ResumeError(message)


# root attributes the CLI acts on -> the JSON types they may have (None: absent)
_RUN_METADATA = {
    "config": dict,
    "config_hash": str,
    "data_fingerprint": str,
    "data": dict,
    "world_size": int,
    "layout": str,
    "schedule_horizon": int,
    "step_compiled": bool,  # what trainer.compile=auto chose at the run's first start
    "cpu_threads": int,
}


def _thread_change(meta: dict) -> list[str]:
    """The CPU thread count since the checkpoint, said as a change: torch's CPU reductions
    split their work by thread, so a requeue on a node with another core count resumed to
    other bits (~1e-8) than an unbroken run, without a word."""
    saved, now = meta.get("cpu_threads"), torch.get_num_threads()
    if saved is None or saved == now:
        return []
    return [
        f"CPU threads {saved} -> {now} (torch's CPU reductions split by thread: on CPU the run "
        f"differs from an unbroken one in the last bits; OMP_NUM_THREADS={saved} keeps it "
        "bit-identical)"
    ]


def check_run_metadata(attrs: dict) -> None:
    """Refuse a step whose run metadata has the wrong types (before anything acts on it).

    Raises:
        CorruptCheckpointError: the field, its value and the expected type.
    """
    for name, kind in _RUN_METADATA.items():
        value = attrs.get(name)
        least = 0 if name == "schedule_horizon" else 1  # 0: written by a max_steps=0 start
        bad_int = kind is int and (
            isinstance(value, bool) or (isinstance(value, int) and value < least)
        )
        if value is not None and (not isinstance(value, kind) or bad_int):
            raise CorruptCheckpointError(
                f"run metadata {name!r} is {value!r:.80}, expected a {kind.__name__}"
                + (f" >= {least}" if kind is int else "")
            )


def _checked_metadata(manager: CheckpointManager, step: int) -> dict | None:
    """A step's metadata if it is readable and well-typed, else None (a restore then
    reports the step as corrupt and falls back)."""
    try:
        meta = manager.metadata(step)
        check_run_metadata(meta)
        return meta
    except (CorruptCheckpointError, CheckpointNotFoundError, OSError, ValueError):
        return None


def _candidate_metadata(manager: CheckpointManager, chosen: int) -> dict | None:
    """The metadata of the step about to be restored, or None if it is unreadable (then the
    restore below reports it and falls back to an older step, which is checked after)."""
    return _checked_metadata(manager, manager.latest_step() if chosen == _LATEST else chosen)


def _restore(
    manager: CheckpointManager,
    step: int | None,
    fresh: TensorDictBase,
    rows=None,
    copy=None,
    mmap: bool = False,
) -> TensorDictBase:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            state = manager.restore(
                step,
                target=fresh,
                check_metadata=check_run_metadata,
                rows=rows,
                copy=copy,
                mmap=mmap,
            )
        _note_skipped(caught)
        return state
    except OSError as err:
        if not _of_the_moment(err) or isinstance(err, CheckpointReadError | ResumeReadError):
            raise
        where = "the newest step" if step is None else f"step {step}"
        raise ResumeReadError(f"cannot read {where}: {err}") from err  # one line, exit 1
    except ValueError as err:  # the checkpoint does not fit the configured model/optimizer
        listed = getattr(err, "differences", [str(err)])
        old = any("not in target: amp/" in d for d in listed)  # loss scale not under opt
        why = (
            "an older ftrain (top-level amp)"
            if old
            else "a different model or optimizer layout (model.*, trainer.precision, "
            "optim.* groups or frozen parameters, model.lora.*: run.allow_config_change "
            "accepts changed values, not a state of another shape)"
        )
        raise ResumeError(
            f"{err}\n  the checkpoint was written for {why}; resume with its config "
            "or start a new run (another run.name, or resume=none run.overwrite=true)"
        ) from None


# why each committed step was passed over by the last restore (from the manager's warnings)
_SKIPPED: dict[int, str] = {}
_STEP_WARNING = re.compile(r"^\[step=(\d+)\] (.*)$", re.S)
_TRIES = re.compile(r"; (trying an older one|trying its other copy|no other copy to try)$")


def _note_skipped(caught: list) -> None:
    """Keep the manager's "[step=N] ... is corrupt ..." warnings for the resume report; other
    warnings are shown as usual."""
    _SKIPPED.clear()
    for w in caught:
        m = _STEP_WARNING.match(str(w.message))
        if m and issubclass(w.category, RuntimeWarning):
            _SKIPPED[int(m.group(1))] = _TRIES.sub("", m.group(2))
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def skipped_newer(cfg: DictConfig, manager: CheckpointManager, step: int) -> dict[int, str]:
    """Committed steps newer than the restored ``step`` that resume=latest passed over.

    ``resume=latest`` tries the newest committed step first, so every newer one was tried
    and did not verify. With an explicit ``resume=N`` newer steps are simply not wanted.
    """
    if cfg.resume != "latest":
        return {}
    out = {s: _SKIPPED.get(s, "it did not verify") for s in manager.all_steps() if s > step}
    for s in _unlisted_commits(cfg, manager):  # "never committed" is what the report said
        if s > step:
            out.setdefault(s, "its COMMITTED marker is missing or damaged")
    return out


def _unlisted_commits(cfg: DictConfig, manager: CheckpointManager) -> set[int]:
    """Steps the run's records say committed whose directory is there but does not count
    (its marker deleted or damaged)."""
    invalid = {
        m.group(1) for p in manager.invalid_steps() if (m := _STEP_DIR.match(Path(str(p)).name))
    }
    committed = {r["step"] for r in read_history(Path(cfg.run.dir)) if r.get("kind") == "committed"}
    return {s for s in committed if isinstance(s, int) and f"{s:08d}" in invalid}


_STEP_DIR = re.compile(r"^step_([0-9]{8,})$")


def ignored_step_dirs(cfg: DictConfig) -> list[str]:
    """``step_*`` directories in the checkpoint locations that do not count (no valid marker
    or manifest): listed so a user sees what a resume did not consider."""
    from ftrain.ckpt.commit import committed_steps

    out: list[str] = []
    for d in filter(None, (cfg.checkpoint.dir, cfg.checkpoint.fallback_dir)):
        committed_steps(
            parse_location(d, cfg.checkpoint.storage),
            on_invalid=lambda p, why: out.append(f"{p}: {why}"),
        )
    return out


_SHOWN = 10  # config differences listed in a message; a model swapped for another has hundreds


def _first(lines: list[str], rest: str) -> list[str]:
    """``lines`` up to ``_SHOWN``, then one line counting the others (``... and 378 more
    REST``)."""
    if len(lines) <= _SHOWN:
        return lines
    return [*lines[:_SHOWN], f"... and {len(lines) - _SHOWN} more {rest}"]


def saved_horizon(cfg: DictConfig, manager: CheckpointManager) -> int | None:
    """The LR-schedule horizon recorded by the checkpoint a resume would start from."""
    if cfg.resume == "none":
        return None
    step = manager.latest_step() if cfg.resume == "latest" else int(cfg.resume)
    if step is None:
        return None
    return (_checked_metadata(manager, step) or {}).get("schedule_horizon")


def _check_compat(cfg: DictConfig, meta: dict, reshaped=None, data_fp=None) -> list[str]:
    """The config's changes since the step ``meta`` describes: ``bad`` ones refused unless
    ``run.allow_config_change``, said with the state's shape changes ``reshaped()`` finds
    (which no setting accepts: the advice to accept the change led to a 150-line refusal).
    ``data_fp``: the training data's fingerprint now, to name ``data.allow_changed`` in the
    same refusal where the samples change too (``data.block_size``)."""
    saved = meta.get("config")
    if saved is None:
        return []
    bad, safe = compat_diff(saved, recorded_config(cfg))
    if bad and not cfg.run.allow_config_change:
        step = meta.get("step")
        where = f"python -m ftrain.ckpt show {cfg.checkpoint.dir} {step} prints the checkpoint's"
        shapes = reshaped() if reshaped is not None else []
        new_run = "start a new run (another run.name or resume=none run.overwrite=true)"
        raise ResumeError(
            f"the config differs from step {step}'s checkpoint in ways that change what a step computes:\n    "
            + "\n    ".join(_first(bad, f"differences ({where} config)"))
            + (
                "\n  the state this config makes has other keys or shapes than the checkpoint's:\n    "
                + "\n    ".join(_first(shapes, "differences"))
                + f"\n  no setting continues this run with another state: resume with the "
                f"checkpoint's values, or {new_run}; init.from={_run_or_dir(cfg)}:{step} starts "
                "one from its params where the model is unchanged"
                if shapes
                else f"\n  resume with the checkpoint's values, {new_run}, or accept the change "
                f"with run.allow_config_change=true{_data_too(cfg, meta, data_fp)}"
            )
        )
    return bad + safe


def _data_too(cfg: DictConfig, meta: dict, data_fp: str | None) -> str:
    """The second setting a change of the samples needs (asked for one refusal later)."""
    saved = meta.get("data_fingerprint")
    if data_fp is None or saved in (None, data_fp) or cfg.data.allow_changed:
        return ""
    return (
        f" and data.allow_changed=true (the training samples change too: data fingerprint "
        f"{saved} -> {data_fp})"
    )


def keep_saved_seed(cfg: DictConfig, meta: dict) -> None:
    """A resume runs on the checkpoint's random streams, whatever ``trainer.seed`` says now
    (said as a change with no effect): the seed recorded with this run's later steps, and
    any stream seeded anew (a rank the checkpoint has no host RNGs for), are the saved one's,
    so the records do not claim a seed the run never used."""
    saved = ((meta.get("config") or {}).get("trainer") or {}).get("seed")
    if type(saved) is int and saved != cfg.trainer.seed:
        with read_write(cfg.trainer):  # this start's config, read-only once composed
            cfg.trainer.seed = saved


def _run_or_dir(cfg: DictConfig) -> str:
    """How ``init.from`` names this run's steps: the run directory where they are its
    ``checkpoints/`` (the spelling the docs use), else the checkpoint directory."""
    in_run = Path(str(cfg.checkpoint.dir)) == Path(str(cfg.run.dir)) / "checkpoints"
    return str(cfg.run.dir) if in_run else str(cfg.checkpoint.dir)


def _check_retention(cfg: DictConfig, meta: dict, manager: CheckpointManager) -> list[str]:
    """A keep policy changed since the restored step was written (a requeue script that
    lost ``checkpoint.keep_every``, a lowered ``keep_last``) deleted, at the next commit,
    committed steps the old policy kept, with only "accepted change" said. Such a change
    now needs ``run.allow_config_change=true``; accepted, it is named in the report. The
    policies are compared over the steps kept now plus the next commit; steps after the
    restored one are the other history's, set aside (not deleted) at that commit.

    Raises:
        ResumeError: the steps the new policy would delete and the settings that changed.
    """
    from ftrain.ckpt.policies import KeepAll, StepInfo
    from ftrain.cli.build import KEEP_KEYS, keep_policy_of

    saved = ((meta.get("config") or {}).get("checkpoint")) or {}
    changed = [k for k in KEEP_KEYS if k in saved and saved[k] != cfg.checkpoint.get(k)]
    restored = meta.get("step")
    if not changed or not isinstance(restored, int):
        return []
    now = time.time()
    infos = [
        StepInfo(e["step"], e["time"], e.get("metrics") or {})
        for e in manager.index()
        if e["step"] <= restored
    ]
    coming = [*infos, StepInfo(restored + 1, now, {})]  # the next commit counts too
    kept = [(keep_policy_of(c) or KeepAll()).keep(coming, now) for c in (saved, cfg.checkpoint)]
    doomed = sorted((kept[0] - kept[1]) & {i.step for i in infos})
    if not doomed:
        return []
    what = ", ".join(f"checkpoint.{k}: {saved[k]!r} -> {cfg.checkpoint.get(k)!r}" for k in changed)
    line = f"the changed keep policy ({what}) deletes committed step(s) {', '.join(map(str, doomed))} at the next commit"
    if not cfg.run.allow_config_change:
        raise ResumeError(
            f"{line}, which the checkpoint's policy keeps; resume with its settings, or "
            "accept the deletion with run.allow_config_change=true"
        )
    return [line]


def start_state(
    cfg: DictConfig,
    manager: CheckpointManager,
    fresh: TensorDictBase,
    world: World,
    tx,
    data_fp: str,
    sharder=None,
    earlier_runs: list[Path] = (),
):
    """Restore (or not) per ``cfg.resume``; returns ``(state, report, metadata_of_checkpoint)``.
    With a ``sharder`` (``dist.shard``) each rank reads only its rows of the sharded leaves,
    which come back as DTensors. ``earlier_runs``: the run directories whose checkpoint
    locations this start took over (their reached steps are redone too)."""
    from ftrain.data import check_fingerprint

    t0 = time.perf_counter()
    try:
        state = _restore_agreed(cfg, manager, fresh, world, sharder, data_fp)
    except CheckpointNotFoundError as err:
        if cfg.resume in ("latest", "none"):
            raise
        raise ResumeError(  # the step asked for is there but damaged: say what else there is
            f"resume={cfg.resume}: step {cfg.resume} does not restore: {err}\n  available "
            f"steps: {manager.all_steps()}; resume=latest resumes from the newest one that "
            "verifies, resume=STEP from another"
        ) from None
    restore_s = time.perf_counter() - t0
    ignored = ignored_step_dirs(cfg) if world.is_coordinator else []
    if state is None:
        report = ResumeReport(
            False,
            reason="resume=none" if cfg.resume == "none" else "no checkpoint yet",
            redo=_fresh_redo(cfg),
            ignored=ignored,
            host_rng=host_rng_start(cfg, world, None),
        )
        return fresh, report, {}
    step = int(state["step"])
    # the shown learning rates by this run's schedule (a resume may change it): the report's
    # next rate and the first step's lr metric are then the rate that step applies
    state = replace(state, opt=refresh_hyperparams(tx, state["opt"]))
    meta = manager.metadata(step, copy=manager.restored_copy)  # what was restored
    changes = _check_compat(cfg, meta, data_fp=data_fp)
    keep_saved_seed(cfg, meta)
    host_rng = host_rng_start(cfg, world, meta)
    changes += _check_retention(cfg, meta, manager)
    check_fingerprint(meta.get("data_fingerprint"), data_fp, bool(cfg.data.allow_changed))
    if meta.get("data_fingerprint") not in (None, data_fp):
        changes.append(
            f"data fingerprint {meta.get('data_fingerprint')} -> {data_fp} (data.allow_changed=true)"
        )
    changes += _thread_change(meta)
    skipped = skipped_newer(cfg, manager, step)
    left = [] if cfg.resume == "latest" else [s for s in manager.all_steps() if s > step]
    saved_world = meta.get("world_size")
    report = ResumeReport(
        True,
        step=step,
        reason=f"resume={cfg.resume}",
        next_lr=float(learning_rate_metrics(state["opt"])["lr"]),
        epoch=int(state["data"]["epoch"]),
        position=int(state["data"]["position"]),
        redo=redo_range(
            Path(cfg.run.dir), step, [*skipped, *left], cfg.trainer.max_steps, earlier_runs
        ),
        fingerprints={"config_hash": meta.get("config_hash"), "data": meta.get("data_fingerprint")},
        changes=changes,
        restore_s=restore_s,
        horizon=meta.get("schedule_horizon"),
        compiled=meta.get("step_compiled"),
        checkpoint_bytes=_saved_bytes(meta),
        skipped=skipped,
        left_behind=left,
        ignored=ignored,
        world_sizes=(
            (saved_world, world.size)
            if isinstance(saved_world, int) and saved_world != world.size
            else None
        ),
        host_rng=host_rng,
        rows_read=manager.read_bytes if sharder is not None else None,
        mapped=mapped_bytes(state.values(True, True)) if cfg.checkpoint.mmap_restore else 0,
        notes=_mmap_notes(cfg, sharder) + _finished_note(cfg, step),
        resharded=sharder is not None or str(meta.get("layout", "")).startswith("rows:"),
    )
    return state, report, meta


def val_change_note(meta: dict, val_fp: str | None) -> list[str]:
    """A resume whose val split differs from the checkpoint's: said, since ``val_*``
    metrics (and ``keep_best`` ranking by them) then compare different data (it went
    unnoticed: only the train split is checked)."""
    saved = meta.get("val_fingerprint")
    if not isinstance(saved, str) or val_fp is None or saved == val_fp:
        return []
    return [
        f"the val split changed since the checkpoint (fingerprint {saved} -> {val_fp}): val_* "
        "metrics before and after this resume measure different data, and "
        "checkpoint.keep_best ranks across both"
    ]


def _saved_bytes(meta: dict) -> int | None:
    """The step's recorded size if it is a count (a figure for the resume line)."""
    save = meta.get("save")
    return byte_count(save.get("bytes")) if isinstance(save, dict) else None


def eval_change_note(meta: dict, cfg: DictConfig) -> list[str]:
    """A resume that evaluates on another set of val samples (``trainer.eval_batches`` x
    ``trainer.batch_size`` of them, spread over the split): said, as for a changed split."""
    saved = (meta.get("config") or {}).get("trainer") or {}
    before = (saved.get("eval_batches"), saved.get("batch_size"))
    now = (cfg.trainer.eval_batches, cfg.trainer.batch_size)
    if not all(type(v) is int for v in before) or before[0] * before[1] == now[0] * now[1]:
        return []
    return [
        f"evaluation now reads {now[0] * now[1]} val samples (trainer.eval_batches x "
        f"batch_size = {now[0]} x {now[1]}), the checkpoint's run {before[0] * before[1]} "
        f"({before[0]} x {before[1]}): val_* metrics before and after this resume measure "
        "different samples, and checkpoint.keep_best ranks across both"
    ]


def _fresh_redo(cfg: DictConfig) -> tuple[int, int] | None:
    """A fresh start redoes the steps of a process that died before its first commit; a
    run that ended (its checkpoints elsewhere, or moved away) is not redone."""
    run_dir = Path(cfg.run.dir)
    if last_run_ended(run_dir):
        return None
    return redo_range(run_dir, 0, until=cfg.trainer.max_steps)


def _finished_note(cfg: DictConfig, step: int) -> list[str]:
    if step < cfg.trainer.max_steps:
        return []
    return [
        f"trainer.max_steps={cfg.trainer.max_steps} is not past the restored step {step}: "
        "nothing to train (raise trainer.max_steps to go on)"
    ]


def _mmap_notes(cfg: DictConfig, sharder) -> list[str]:
    if sharder is None or not cfg.checkpoint.mmap_restore:
        return []
    return [
        "checkpoint.mmap_restore=true does not apply to a sharded resume: each rank read its rows"
    ]


def checkpoint_metadata(
    cfg: DictConfig,
    data_fp: str,
    data_desc: dict,
    world: World,
    horizon: int,
    val_fp: str | None = None,
) -> dict:
    """The JSON facts stored with every checkpoint of this run (``val_fp``: the val split's
    fingerprint, None without one)."""
    plain = recorded_config(cfg)
    return {
        # a run of max_steps=0 has fixed no LR curve: a later start takes its own max_steps
        "schedule_horizon": horizon or None,
        "config": plain,
        "config_hash": config_hash(
            {k: v for k, v in plain.items() if k in ("model", "optim", "schedule", "data")}
        ),
        "data_fingerprint": data_fp,
        "val_fingerprint": val_fp,
        "data": data_desc,
        "world_size": world.size,
        # torch's CPU kernels split reductions by thread: another count resumes to other bits
        "cpu_threads": torch.get_num_threads(),
        # every store holds global shapes; "rows:N" = written by N ranks, each its own rows
        "layout": "replicated" if cfg.dist.shard == "none" else f"rows:{world.size}",
    }
