"""Save and keep policies: tiny dataclasses with one method each, composed with ``AnyOf``.

Save policies answer ``should_save(ctx) -> bool`` for a step offered to
``CheckpointManager.save`` (``force=True`` bypasses them)::

    AnyOf(EveryNSteps(100), EveryNSeconds(600))

Keep policies answer ``keep(infos, now) -> set[int]``: the steps they want kept among
the committed ones. A step survives if any policy keeps it; the manager always keeps the
newest committed step and never touches an in-flight one::

    AnyOf(LatestN(3), EveryKSteps(1000), BestN("val_loss", 2, mode="min"))
"""

from __future__ import annotations

import difflib
import logging
import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

__all__ = [
    "newest_finite",
    "AnyOf",
    "BestN",
    "EveryKSteps",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepAll",
    "KeepPolicy",
    "LatestN",
    "SaveContext",
    "SavePolicy",
    "StepInfo",
    "YoungerThan",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveContext:
    """What a save policy sees: the offered step and the last committed/accepted save.

    ``now`` and ``last_time`` are ``time.monotonic()`` seconds (never the wall clock, which
    an NTP correction can step back by an hour and so stop time-based saves): compare
    them with each other only.
    """

    step: int
    now: float
    last_step: int | None
    last_time: float | None


@dataclass(frozen=True)
class StepInfo:
    """What a keep policy sees about one committed step."""

    step: int
    time: float
    metrics: dict = field(default_factory=dict)


class SavePolicy(Protocol):
    def should_save(self, ctx: SaveContext) -> bool: ...


class KeepPolicy(Protocol):
    def keep(self, infos: list[StepInfo], now: float) -> set[int]: ...


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {name}={value!r}")


def _count(name: str, value: int) -> None:
    """A number of steps or checkpoints: a whole number > 0 (1.5 was accepted)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a whole number, got {name}={value!r}")
    _positive(name, value)


_SAVE_POLICIES = "EveryNSteps, EveryNSeconds, AnyOf of them, or an object with should_save(ctx)"
_KEEP_POLICIES = (
    "LatestN, EveryKSteps, BestN, YoungerThan, KeepAll, AnyOf of them, "
    "or an object with keep(infos, now)"
)


def check_policy(policy: object, method: str, arg: str) -> None:
    """``policy`` (and each member of an ``AnyOf``) has ``method``: a keep policy passed as
    the save policy (``EveryNSteps`` for ``EveryKSteps``) failed only at the first save or,
    worse, in the background after the first commit.

    Raises:
        TypeError: naming the policy and what ``arg`` takes.
    """
    if policy is None:
        return
    members = policy.policies if isinstance(policy, AnyOf) else (policy,)
    for p in members:
        if isinstance(p, AnyOf):
            check_policy(p, method, arg)
        elif isinstance(p, type):  # KeepAll for KeepAll(): keep() unbound, failing every commit
            raise TypeError(
                f"{arg}={p.__name__} is a class: pass an instance, e.g. {p.__name__}() or "
                f"{p.__name__}(...) with its arguments"
            )
        elif not callable(getattr(p, method, None)):
            takes = _SAVE_POLICIES if method == "should_save" else _KEEP_POLICIES
            raise TypeError(f"{arg}={p!r} has no {method}(): {arg} takes {takes}")


@dataclass(frozen=True)
class EveryNSteps:
    """Save when ``step % n == 0``. Example: ``EveryNSteps(100)``."""

    n: int

    def __post_init__(self) -> None:
        _count("n", self.n)

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % self.n == 0


@dataclass(frozen=True)
class EveryNSeconds:
    """Save when ``seconds`` have passed since the last save (or none was made yet)."""

    seconds: float

    def __post_init__(self) -> None:
        _positive("seconds", self.seconds)

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.last_time is None or ctx.now - ctx.last_time >= self.seconds


@dataclass(frozen=True)
class LatestN:
    """Keep the ``n`` newest steps."""

    n: int

    def __post_init__(self) -> None:
        _count("n", self.n)

    def keep(self, infos: list[StepInfo], now: float) -> set[int]:
        return {i.step for i in sorted(infos, key=lambda i: i.step)[-self.n :]}


@dataclass(frozen=True)
class EveryKSteps:
    """Keep "key" checkpoints: steps divisible by ``k``."""

    k: int

    def __post_init__(self) -> None:
        _count("k", self.k)

    def keep(self, infos: list[StepInfo], now: float) -> set[int]:
        return {i.step for i in infos if i.step % self.k == 0}


@dataclass(frozen=True)
class BestN:
    """Keep the ``n`` best steps by ``metrics[metric]`` (``mode`` "min" or "max").

    Steps without the metric (or with a non-finite value) are not kept by this policy.
    While no committed step has it (a misspelt name, metrics not passed to ``save``, no
    evaluation yet) it ranks nothing: as the manager's only keep policy it then deletes
    nothing (:func:`ranks_nothing`: a misspelt metric deleted all but the newest step, the
    best among them), and a name close to one the steps have is warned about once.
    """

    metric: str
    n: int
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(
                f"metric must be the name of a metric passed to save(metrics=...), got "
                f"metric={self.metric!r} (BestN(metric, n): the name comes first)"
            )
        _count("n", self.n)
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got mode={self.mode!r}")

    def ranked(self, infos: list[StepInfo]) -> list[int]:
        """Steps with a finite value of the metric, best first (ties: newer first)."""
        scored = []
        for i in infos:
            v = finite_number(i.metrics.get(self.metric))
            if v is not None:
                scored.append((v if self.mode == "min" else -v, -i.step))
        return [-s for _, s in sorted(scored)]

    def keep(self, infos: list[StepInfo], now: float) -> set[int]:
        ranked = self.ranked(infos)
        if not ranked and infos:
            _say_close_name(self, infos)
        return set(ranked[: self.n])


def ranks_nothing(policy: object, infos: list[StepInfo]) -> bool:
    """``policy`` is a lone :class:`BestN` that ranks none of ``infos``: the manager then
    deletes nothing, and says so once (which steps are best is not known yet, or never)."""
    if not isinstance(policy, BestN) or not infos or policy.ranked(infos):
        return False
    if len(infos) > policy.n:
        _say_once(
            ("lone", policy),
            "ftrain: keep policy %r ranks no committed step (none has a finite %r; their "
            "metrics: %s): nothing is deleted until one does",
            policy,
            policy.metric,
            ", ".join(_metric_names(infos)) or "none",
        )
    return True


_SAID: set = set()


def _say_once(key, message: str, *args) -> None:
    if key not in _SAID:
        _SAID.add(key)
        log.warning(message, *args)


def _metric_names(infos: list[StepInfo]) -> list[str]:
    return sorted({k for i in infos for k in i.metrics if isinstance(k, str)})


def _say_close_name(policy: BestN, infos: list[StepInfo]) -> None:
    """A metric no step has but one nearly named (``val_los`` beside ``val_loss``): the
    steps this policy should keep are deleted by the others' rules, so say it once. A name
    merely not reported yet (``val_loss`` before the first evaluation) is not close to
    ``loss``: nothing said."""
    close = difflib.get_close_matches(policy.metric, _metric_names(infos), n=1, cutoff=0.8)
    if close:
        _say_once(
            ("close", policy),
            "ftrain: keep policy %r: no committed step has %r, but they have %r: is that the "
            "metric meant? (steps are kept by their metrics as save(..., metrics=) passed them)",
            policy,
            policy.metric,
            close[0],
        )


def finite_number(v: object) -> float | None:
    """``v`` as a finite float, else ``None`` (a 400-digit integer in a hand-edited index
    overflowed ``math.isfinite`` and stopped every start that keeps the best steps)."""
    if not isinstance(v, int | float):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


@dataclass(frozen=True)
class YoungerThan:
    """Keep every step saved less than ``seconds`` ago."""

    seconds: float

    def __post_init__(self) -> None:
        _positive("seconds", self.seconds)

    def keep(self, infos: list[StepInfo], now: float) -> set[int]:
        return {i.step for i in infos if now - i.time < self.seconds}


@dataclass(frozen=True)
class KeepAll:
    """Keep every step (the default)."""

    def keep(self, infos: list[StepInfo], now: float) -> set[int]:
        return {i.step for i in infos}


class AnyOf:
    """True / kept if any member policy says so. Works for save and keep policies."""

    def __init__(self, *policies: SavePolicy | KeepPolicy) -> None:
        if not policies:
            raise ValueError("AnyOf needs at least one policy, got none")
        self.policies = policies

    def __repr__(self) -> str:
        return f"AnyOf{self.policies!r}"

    def should_save(self, ctx: SaveContext) -> bool:
        return any(p.should_save(ctx) for p in self.policies)  # type: ignore[union-attr]

    def keep(self, infos: list[StepInfo], now: float) -> set[int]:
        kept: set[int] = set()
        for p in self.policies:
            kept |= p.keep(infos, now)  # type: ignore[union-attr]
        return kept


def best_policies(policy: object) -> list[BestN]:
    """Every ``BestN`` inside a (possibly composed) keep policy (for the index's flags)."""
    if isinstance(policy, BestN):
        return [policy]
    if isinstance(policy, AnyOf):
        return [b for p in policy.policies for b in best_policies(p)]
    return []


def _is_finite_entry(entry: dict) -> bool:
    for v in (entry.get("metrics") or {}).values():
        if isinstance(v, str) and v.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
            return False
        if isinstance(v, float) and not math.isfinite(v):
            return False
    return True


def newest_finite(entries: dict[int, dict]) -> set[int]:
    """The newest step whose recorded metrics are all finite (or that recorded none)."""
    finite = [s for s, e in entries.items() if _is_finite_entry(e)]
    return {max(finite)} if finite else set()
