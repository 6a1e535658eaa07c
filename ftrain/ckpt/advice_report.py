"""The checkpoint-interval advice as text: a table of measurements, one of plans, notes,
and a last line ``recommendation: checkpoint.every_steps=N`` (see ``ftrain.ckpt.advisor``).
"""

from __future__ import annotations

import math

from ftrain.ckpt.advisor import Advice, Plan, plan, young_daly
from ftrain.ckpt.advisor import format_duration as _dur

__all__ = ["render"]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.3g}%"


def _divisors(k: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(k) + 1) if k % d == 0]
    return small + [k // d for d in small]


def _count(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def _measured_rows(a: Advice) -> list[tuple[str, str, str]]:
    s = a.stats
    kind = "async" if s.policy.async_save else "sync"
    restore_note = (
        f"median of {s.n_restores} resume(s) (metrics.jsonl resume restore_s)"
        if s.restore_s is not None
        else "not measured yet (no resume): total save time used as a proxy"
    )
    return [
        (
            "step time",
            _dur(s.step_s),
            f"median of {s.n_steps:,} gaps between step records, per step (metrics.jsonl)",
        ),
        *_cost_rows(s, kind),
        (
            "save cost (total)",
            _dur(s.total_s),
            f"median of {s.n_total} retained saves (checkpoints.json save_seconds)",
        ),
        ("restore cost R", _dur(s.restore_s), restore_note),
        (
            "checkpoint size",
            _size(s.disk_bytes),
            f"on disk; step {s.size_step}: {s.size_bytes:,} array bytes (checkpoints.json)",
        ),
        (
            "history",
            f"{s.sessions} process(es)",
            f"{_dur(s.train_s)} training, {s.failures} failure(s), {s.continuations} planned continuation(s), {s.redo_steps} step(s) redone",
        ),
        ("MTBF", _dur(a.mtbf_s), a.mtbf_source),
    ]


_UNMEASURED = (
    "; the async stall is not measured yet (it needs step records of consecutive steps, "
    "trainer.log_every=1, around a few async saves)"
)


def _cost_rows(s, kind: str) -> list[tuple[str, str, str]]:
    """C, and what it is made of: blocking only (sync, or an async stall not measured yet),
    or the measured stall of async saves with their blocking part beside it."""
    blocking = f"median of {s.n_saves:,} {kind} saves (metrics.jsonl save blocking_s)"
    if not (s.policy.async_save and s.stall_s is not None):
        note = "" if not s.policy.async_save else _UNMEASURED
        return [("save cost C (blocking)", _dur(s.blocking_s), blocking + note)]
    return [
        (
            "save cost C (stall)",
            _dur(s.cost_s),
            f"median of {s.n_stalls:,} async saves: the steps each write overlapped, beyond "
            "the median step (metrics.jsonl)",
        ),
        ("save cost (blocking)", _dur(s.blocking_s), blocking),
    ]


def _plan_rows(plans: list[Plan]) -> list[tuple[str, ...]]:
    return [
        ("", *(p.label for p in plans)),
        ("checkpoint.every_steps", *(str(p.every_steps) for p in plans)),
        ("interval tau", *(_dur(p.interval_s) for p in plans)),
        ("save overhead C/tau", *(_pct(p.overhead) for p in plans)),
        (
            "lost work per failure",
            *(f"{_dur(p.lost_s)} ({_count(p.lost_steps)} steps)" for p in plans),
        ),
        ("expected waste", *(_pct(p.waste) for p in plans)),
        ("checkpoints kept / peak", *(f"{p.kept} / {p.peak}" for p in plans)),
        ("storage (peak)", *(_size(p.storage_bytes) for p in plans)),
    ]


def _notes(a: Advice) -> list[str]:
    s, notes = a.stats, []
    if a.mtbf_s is not None and a.advised is not None:
        tau = young_daly(s.cost_s, a.mtbf_s)
        if s.policy.async_save and s.total_s and s.total_s > tau:
            notes.append(
                f"tau* = {_dur(tau)} was raised to one full save ({_dur(s.total_s)}): with at "
                "most one save in flight, saving more often makes the next save wait"
            )
        if tau > a.mtbf_s:
            notes.append("tau* exceeds the MTBF: the first-order model does not hold there")
        k, n = s.policy.keep_every, a.advised.every_steps
        if k and k % n:
            d = min(_divisors(k), key=lambda d: abs(math.log(d / n)))
            notes.append(
                f"keep_every={k} keeps saved steps divisible by {k}, which with every_steps={n} "
                f"is only every {math.lcm(n, k)} steps; every_steps={d} divides it and costs "
                f"{_pct(plan(s, 'aligned', d, a.mtbf_s, s.cost_s).waste)} "
                "expected waste"
            )
        length = s.policy.max_steps or 0
        if length and a.advised.every_steps >= length:
            notes.append(f"the advised interval is longer than the run ({length} steps)")
    if a.mtbf_source.startswith("estimated") and s.failures < 5:
        notes.append(f"MTBF from {s.failures} failure(s) is noisy; pass --mtbf if you know better")
    return notes


def _table(rows: list[tuple[str, ...]], widths: list[int]) -> list[str]:
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in rows
    ]


def render(a: Advice) -> str:
    """The advice as a table plus a one-line ``recommendation:``."""
    plans = [p for p in (a.current, a.advised, a.advised_total) if p is not None]
    lines = [
        f"checkpoint-interval advice for {a.stats.run_dir}",
        "  Young/Daly, first order: tau* = sqrt(2 * C * MTBF); see docs/checkpoint-interval.md",
        "",
        "measured",
        *_table(_measured_rows(a), [24, 14, 0]),
        "",
        *_table(_plan_rows(plans), [24] + [22] * len(plans)),
    ]
    notes = [f"note: {n}" for n in _notes(a)]
    lines += ["", *notes] if notes else []
    return "\n".join([*lines, "", f"recommendation: {a.recommendation}"])
