"""The checkpoint-interval advisor: measured costs of one run -> the Young/Daly interval.

Checkpointing every ``tau`` seconds of training costs ``C/tau`` of the run in saves (``C``
= the part of a save that stalls training), and a failure loses on average ``tau/2`` of
work plus the restore time ``R``. The first-order optimum (Young 1974, Daly 2006) is

    tau* = sqrt(2 * C * MTBF)

Everything here is plain arithmetic over numbers ftrain already records (see
``docs/checkpoint-interval.md``):

- ``RUN_DIR/metrics.jsonl``: step records (step time), ``save_started`` events (blocking
  seconds of every save) and ``committed`` ones (when an async write ended: the steps it
  overlapped give its stall, :func:`_save_stalls`), ``start``/``resume`` events (restore
  seconds, redone steps, sessions);
- ``RUN_DIR/checkpoints/checkpoints.json`` (rebuilt from the steps if stale): bytes and
  total save seconds of each retained step, and the run's resolved config (the
  checkpoint policy and planned length) in the newest step's metadata.

Reading is read-only: unlike ``CheckpointManager(...)`` nothing is swept or rewritten,
so it is safe on a live run. ``ftrain.ckpt.advice_report.render`` prints an
:class:`Advice` as a table. Example::

    python -m ftrain.ckpt advise runs/default --mtbf 6h
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from ftrain.ckpt import commit as protocol
from ftrain.ckpt.format import read_json
from ftrain.ckpt.index import INDEX, load_or_rebuild
from ftrain.metrics import read_records

__all__ = [
    "Advice",
    "AdvisorError",
    "advise",
    "advised_every_steps",
    "current_every_steps",
    "Plan",
    "Policy",
    "RunStats",
    "estimate_mtbf",
    "expected_waste",
    "format_duration",
    "lost_work",
    "measure",
    "parse_duration",
    "peak_count",
    "plan",
    "restore_cost",
    "retained_count",
    "save_overhead",
    "saves_count",
    "young_daly",
]

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class AdvisorError(ValueError):
    """The run directory cannot be advised on (the message names the path and the fix)."""


# ---- arithmetic -------------------------------------------------------------------------
def parse_duration(text: str) -> float:
    """Seconds in ``"90s"``, ``"30m"``, ``"6h"``, ``"2d"`` or ``"1.5h"``.

    Raises:
        ValueError: no unit, an unknown unit, or a value that is not positive.

    Example:
        >>> parse_duration("6h")
        21600.0
    """
    if re.fullmatch(r"\s*-.*", str(text)):
        raise ValueError(f"a duration must be positive, got {text!r} (e.g. 90s, 30m, 6h, 2d)")
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read the duration {text!r}: write a number and a unit s, m, h or d "
            "(e.g. 90s, 30m, 6h, 2d)"
        )
    seconds = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not 0 < seconds < math.inf:
        raise ValueError(f"a duration must be positive and finite, got {text!r}")
    return seconds


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """The first-order optimal seconds between checkpoints, ``sqrt(2 * C * MTBF)``.

    Example:
        >>> young_daly(2.0, 3600.0)  # 2 s saves, a failure an hour
        120.0
    """
    if not mtbf_s > 0:
        raise ValueError(f"MTBF must be positive, got {mtbf_s=}")
    if cost_s < 0:
        raise ValueError(f"the save cost cannot be negative, got {cost_s=}")
    return math.sqrt(2.0 * cost_s * mtbf_s)


def save_overhead(cost_s: float, interval_s: float) -> float:
    """The fraction of training time spent stalled in saves, ``C / tau``."""
    if not interval_s > 0:
        raise ValueError(f"the interval must be positive, got {interval_s=}")
    return cost_s / interval_s


def lost_work(interval_s: float, restore_s: float) -> float:
    """Expected seconds lost per failure: half an interval redone plus the restore."""
    return interval_s / 2.0 + restore_s


def expected_waste(cost_s: float, interval_s: float, restore_s: float, mtbf_s: float) -> float:
    """First-order fraction of wall time wasted: ``C/tau + (tau/2 + R) / MTBF``."""
    return save_overhead(cost_s, interval_s) + lost_work(interval_s, restore_s) / mtbf_s


def estimate_mtbf(train_s: float, failures: int) -> float | None:
    """Training seconds per failure seen, or ``None`` when there was none to count."""
    return train_s / failures if failures > 0 and train_s > 0 else None


def saves_count(max_steps: int, every_steps: int | None) -> int:
    """Saves in a ``max_steps`` run: every multiple of ``every_steps`` plus the final step."""
    e = every_steps or max_steps
    return max_steps // e + (max_steps % e != 0) if max_steps > 0 else 0


def _saved_newest_first(max_steps: int, e: int):
    top = max_steps // e * e
    if top != max_steps:
        yield max_steps  # the final save, off the every_steps grid
    yield from range(top, 0, -e)


def retained_count(
    max_steps: int,
    every_steps: int | None,
    keep_last: int | None,
    keep_every: int | None,
    keep_best: int | None,
) -> int:
    """Checkpoints on disk at the end of a ``max_steps`` run saved every ``every_steps``.

    Saves happen at multiples of ``every_steps`` and at the final step; retention keeps the
    union of the last ``keep_last``, the saved multiples of ``keep_every`` and (an upper
    bound) ``keep_best`` more; no keep setting at all keeps every save. The newest save is
    always kept.

    Example:
        >>> retained_count(1000, 100, 3, 500, None)  # 800, 900, 1000 + 500
        4
    """
    saved = saves_count(max_steps, every_steps)
    if not (keep_last or keep_every or keep_best):
        return saved
    e = every_steps or max_steps
    last = set(itertools.islice(_saved_newest_first(max_steps, e), keep_last or 1))
    kept = len(last)
    if keep_every:
        keys = max_steps // math.lcm(e, keep_every)
        keys += max_steps % e != 0 and max_steps % keep_every == 0
        kept += keys - sum(1 for s in last if s % keep_every == 0)
    return min(saved, kept + (keep_best or 0))


def peak_count(
    max_steps: int,
    every_steps: int | None,
    keep_last: int | None,
    keep_every: int | None,
    keep_best: int | None,
) -> int:
    """Most checkpoints on disk at once: those kept before the last save plus the one being
    written (retention deletes only after a commit). Retention only grows over a run, so
    that moment is the final save.

    Example:
        >>> peak_count(1000, 100, 3, None, None)  # 800, 900, 1000 while 1000 is written
        4
    """
    prev = list(itertools.islice(_saved_newest_first(max_steps, every_steps or max_steps), 2))
    if len(prev) < 2:
        return len(prev)
    before = retained_count(prev[1], every_steps, keep_last, keep_every, keep_best)
    return max(before + 1, retained_count(max_steps, every_steps, keep_last, keep_every, keep_best))


def format_duration(seconds: float | None) -> str:
    """``0.0123 -> "12.3 ms"``, ``5400 -> "90 min"``, ``None -> "-"`` (three significant digits)."""
    if seconds is None:
        return "-"
    for limit, unit, scale in (
        (1, "ms", 1e-3),
        (120, "s", 1),
        (7200, "min", 60),
        (172800, "h", 3600),
    ):
        if seconds < limit:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 86400:.3g} d"


# ---- the run's measurements -------------------------------------------------------------
@dataclass(frozen=True)
class Policy:
    """The run's checkpoint settings and planned length (from its newest checkpoint)."""

    every_steps: int | None = None
    every_seconds: float | None = None
    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    max_steps: int | None = None
    async_save: bool = True


