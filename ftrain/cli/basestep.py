"""Which step of ``init.from``'s base run a fresh start reads: one step on every rank and
on every attempt of the run.

``init.from=RUN`` (no step) means the base's newest step that verifies. Read by each rank
on its own, a base still training (which the docs allow), a retention removing a step
mid-read, or nodes holding different copies gave the ranks different frozen weights:
gradients of different models were averaged into the adapters, exit 0. And a fine-tune
killed before its first commit re-read the base on its restart, a newer step by then:
the steps it redid trained from another base.

So: the step an earlier start of this run read (its ``start`` record's ``init_step``,
``metrics.jsonl``) is read again while the base holds it; otherwise the coordinator reads
the newest step that verifies, and every other rank reads that very step. Every rank
reports; one failure stops them all with its reason.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig
from tensordict import TensorDictBase

from ftrain.ckpt.readonly import StepSpecError
from ftrain.cli.finetune import init_from, parse_init_from
from ftrain.config import ConfigError
from ftrain.dist import World, broadcast_json, gather_json
from ftrain.metrics.history import read_history

__all__ = ["agreed_init_from", "earlier_init_step"]


def earlier_init_step(run_dir: Path, value: str) -> int | None:
    """The base step the latest earlier start of this run read for ``init.from=value``."""
    found = None
    for r in read_history(run_dir):
        step = r.get("init_step")
        if r.get("kind") == "start" and r.get("init_from") == value and type(step) is int:
            found = step
    return found


def agreed_init_from(
    cfg: DictConfig, fresh: TensorDictBase, world: World
) -> tuple[TensorDictBase, str, int]:
    """:func:`~ftrain.cli.finetune.init_from` with the step agreed (module docstring):
    ``(state, report line, step read)`` on every rank.

    Raises:
        ConfigError: on every rank, with the reason of each rank that could not read it.
    """
    read: tuple | None = None
    error: Exception | None = None
    if world.is_coordinator:
        try:
            read = _coordinator_read(cfg, fresh)
        except Exception as err:  # any kind: the other ranks wait in the broadcast
            error = err
    chosen = broadcast_json(
        (_outcome(error) if error else {"step": read[2]}) if world.is_coordinator else None
    )
    if error is not None:
        raise error
    if "error" in chosen:
        raise ConfigError(
            f"init.from: the coordinator (rank 0) could not read the base: {chosen['error']}"
        )
    if read is None:
        try:
            read = init_from(cfg, fresh, step=chosen["step"])
        except Exception as err:  # any kind: every rank gathers
            error = err
    reports = gather_json(_outcome(error) if error else {"ok": True})
    failed = broadcast_json(_failures(reports) if world.is_coordinator else None)
    if error is not None and not isinstance(error, ConfigError):
        raise error  # its own kind (a store outage, a machine limit) decides its exit
    if failed:
        raise ConfigError(
            f"init.from={cfg.init['from']!r}: step {chosen['step']} (the coordinator's) could "
            f"not be read on every rank: {failed}"
        ) from error
    return read


def _outcome(err: Exception) -> dict:
    return {"error": str(err) if isinstance(err, ConfigError) else f"{type(err).__name__}: {err}"}


def _failures(reports: list[dict]) -> str | None:
    bad = [f"rank {r}: {o['error']}" for r, o in enumerate(reports) if "error" in o]
    return "; ".join(bad) or None


def _coordinator_read(cfg: DictConfig, fresh: TensorDictBase) -> tuple:
    """The step an earlier start read, while the base holds it; else as ``init.from``
    says (its newest step that verifies, unless it names one)."""
    value = str(cfg.init["from"])
    try:
        _, named = parse_init_from(value)
    except StepSpecError as err:  # RUN:abc: one line, exit 2
        raise ConfigError(f"init.from={value!r}: {err}") from None
    # resume=none starts over (its records are moved aside after this): nothing to keep
    again = named is None and cfg.resume != "none"
    earlier = earlier_init_step(Path(cfg.run.dir), value) if again else None
    if earlier is None:
        return init_from(cfg, fresh)
    try:
        state, line, step = init_from(cfg, fresh, step=earlier)
    except ConfigError as err:  # gone (retention) or damaged since: the newest, said
        state, line, step = init_from(cfg, fresh)
        return state, f"{line} (the step this run's earlier start read, {earlier}: {err})", step
    return state, f"{line}, as this run's earlier start read", step
