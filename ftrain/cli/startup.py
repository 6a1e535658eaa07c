"""What a start checks, says and sets up besides the state: one config on every rank, the
LR schedule's horizon, the host RNGs."""

from __future__ import annotations

import sys
from collections.abc import Callable

from omegaconf import DictConfig

from ftrain.ckpt import CorruptCheckpointError
from ftrain.config import ConfigError, flat_config, recorded_config
from ftrain.data import DataFormatError, DataPathError, Source
from ftrain.dist import World, broadcast_json, gather_json

__all__ = [
    "host_rng_start",
    "same_config_on_every_rank",
    "same_data_on_every_rank",
    "schedule_line",
]

_SHOWN_KEYS = 5  # differing keys a refusal lists (the rest are counted)
_ABSENT = "<absent>"


def same_config_on_every_rank(cfg: DictConfig, world: World) -> None:
    """Refuse a multi-rank start whose ranks composed different configs.

    torchrun starts one command on every rank, but a value can still differ per rank: an
    ``${oc.env:...}`` or ``${now:...}`` interpolation, a config file edited between two
    hosts' starts. Such a run trains silently wrong (each rank steps with its own
    ``optim.lr``, reads its own data, writes its own ``run.dir``), and the checkpoints
    record rank 0's config only. Collective: every rank calls it at start; rank 0 compares
    the configs a checkpoint would record (``logger`` aside: only rank 0 logs) and every
    rank raises the same :class:`ConfigError`, naming the keys and each rank's value.
    """
    if not world.active:
        return
    every = gather_json(flat_config(recorded_config(cfg)))
    verdict = broadcast_json(_config_differences(every) if world.is_coordinator else None)
    if verdict:
        raise ConfigError(verdict)


def _config_differences(per_rank: list[dict]) -> str | None:
    keys = sorted(set().union(*per_rank))
    differ = [k for k in keys if len({repr(c.get(k, _ABSENT)) for c in per_rank}) > 1]
    if not differ:
        return None
    lines = [
        f"{k}: " + ", ".join(f"{c.get(k, _ABSENT)!r} on rank {r}" for r, c in enumerate(per_rank))
        for k in differ[:_SHOWN_KEYS]
    ]
    if len(differ) > _SHOWN_KEYS:
        lines.append(f"and {len(differ) - _SHOWN_KEYS} more key(s)")
    return (
        f"the {len(per_rank)} ranks were started with different configs ("
        + "; ".join(lines)
        + "). Start every rank with the same overrides and config files; a value that "
        "differs per rank usually comes from an ${oc.env:...} or ${now:...} interpolation"
    )


def same_data_on_every_rank(
    build: Callable[[], tuple[Source, Source | None]], world: World
) -> tuple[Source, Source | None]:
    """``build()``'s train and val sources, refused unless every rank read the same data.

    One config is not one dataset: ``data.path`` is read on each node, and two nodes whose
    copies differ (a stale rsync, another tokenizer version in the cache) trained silently
    on different data under one fingerprint, rank 0's; the next resume stopped one rank
    with a fingerprint error and left the others in a raw gloo traceback. Collective: every
    rank builds its sources, rank 0 compares the fingerprints and sample counts, and every
    rank raises the same :class:`DataPathError` naming each rank's. A rank whose data could
    not be read raises its own error; the others name it (they would wait for it otherwise).
    """
    if not world.active:
        return build()
    failed = None
    try:
        sources = build()
    except (ConfigError, DataPathError, DataFormatError) as err:
        failed = err
    mine = {"error": str(failed)} if failed else _data_identity(*sources)
    every = gather_json(mine)  # on rank 0 only
    verdict = broadcast_json(_data_differences(every) if world.is_coordinator else None)
    if failed:
        raise failed
    if verdict:
        raise DataPathError(verdict)
    return sources


def _data_identity(train: Source, val: Source | None) -> dict:
    return {
        "train": train.fingerprint,
        "samples": len(train),
        "val": val.fingerprint if val is not None else None,
    }


