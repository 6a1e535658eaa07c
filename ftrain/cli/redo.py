"""Which steps a start redoes: the steps the run reached before that no commit kept.

The resume report says ``steps A..B ran before but were not committed: they will be
redone`` (and the advisor counts them). What ran is read from the run's records, which are
advisory, so this is best effort, but it must not under- or over-state:

- step records are written every ``trainer.log_every`` steps only, so every record that
  names a step the run reached counts (evaluations, saves, stops), and so does
  ``heartbeat.json``, rewritten after every step by the latest process;
- a resume to an explicit step N that went back abandons the history after N once it
  starts its first save (the write moves the old history's steps aside): from then on the
  steps recorded before it beyond N are another history's, not this one's to redo. Until
  then the old history is still the listed one: a go-back killed (or Ctrl-C'd) before its
  first save leaves a plain re-run resuming the old newest step, whose later steps it
  redoes;
- nothing past ``trainer.max_steps`` will run, so nothing past it is redone.
"""

from __future__ import annotations

from array import array
from pathlib import Path

from ftrain import _json
from ftrain.metrics.history import (
    SETS_ASIDE,
    STEP_RUN,
    commits_on_line,
    read_history,
    went_back,
)

__all__ = ["eval_owed", "last_run_ended", "reached_steps", "recorded_commits", "redo_range"]

# records whose "step" the run had reached (finished) when it wrote them
_REACHED = frozenset(
    {
        "step",
        "eval",
        "save_started",
        "committed",
        "save_failed",
        "emergency_save",
        "nonfinite",
        "stop",
        "end",
    }
)


def redo_range(
    run_dir: Path,
    step: int,
    also: list[int] = (),
    until: int | None = None,
    earlier_runs: list[Path] = (),
) -> tuple[int, int] | None:
    """``(first, last)`` of the steps after ``step`` that ran before and this run redoes:
    by the run records and heartbeat (:func:`reached_steps`) of ``run_dir`` and of the
    ``earlier_runs`` whose checkpoints this run took over, plus ``also`` (committed steps
    that were skipped or left behind), up to ``until`` (``trainer.max_steps``); ``None``:
    none."""
    reached = [reached_steps(d) for d in (run_dir, *earlier_runs)]
    beyond = [s for s in [*(s for steps in reached for s in steps), *also] if s > step]
    last = min(max(beyond), until) if beyond and until is not None else max(beyond, default=0)
    return (step + 1, last) if last > step else None


def reached_steps(run_dir: Path) -> array:
    """Steps the records show as reached in the history being continued (see the module
    doc), with the heartbeat's step if the latest process wrote one after it branched (an
    ``array("q")``: a run logging every step for days has millions)."""
    steps = array("q")
    branched = None  # time of the last go-back to an explicit step that committed
    going_back = None  # (from_step, time, steps recorded before it) of a go-back that has
    for r in read_history(run_dir):  # not saved yet, in the process writing the records
        kind, s = r.get("kind"), r.get("step")
        if kind in ("start", "resume"):  # a new process: an uncommitted go-back never took
            going_back = (r["from_step"], r.get("time"), len(steps)) if went_back(r) else None
        elif kind in SETS_ASIDE and going_back is not None:  # the old history moved aside
            frm, branched, before = going_back
            steps = array("q", (x for x in steps[:before] if x <= frm)) + steps[before:]
            going_back = None
        if kind == STEP_RUN:
            steps.extend(r["steps"])
        elif kind in _REACHED and _is_step(s):
            steps.append(s)
    beat = _heartbeat(run_dir / "heartbeat.json")
    if beat is not None and _after(beat.get("time"), branched):
        steps.append(beat["step"])
    return steps


def recorded_commits(run_dir: Path) -> list[int]:
    """Steps the records show committed in the history being continued
    (:func:`~ftrain.metrics.history.commits_on_line`)."""
    return commits_on_line(read_history(run_dir))


def _is_step(value: object) -> bool:
    return type(value) is int and 0 <= value < 2**63  # the heartbeat's too (int64 arrays)


def _after(time: object, branched: object) -> bool:
    if branched is None:
        return True
    numbers = (int, float)
    return isinstance(time, numbers) and isinstance(branched, numbers) and time > branched


def _heartbeat(path: Path) -> dict | None:
    """The heartbeat's record if it is readable and names a step (advisory, like the
    records: anything else is ignored)."""
    try:
        beat = _json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return beat if isinstance(beat, dict) and _is_step(beat.get("step")) else None


def last_run_ended(run_dir: Path) -> bool:
    """Whether the latest process of the records reached its ``end`` record (then a fresh
    start redoes nothing of it: its steps were committed, elsewhere if not here)."""
    last = None
    for r in read_history(run_dir):
        if r.get("kind") in ("start", "resume", "end"):
            last = r.get("kind")
    return last == "end"


def eval_owed(run_dir: Path, step: int) -> bool:
    """Whether ``step``'s evaluation was skipped by a stop (``eval_skipped``: the stop save
    went first) and not made up since: a resume from that step evaluates it before its
    first step, or the run's val curve kept the gap for good."""
    owed = False
    for r in read_history(run_dir):
        if r.get("step") == step and r.get("kind") in ("eval", "eval_skipped"):
            owed = r["kind"] == "eval_skipped"
    return owed
