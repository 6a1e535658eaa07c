"""The run's records as the start-up checks read them: parsed once per process.

A start asks the records several questions (which steps were committed, reached,
evaluated; what the last process did; what an earlier start read), each once or more. A
run logging every step for days holds millions of lines, and each full read took seconds
(300,000 records: ~2 s a read, four reads at every restart). :func:`read_history` parses
the file once and keeps what those questions use: every record but the ``step`` ones as it
is, and each run of consecutive ``step`` records as one stand-in record holding just their
step numbers (8 bytes a step). The file is append-only, so a later call parses only what was
appended since; a file replaced, truncated or rewritten in place (the last 64 bytes before
the end of the last parse differ: a rewrite elsewhere of the same length is not noticed,
which no writer of the records does) is read again whole. Bad lines are skipped and warned about as
:func:`~ftrain.metrics.jsonl.read_records` does, once per parse.
"""

from __future__ import annotations

import logging
import os
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ftrain.metrics.jsonl import parse_line

__all__ = [
    "SETS_ASIDE",
    "STEP_RUN",
    "commits_on_line",
    "forget_history",
    "read_history",
    "replay_for",
    "went_back",
]

log = logging.getLogger(__name__)

# ``kind`` of the stand-in for consecutive step records (no writer uses it: not a name)
STEP_RUN = "(steps)"

# records of a save whose write has begun: the manager sets the history a go-back leaves
# aside as the write starts (CheckpointManager._set_aside_old_history)
SETS_ASIDE = frozenset({"save_started", "committed"})

# bytes before the parsed end compared at the next call: a rewrite of the file shows there
_PROBE = 64


@dataclass
class _Parsed:
    """What one file's earlier parses found, and where they stopped."""

    identity: tuple[int, int]  # (st_dev, st_ino): a replaced file is another one
    offset: int = 0  # end of the last whole line parsed
    probe: bytes = b""
    lines: int = 0
    records: list[dict] = field(default_factory=list)


_PARSED: dict[str, _Parsed] = {}


def read_history(run_dir: str | os.PathLike) -> list[dict]:
    """The records of ``RUN_DIR/metrics.jsonl`` in order, each run of consecutive ``step``
    records as one ``{"kind": STEP_RUN, "steps": array("q", ...)}``.

    The list and its records are shared between calls: read them, do not change them. A
    missing file gives ``[]``; one that cannot be read warns and gives ``[]`` (records are
    advisory).

    Example:
        >>> import tempfile
        >>> run_dir = tempfile.mkdtemp()
        >>> with open(f"{run_dir}/metrics.jsonl", "w") as f:
        ...     for line in ('{"kind": "step", "step": 1}', '{"kind": "step", "step": 2}',
        ...                  '{"kind": "committed", "step": 2}'):
        ...         print(line, file=f)
        >>> [(r["kind"], list(r.get("steps", [r.get("step")]))) for r in read_history(run_dir)]
        [('(steps)', [1, 2]), ('committed', [2])]
    """
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            return _read(f, str(path))
    except FileNotFoundError:
        _PARSED.pop(str(path), None)
        return []
    except OSError as err:
        log.warning("ftrain: cannot read %s (%s); its run records are ignored", path, err)
        return []


def forget_history() -> None:
    """Drop what :func:`read_history` keeps (a start calls it once its checks are done: a
    long run's records are not held in memory while it trains)."""
    _PARSED.clear()


def _read(f, key: str) -> list[dict]:
    st = os.fstat(f.fileno())
    parsed = _PARSED.get(key)
    if parsed is None or not _continues(f, st, parsed):
        parsed = _Parsed(identity=(st.st_dev, st.st_ino))
        _PARSED[key] = parsed
    f.seek(parsed.offset)
    tail = _parse_from(f, parsed)
    return parsed.records if tail is None else [*parsed.records, tail]


def _continues(f, st: os.stat_result, parsed: _Parsed) -> bool:
    """Whether the file is the one parsed before with lines only appended to it."""
    if (st.st_dev, st.st_ino) != parsed.identity or st.st_size < parsed.offset:
        return False
    start = max(0, parsed.offset - _PROBE)
    f.seek(start)
    return f.read(parsed.offset - start) == parsed.probe


def _parse_from(f, parsed: _Parsed) -> dict | None:
    """Parse the whole lines from the file position on into ``parsed``; the record of an
    unterminated last line if it reads as one (a writer between its line and the newline
    is not a torn line), kept out of ``parsed`` so the next call reads it again whole."""
    bad, first_bad, tail = 0, None, None
    for raw in f:
        record = parse_line(raw)
        if not raw.endswith(b"\n"):
            tail = record if record is None else _stand_in(record)
            break
        parsed.lines += 1
        parsed.offset += len(raw)
        if record is not None:
            _append(parsed.records, record)
        elif raw.strip():
            bad += 1
            first_bad = first_bad or parsed.lines
    if parsed.offset:
        f.seek(max(0, parsed.offset - _PROBE))
        parsed.probe = f.read(min(_PROBE, parsed.offset))
    if bad:
        log.warning(
            "ftrain: %s: skipped %d unreadable or malformed line%s (first: line %d); run records are "
            "advisory, training is not affected",
            f.name,
            bad,
            "" if bad == 1 else "s",
            first_bad,
        )
    return tail


def _append(records: list[dict], record: dict) -> None:
    if record["kind"] != "step":
        records.append(record)
    elif not _is_step(record["step"]):
        return  # a step record without a step number (``null``) names no step reached
    elif records and records[-1]["kind"] == STEP_RUN:
        records[-1]["steps"].append(record["step"])
    else:
        records.append(_stand_in(record))