@dataclass(frozen=True)
class RunStats:
    """What one run directory says about its costs (seconds, bytes) and its history."""

    run_dir: Path
    policy: Policy
    step_s: float
    n_steps: int
    blocking_s: float
    n_saves: int
    total_s: float | None
    n_total: int
    restore_s: float | None
    n_restores: int
    size_bytes: int
    disk_bytes: int
    size_step: int
    train_s: float
    sessions: int
    failures: int
    continuations: int
    redo_steps: int
    stall_s: float | None = None
    n_stalls: int = 0

    @property
    def cost_s(self) -> float:
        """C: what one save costs training. A sync save stalls for its blocking time; an
        async one also for the slowdown of the steps its write overlapped (the writer's
        CPU, memory bandwidth and disk compete with training), when that was measured."""
        if self.policy.async_save and self.stall_s is not None:
            return max(self.blocking_s, self.stall_s)
        return self.blocking_s


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _sessions(records: list[dict]) -> list[list[dict]]:
    """Split the record stream at ``start``/``resume`` events (one list per process)."""
    out: list[list[dict]] = []
    for r in records:
        if r.get("kind") in ("start", "resume") or not out:
            out.append([])
        out[-1].append(r)
    return out


def _step_spans(session: list[dict]) -> list[tuple[float, float]]:
    """``(time of step n's record, time of step n+1's)`` for consecutive steps of one process."""
    steps = [r for r in session if r.get("kind") == "step" and isinstance(r.get("step"), int)]
    return [
        (a["time"], b["time"])
        for a, b in zip(steps, steps[1:], strict=False)
        if b["step"] == a["step"] + 1 and b["time"] > a["time"]
    ]