def _data_differences(per_rank: list[dict]) -> str | None:
    failed = [(r, d["error"]) for r, d in enumerate(per_rank) if "error" in d]
    if failed:
        return "; ".join(f"rank {r} could not read its data: {e}" for r, e in failed)
    if all(d == per_rank[0] for d in per_rank):
        return None
    seen = ", ".join(
        f"rank {r}: fingerprint {d['train']} ({d['samples']} samples, val {d['val']})"
        for r, d in enumerate(per_rank)
    )
    return (
        f"the {len(per_rank)} ranks read different data under one data.path ({seen}). Each "
        "node reads its own copy: make them identical (same files, same tokenizer, same "
        "data.* settings), e.g. by syncing the data directory to every node, then restart"
    )


def host_rng_start(cfg: DictConfig, world: World, meta: dict | None) -> str:
    """Set this rank's global Python/NumPy/torch RNGs for user code that draws from them
    (ftrain itself only uses the key chain): the states the checkpoint recorded for this
    rank, else seeded from ``trainer.seed``, the rank and the step. Returns what it did."""
    from ftrain import rng
    from ftrain.ckpt import hostrng

    step = int(meta.get("step") or 0) if meta else 0
    if meta:
        try:
            states = hostrng.for_rank(meta, world.rank)
        except CorruptCheckpointError as err:  # covered by the step's checksums: a bug
            states = None
            print(f"ftrain: warning: ignoring recorded host RNG states: {err}", file=sys.stderr)
        if states is not None:
            hostrng.restore(states)
            return f"host RNG states of rank {world.rank} restored from step {step}"
    key = rng.fold_in(rng.fold_in(rng.key(cfg.trainer.seed), "host-rng"), world.rank)
    hostrng.seed_all(rng.key_data(rng.fold_in(key, step)) % 2**63)
    where = "none recorded for this rank; " if meta else ""
    return f"host RNGs of rank {world.rank} seeded from trainer.seed ({where}step {step})"


def warmup_past_the_end(cfg: DictConfig) -> str | None:
    """A warning when the run ends inside its warmup (``schedule.warmup_steps`` at or past
    ``trainer.max_steps``): it never trains at ``optim.lr``; the start line only said the
    horizon had been stretched past the warmup."""
    s, end = cfg.schedule, int(cfg.trainer.max_steps)
    warmup = int(s.get("warmup_steps") or 0)
    kind = str(s.get("_target_") or s.get("name") or "").rsplit(".", 1)[-1]
    if kind != "warmup_cosine" or not 0 < end <= warmup:
        return None
    return (
        f"warning: schedule.warmup_steps={warmup} is not below trainer.max_steps={end}: this "
        f"run ends inside its warmup and never trains at optim.lr={cfg.optim.lr:g}; lower "
        "schedule.warmup_steps, or train longer"
    )


def schedule_line(cfg: DictConfig, horizon: int, saved: int | None) -> str:
    """What the LR schedule of this start does, with the horizon it actually uses and why.

    Args:
        horizon: from :func:`ftrain.cli.build.schedule_horizon`.
        saved: the horizon the resumed checkpoint recorded (``None``: fresh, or not recorded).
    """
    s = cfg.schedule
    kind = str(s.get("_target_") or s.get("name") or "").rsplit(".", 1)[-1]
    if kind == "constant":
        return f"lr schedule: constant at {cfg.optim.lr:g}"
    warmup = s.get("warmup_steps") or 0
    used = max(horizon, warmup + 1) if kind == "warmup_cosine" else horizon
    if s.get("decay_steps") is not None:
        why = "schedule.decay_steps"
        if saved is not None and saved != horizon:
            why += f"; the checkpoint had recorded {saved}"
    elif saved is not None:
        why = "as recorded; set schedule.decay_steps to change it"
    else:
        why = "trainer.max_steps of this first start, kept on resume"
    if used != horizon:
        why += f"; at least schedule.warmup_steps + 1 = {used}"
    if kind != "warmup_cosine":  # a user's schedule: what it is given, not what it does
        return f"lr schedule {s.get('_target_', kind)} gets a horizon of {used} steps ({why})"
    return f"lr schedule decays over {used} steps ({why})"