def _stand_in(record: dict) -> dict | None:
    if record["kind"] != "step":
        return record
    if not _is_step(record["step"]):
        return None
    return {"kind": STEP_RUN, "steps": array("q", [record["step"]])}


def _is_step(value: object) -> bool:
    return type(value) is int and 0 <= value < 2**63


def commits_on_line(records: Iterable[dict]) -> list[int]:
    """Steps ``records`` (of ``metrics.jsonl``, in order) show committed in the history the
    latest process continued: a process that resumed from step S (by any ``resume=``) and
    began a save has moved the steps after S it found aside (the manager's branch point),
    so the commits recorded before it beyond S are another history's; a fresh start's first
    save abandons all earlier ones. A go-back that never began a save abandoned nothing.

    Example:
        >>> commits_on_line([
        ...     {"kind": "committed", "step": 20}, {"kind": "committed", "step": 30},
        ...     {"kind": "resume", "from_step": 10}, {"kind": "committed", "step": 20},
        ... ])
        [20]
    """
    steps: list[int] = []
    branch = None  # (from_step, steps recorded before it) of a process not yet saving
    for r in records:
        kind, s = r.get("kind"), r.get("step")
        if kind in ("start", "resume"):
            frm = r.get("from_step")
            branch = (frm if _is_step(frm) else -1, len(steps))
        elif kind in SETS_ASIDE and branch is not None:
            frm, before = branch
            steps = [x for x in steps[:before] if x <= frm] + steps[before:]
            branch = None
        if kind == "committed" and _is_step(s):
            steps.append(s)
    return steps


def went_back(record: dict) -> bool:
    """A ``start``/``resume`` record of a resume to an explicit step that went back (left
    committed steps behind). One that did not (``resume=N`` with N the newest commit)
    abandons nothing. Records before ``went_back`` was written count every explicit resume
    as going back."""
    explicit = record.get("reason") != "resume=latest" and _is_step(record.get("from_step"))
    return explicit and record.get("went_back", True) is not False


# -- the history a logger shows ------------------------------------------------------------------
#
# A logger with a "which record counts" rule (TensorBoard's purge_step, the CSV's rows)
# shows, for each step, the last record written for it. A go-back killed before its first
# save wrote records (and purged TensorBoard past its step) for a history no checkpoint
# kept: the run's next start continues the old newest step, and the go-back's records then
# stood in for the committed history's (TensorBoard hid steps 16..30 of it for good). Such
# a start is *abandoned*; the next start logs the committed history's records again from
# the abandoned start's step on, read from metrics.jsonl.


def _abandoned_from(records: Iterable[dict]) -> int | None:
    """The lowest step an abandoned start (a go-back that began no save; ``records`` are
    read before the next start writes its own, so the latest go-back counts too) went back
    to, of those no later start has made good; ``None``: none owed. A start makes them good
    by logging: its loggers write the history again before its first record. One that
    logged nothing (stopped or killed during start-up, or a finished run re-run, which
    builds no loggers) leaves them owed to the next."""
    owed, pending = None, None  # pending: the from_step of a go-back not yet saving
    for r in records:
        kind = r.get("kind")
        if kind in ("start", "resume"):
            if pending is not None:
                owed = pending if owed is None else min(owed, pending)
            pending = r["from_step"] if went_back(r) else None
        elif kind in SETS_ASIDE:
            pending = None
        elif kind in (STEP_RUN, "step", "eval"):
            owed = None
    if pending is not None:
        owed = pending if owed is None else min(owed, pending)
    return owed


def _line(records: Iterable[dict]) -> dict[tuple[str, int], dict]:
    """``{(kind, step): record}`` of the step and eval records of the history the starts
    that were not abandoned wrote: each start drops what the history held past its step
    (a resume redoes those steps; a fresh start begins again), then adds its own."""
    line: dict[tuple[str, int], dict] = {}
    segment: list[dict] = []
    drop_after, pending = None, None

    def close() -> None:
        nonlocal line
        if pending is not None:  # abandoned: its records never count
            return
        if drop_after is not None:
            line = {k: v for k, v in line.items() if k[1] <= drop_after}
        for r in segment:
            line[(r["kind"], r["step"])] = r

    for r in records:
        kind = r.get("kind")
        if kind in ("start", "resume"):
            close()
            segment, pending = [], (r["from_step"] if went_back(r) else None)
            frm = r.get("from_step")
            drop_after = frm if _is_step(frm) else -1
        elif kind in SETS_ASIDE:
            pending = None
        if kind in ("step", "eval") and _is_step(r.get("step")):
            segment.append(r)
    close()  # records are read before this start writes its own: the last is another's
    return line


def replay_for(run_dir: str | os.PathLike, start_step: int) -> tuple[int, list[dict]]:
    """``(from_step, records)``: the records a logger must write again before a start from
    ``start_step`` so that it shows the committed history: the step and eval records of
    steps in ``(from_step, start_step]``, oldest first. Without an abandoned start below
    ``start_step``: ``(start_step, [])`` (nothing to redo; metrics.jsonl is not read).
    """
    lowest = _abandoned_from(read_history(run_dir))
    if lowest is None or lowest >= start_step:
        return start_step, []
    from ftrain.metrics.jsonl import read_records

    line = _line(
        r for r in read_records(run_dir) if r.get("kind") != "step" or _is_step(r.get("step"))
    )
    kept = [r for (_, step), r in line.items() if lowest < step <= start_step]
    return lowest, sorted(kept, key=lambda r: (r["step"], r["kind"] != "step"))