def _step_deltas(session: list[dict]) -> list[float]:
    """Seconds per step between successive step records of one process. Consecutive steps
    give their gap as it is (the median drops save and eval spikes). With
    ``trainer.log_every=k`` a gap spans k steps and, with ``every_steps`` or ``eval_every``
    a multiple of k, holds a save or an eval every time, which the median cannot drop: a
    save's ``blocking_s`` and an eval's time (from its step's record to the ``eval``
    record) are taken out first; a gap whose pauses cannot be timed is used only when no
    other is left."""
    timed, untimed = [], []
    last, pause = None, _Pause()
    for r in session:
        if r.get("kind") == "step" and isinstance(r.get("step"), int):
            if last is not None and r["step"] > last["step"] and r["time"] > last["time"]:
                span, gap = r["step"] - last["step"], r["time"] - last["time"]
                work = gap if span == 1 else gap - pause.seconds
                ok = span == 1 or (pause.timed and work > 0)
                (timed if ok else untimed).append((work if ok else gap) / span)
            last, pause = r, _Pause()
        elif last is not None:
            pause.add(r, last)
    return timed or untimed


class _Pause:
    """The saves and evals between two step records, and whether each could be timed."""

    def __init__(self) -> None:
        self.seconds, self.timed, self._prev = 0.0, True, None

    def add(self, r: dict, step_record: dict) -> None:
        kind = r.get("kind")
        if kind in ("save_started", "save"):
            blocking = r.get("blocking_s")
            self.timed &= _number(blocking)
            self.seconds += blocking if _number(blocking) else 0.0
        elif kind == "eval":  # timed when it directly follows its own step's record
            own = self._prev is None and r.get("step") == step_record["step"]
            self.timed &= own
            self.seconds += r["time"] - step_record["time"] if own else 0.0
        self._prev = r


def _save_stalls(sessions: list[list[dict]]) -> list[float]:
    """Per async save: how much longer than the process's median step the steps took whose
    step-to-step interval overlapped its write (``save_started`` minus its blocking time,
    to that plus the ``committed`` record's ``after_s``). The step that ran the blocking
    part is one of them, so the figure includes it; a save whose commit was not recorded
    (the process died, or it failed) is left out.

    An interval is counted from the latest of its start, the save's start and the end of
    an eval in it (the ``eval`` record): an eval run before the save at the same step (the
    default configs save on eval steps) or later in the write is the eval's time, not the
    save's."""
    stalls = []
    for session in sessions:
        spans = _step_spans(session)  # in time order, as one process wrote them
        if len(spans) < 3:
            continue
        median = statistics.median(b - a for a, b in spans)
        ends = [b for _, b in spans]
        evals = sorted(r["time"] for r in session if r.get("kind") == "eval")
        for lo, hi in _write_windows(session):
            over = [
                b - _counted_from(a, b, lo, evals) - median
                for a, b in _overlapping(spans, ends, lo, hi)
            ]
            if over:
                stalls.append(sum(over))
    return stalls


def _overlapping(spans: list[tuple[float, float]], ends: list[float], lo: float, hi: float):
    """The spans ``(a, b)`` with ``b > lo`` and ``a < hi``, found by bisection on their
    (time-ordered) ends: a long run has ~1e5 step spans and ~1e3 saves."""
    i = bisect.bisect_right(ends, lo)
    while i < len(spans) and spans[i][0] < hi:
        yield spans[i]
        i += 1


def _counted_from(a: float, b: float, save_start: float, evals: list[float]) -> float:
    """Where the step span ``(a, b)`` starts counting for a save: not before the save
    started, and after the last eval that ended inside it (``evals`` sorted)."""
    last = bisect.bisect_left(evals, b) - 1  # the last eval before b
    inside = evals[last] if last >= 0 and evals[last] > a else a
    return max(a, save_start, inside)


