"""The run's record: ``metrics.jsonl`` (steps and events) and a heartbeat file.

``metrics.jsonl`` is append-only, one JSON object per line: step records
``{"kind": "step", "step", "loss", "lr", "grad_norm", "tokens_per_s", "time", ...}`` and
events ``{"kind": "save" | "resume" | "emergency_save" | "eval" | "stop" | ..., "step", "time", ...}``.
Each line is written with one ``write`` and flushed, so a killed run leaves at most one
partial last line, which :func:`read_records` skips.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["Heartbeat", "MetricsWriter", "read_records"]


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable
    return value


class MetricsWriter:
    """Append records to ``RUN_DIR/metrics.jsonl`` (only on the rank that writes)."""

    def __init__(self, run_dir: str | os.PathLike, *, enabled: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._file = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open

    def write(self, kind: str, **fields) -> dict:
        record = {"kind": kind, "time": time.time(), **{k: _clean(v) for k, v in fields.items()}}
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_records(run_dir: str | os.PathLike) -> Iterator[dict]:
    """Yield the records of ``RUN_DIR/metrics.jsonl``, skipping a torn last line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


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
        tmp.write_text(json.dumps({"time": time.time(), "step": step, "pid": os.getpid(), **extra}))
        os.replace(tmp, self.path)
