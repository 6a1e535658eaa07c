"""The run's record: ``metrics.jsonl`` (steps and events) and a heartbeat file.

``metrics.jsonl`` is append-only, one JSON object per line: step records
``{"kind": "step", "step", "loss", "lr", "grad_norm", "tokens_per_s", "time", ...}`` and
events ``{"kind": "save_started" | "committed" | "resume" | "emergency_save" | "eval" | "stop"
| ..., "step", "time", ...}``. Each line is written with one ``write`` and flushed, so a
killed run leaves at most one partial last line, which :func:`read_records` skips (and the
next writer starts on a fresh line).

Run records are advisory, never a reason to refuse training: a damaged file (bytes that are
not UTF-8, lines that are not JSON objects) is read with the bad lines skipped and counted in
one warning; a ``metrics.jsonl`` that cannot be opened or written (a directory in its
place, a read-only or full disk) makes the writer warn once and drop the records while
training goes on. The checkpoints are the source of truth.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

from ftrain import _json

__all__ = ["Heartbeat", "MetricsWriter", "read_records"]

log = logging.getLogger(__name__)


def json_safe(value):
    """``value`` for strict JSON: a non-finite float as its text (``"nan"``, ``"inf"``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable
    return value


# what json_safe writes for a non-finite float, read back
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def nonfinite_value(value: object) -> float | None:
    """The float a ``metrics.jsonl`` text stands for (``"nan"`` -> NaN; :func:`json_safe`
    in reverse), else ``None``."""
    return _NONFINITE.get(value) if isinstance(value, str) else None


class MetricsWriter:
    """Append records to ``RUN_DIR/metrics.jsonl`` (only on the rank that writes).

    If the file cannot be opened or a write fails, one warning says so and later records
    are dropped: the run keeps training (``self.enabled`` then reads False).
    """

    def __init__(self, run_dir: str | os.PathLike, *, enabled: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._file = None
        if enabled:
            try:
                self._file = self._open()
            except OSError as err:
                self._give_up("cannot open", err)

    def _open(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+b")  # noqa: SIM115 - held open for the run
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":  # a killed writer's torn line: do not glue onto it
                f.write(b"\n")
                f.flush()
        return f

    def _give_up(self, what: str, err: OSError) -> None:
        log.warning(
            "ftrain: %s %s (%s); run records are not written from here on, training goes on "
            "(move the obstacle away; the next start appends again)",
            what,
            self.path,
            err,
        )
        self.close()
        self.enabled = False

    def write(self, kind: str, **fields) -> dict:
        record = {"kind": kind, "time": time.time(), **{k: json_safe(v) for k, v in fields.items()}}
        if self._file is not None:
            try:
                self._reopen_if_deleted()
                self._file.write((json.dumps(record, sort_keys=True) + "\n").encode())
                self._file.flush()
            except OSError as err:
                self._give_up("cannot write", err)
        return record

    def _reopen_if_deleted(self) -> None:
        """``metrics.jsonl`` deleted while the run writes it (a cleanup script, ``rm``): the
        records went on into the unlinked file, silently lost. A new file begins, said once;
        later starts read their redo report and committed steps from it."""
        if os.fstat(self._file.fileno()).st_nlink > 0:
            return
        self._file.close()
        self._file = self._open()
        log.warning(
            "ftrain: %s was deleted while the run wrote it; a new one begins here (the "
            "records before are gone; the checkpoints are not)",
            self.path,
        )

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):  # what could not be flushed, write() reported
                self._file.close()
            self._file = None


def read_records(run_dir: str | os.PathLike) -> Iterator[dict]:
    """Yield the JSON-object records of ``RUN_DIR/metrics.jsonl``.

    Lines that are not UTF-8, not JSON, not a JSON object, or a record whose ``kind``,
    ``step``, times or ``checkpoint_dirs`` are of another type are skipped; if any were
    (a torn last line of a killed run does not count), one warning gives their number.
    A missing file yields nothing; one that cannot be read (a directory) warns and yields
    nothing.
    """
    path = Path(run_dir) / "metrics.jsonl"
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; a generator holds it
    except FileNotFoundError:
        return
    except OSError as err:
        log.warning("ftrain: cannot read %s (%s); its run records are ignored", path, err)
        return
    bad, first_bad = 0, None
    with f:
        for number, raw in enumerate(f, start=1):
            record = parse_line(raw)
            if record is not None:
                yield record
            elif raw.endswith(b"\n") and raw.strip():
                bad += 1
                first_bad = first_bad or number
    if bad:
        log.warning(
            "ftrain: %s: skipped %d unreadable or malformed line%s (first: line %d); run records are "
            "advisory, training is not affected",
            path,
            bad,
            "" if bad == 1 else "s",
            first_bad,
        )


def parse_line(raw: bytes) -> dict | None:
    """One line as a record, or None if it is not a UTF-8 JSON object of the shape the
    readers rely on (:func:`_well_formed`)."""
    try:
        value = _json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) and _well_formed(value) else None


# Kinds whose records always carry their step: resume, redo reports and the plot index them
_STEP_KINDS = frozenset({"start", "resume", "step", "eval", "committed", "nonfinite"})
_SECONDS = ("time", "restore_s", "blocking_s", "after_s")


def _well_formed(record: dict) -> bool:
    """Whether the fields the readers use have their types: a hand-edited or another
    tool's line (``"kind": ["step"]``, ``"step": "7"``, a ``committed`` without a step,
    ``"checkpoint_dirs": 5``) is skipped like an unreadable one, where it stopped every
    restart with a ``TypeError`` or ``KeyError`` from deep in the resume check."""
    kind = record.get("kind")
    if not isinstance(kind, str):
        return False
    if kind in _STEP_KINDS and "step" not in record:
        return False
    if not all(_is_int(record[k]) for k in ("step", "from_step") if record.get(k) is not None):
        return False
    if not all(_is_number(record[k]) for k in _SECONDS if record.get(k) is not None):
        return False
    dirs = record.get("checkpoint_dirs")
    return dirs is None or (isinstance(dirs, list) and all(isinstance(d, str) for d in dirs))


def _is_int(value) -> bool:
    """A whole number a step counter can hold (int64: a 20-digit step stopped every start
    with an OverflowError in the start-up checks)."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class Heartbeat:
    """``RUN_DIR/heartbeat.json``, rewritten atomically every step for external supervisors."""

    def __init__(
        self, run_dir: str | os.PathLike, *, name: str = "heartbeat.json", enabled: bool = True
    ) -> None:
        self.path = Path(run_dir) / name
        self.enabled = enabled

    def beat(self, step: int, **extra) -> None:
        if not self.enabled:
            return
        tmp = self.path.with_suffix(".json.tmp")
        try:
            tmp.write_text(
                json.dumps({"time": time.time(), "step": step, "pid": os.getpid(), **extra})
            )
            os.replace(tmp, self.path)
        except OSError as err:  # advisory like metrics.jsonl: warn once, keep training
            log.warning("ftrain: cannot write %s (%s); heartbeats stop here", self.path, err)
            self.enabled = False