def _write_windows(session: list[dict]) -> list[tuple[float, float]]:
    """``(start, commit)`` wall times of the session's async saves whose commit it recorded."""
    started: dict[int, float] = {}
    windows = []
    for r in session:
        kind, step = r.get("kind"), r.get("step")
        if kind == "save_started" and r.get("async_save") and _number(r.get("blocking_s")):
            started[step] = r["time"] - r["blocking_s"]
        elif kind == "committed" and step in started and _number(r.get("after_s")):
            t0 = started.pop(step)
            windows.append((t0, t0 + r["after_s"]))
    return windows


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _history(sessions: list[list[dict]]) -> dict:
    """Training seconds, failures (a restart after a process that did not reach ``end``:
    a resume, or a fresh start when it died before its first commit), planned
    continuations (a resume after ``end``) and redone steps."""
    train = sum(max(r["time"] for r in s) - min(r["time"] for r in s) for s in sessions)
    failures = continuations = redo = 0
    for prev, cur in zip(sessions, sessions[1:], strict=False):
        if cur[0].get("kind") not in ("resume", "start"):
            continue
        if prev[-1].get("kind") != "end":
            failures += 1
        elif cur[0].get("kind") == "resume":
            continuations += 1
        else:  # a fresh start after an end is a new run: nothing of the old one is redone
            continue
        span = cur[0].get("redo")
        if isinstance(span, list) and len(span) == 2:
            redo += span[1] - span[0] + 1
    return {"train": train, "failures": failures, "continuations": continuations, "redo": redo}


def _policy(config: dict) -> Policy:
    c, t = config.get("checkpoint") or {}, config.get("trainer") or {}
    return Policy(
        every_steps=c.get("every_steps"),
        every_seconds=c.get("every_seconds"),
        keep_last=c.get("keep_last"),
        keep_every=c.get("keep_every"),
        keep_best=c.get("keep_best"),
        max_steps=t.get("max_steps"),
        async_save=bool(c.get("async_save", True)),
    )


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _read_checkpoints(ckpt_dir: Path) -> tuple[list[dict], dict]:
    """(index entries ascending, newest step's root attributes)."""
    steps = protocol.committed_steps(ckpt_dir)
    entries = load_or_rebuild(ckpt_dir / INDEX, steps)
    if not entries:
        raise AdvisorError(
            f"{ckpt_dir} holds no committed checkpoint, so there is no save cost to measure; "
            "train until at least one checkpoint is committed (checkpoint.every_steps=N), then "
            "advise again (a run with checkpoint.dir elsewhere: advisor.measure(run_dir, ckpt_dir))"
        )
    newest = entries[max(entries)]
    attrs = read_json(Path(newest["path"]) / "zarr.json").get("attributes", {})
    return [entries[s] for s in sorted(entries)], attrs


def measure(run_dir: str | Path, ckpt_dir: str | Path | None = None) -> RunStats:
    """Read a run directory (``metrics.jsonl`` + ``checkpoints/``) into :class:`RunStats`.

    Args:
        run_dir: the run's ``run.dir``.
        ckpt_dir: its checkpoint directory (default ``RUN_DIR/checkpoints``).

    Raises:
        AdvisorError: not a run directory, no step records, or no committed checkpoint.
    """
    run_dir = Path(run_dir)
    ckpt_dir = Path(ckpt_dir) if ckpt_dir else run_dir / "checkpoints"
    if not (run_dir / "metrics.jsonl").is_file():
        hint = (
            f" (it looks like a checkpoint directory: try {run_dir.parent})"
            if (run_dir / INDEX).exists() or protocol.committed_steps(run_dir)
            else ""
        )
        raise AdvisorError(
            f"{run_dir} is not an ftrain run directory: it has no metrics.jsonl{hint}; pass the "
            "run.dir of a run started with `python -m ftrain`"
        )
    records = [r for r in read_records(run_dir) if isinstance(r.get("time"), int | float)]
    sessions = _sessions(records)
    deltas = [d for s in sessions for d in _step_deltas(s)]
    if not deltas:
        raise AdvisorError(
            f"{run_dir}/metrics.jsonl has fewer than two step records of one process; "
            "train for a few steps before asking for advice"
        )
    entries, attrs = _read_checkpoints(ckpt_dir)
    # "save_started" since saves and commits are recorded apart; "save" in older runs
    blocking = [
        r["blocking_s"]
        for r in records
        if r.get("kind") in ("save_started", "save")
        and isinstance(r.get("blocking_s"), int | float)
    ]
    blocking = blocking or [e["blocking_seconds"] for e in entries if e.get("blocking_seconds")]
    totals = [e["save_seconds"] for e in entries if e.get("save_seconds") is not None]
    restores = [r["restore_s"] for r in records if r.get("kind") == "resume" and r.get("restore_s")]
    hist = _history(sessions)
    stalls = _save_stalls(sessions)
    newest = entries[-1]
    return RunStats(
        run_dir=run_dir,
        policy=_policy(attrs.get("config") or {}),
        step_s=statistics.median(deltas),
        n_steps=len(deltas),
        blocking_s=_median(blocking) or 0.0,
        n_saves=len(blocking),
        total_s=_median(totals),
        n_total=len(totals),
        restore_s=_median(restores),
        n_restores=len(restores),
        size_bytes=int(newest.get("bytes", 0)),
        disk_bytes=_disk_bytes(Path(newest["path"])),
        size_step=int(newest["step"]),
        train_s=hist["train"],
        sessions=len(sessions),
        failures=hist["failures"],
        continuations=hist["continuations"],
        redo_steps=hist["redo"],
        stall_s=_median(stalls),
        n_stalls=len(stalls),
    )


# ---- plans: one column of the table ------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """One checkpoint interval and what it costs under the measured numbers."""

    label: str
    every_steps: int
    interval_s: float
    overhead: float
    lost_s: float
    lost_steps: float
    waste: float | None
    kept: int
    peak: int
    storage_bytes: int


def current_every_steps(stats: RunStats) -> int:
    """Steps between saves under the run's policy (``every_seconds`` converted by step time)."""
    p = stats.policy
    candidates = [p.every_steps] if p.every_steps else []
    if p.every_seconds:
        candidates.append(max(1, round(p.every_seconds / stats.step_s)))
    return min(candidates) if candidates else max(1, p.max_steps or stats.size_step)


def restore_cost(stats: RunStats) -> float:
    """The measured restore cost, or the total save time as a proxy before any resume."""
    return stats.restore_s if stats.restore_s is not None else (stats.total_s or 0.0)


def plan(
    stats: RunStats, label: str, every_steps: int, mtbf_s: float | None, cost_s: float
) -> Plan:
    """Overhead (at save cost ``cost_s``), lost work and storage of saving every ``every_steps``."""
    p = stats.policy
    interval = every_steps * stats.step_s
    restore = restore_cost(stats)
    lost = lost_work(interval, restore)
    length = p.max_steps or stats.size_step
    keep = (p.keep_last, p.keep_every, p.keep_best)
    kept, peak = retained_count(length, every_steps, *keep), peak_count(length, every_steps, *keep)
    return Plan(
        label=label,
        every_steps=every_steps,
        interval_s=interval,
        overhead=save_overhead(cost_s, interval),
        lost_s=lost,
        lost_steps=lost / stats.step_s,
        waste=None if mtbf_s is None else expected_waste(cost_s, interval, restore, mtbf_s),
        kept=kept,
        peak=peak,
        storage_bytes=peak * stats.disk_bytes,
    )


def advised_every_steps(stats: RunStats, cost_s: float, mtbf_s: float) -> int:
    """``tau*`` in whole steps, at least one step and (async) at least one full save long:
    with at most one save in flight, a shorter interval makes the next save wait."""
    tau = young_daly(cost_s, mtbf_s)
    if stats.policy.async_save and stats.total_s:
        tau = max(tau, stats.total_s)
    return max(1, round(tau / stats.step_s))


@dataclass(frozen=True)
class Advice:
    """The current plan, the advised ones (``None`` without an MTBF) and where MTBF came from."""

    stats: RunStats
    mtbf_s: float | None
    mtbf_source: str
    current: Plan
    advised: Plan | None
    advised_total: Plan | None

    @property
    def recommendation(self) -> str:
        """``checkpoint.every_steps=N`` (plus ``every_seconds=null`` if that would fire first)."""
        if self.advised is None:
            return "none yet: pass --mtbf DURATION (e.g. --mtbf 6h) to size the interval"
        line = f"checkpoint.every_steps={self.advised.every_steps}"
        if self.stats.policy.every_seconds:
            line += " checkpoint.every_seconds=null"
        return line


def advise(stats: RunStats, mtbf_s: float | None = None) -> Advice:
    """Plans for the current interval and the Young/Daly one (at ``stats.cost_s``, and for
    async saves also at the total save cost).

    ``mtbf_s`` given wins; otherwise it is estimated from the failures in the history.
    """
    source = "--mtbf"
    if mtbf_s is None:
        mtbf_s = estimate_mtbf(stats.train_s, stats.failures)
        source = (
            f"estimated: {format_duration(stats.train_s)} of training / {stats.failures} failure(s)"
            if mtbf_s is not None
            else f"unknown: no failure in {format_duration(stats.train_s)} of training"
        )
    cost = stats.cost_s
    current = plan(stats, "current", current_every_steps(stats), mtbf_s, cost)
    advised = total = None
    if mtbf_s is not None:
        advised = plan(stats, "advised", advised_every_steps(stats, cost, mtbf_s), mtbf_s, cost)
        if stats.policy.async_save and stats.total_s is not None:
            n = advised_every_steps(stats, stats.total_s, mtbf_s)
            total = plan(stats, "advised, C=total", n, mtbf_s, stats.total_s)
    return Advice(stats, mtbf_s, source, current, advised, total)
