"""Human-facing progress: a one-line bar on a TTY, plain ``[rank=r][step=n]`` lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "format_duration"]


def format_duration(seconds: float) -> str:
    """``3725 -> '1h02m'``, ``75 -> '1m15s'``, ``4.2 -> '4s'``."""
    s = int(max(seconds, 0))
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class Progress:
    """Prints step progress; ``log`` also prints events (saves, resume, eval) on their own line.

    Args:
        total: the step the run ends at (``trainer.max_steps``).
        start: the step the run starts from (after a resume).
        rank, world: shown as a ``[rank=r]`` prefix when ``world > 1``.
        stream: where to print (default stdout); a TTY gets a redrawn bar.
    """

    def __init__(
        self,
        total: int,
        start: int = 0,
        *,
        rank: int = 0,
        world: int = 1,
        stream: TextIO | None = None,
    ) -> None:
        self.total, self.start = total, start
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.prefix = f"[rank={rank}]" if world > 1 else ""
        self._t0 = time.perf_counter()
        self._bar_open = False

    def _eta(self, step: int) -> str:
        done = step - self.start
        if done <= 0:
            return "?"
        per_step = (time.perf_counter() - self._t0) / done
        return format_duration(per_step * (self.total - step))

    def step(self, step: int, values: dict[str, float]) -> None:
        fields = " ".join(f"{k}={_fmt(v)}" for k, v in values.items())
        if self.tty:
            width = 24
            filled = int(width * step / max(self.total, 1))
            bar = "#" * filled + "." * (width - filled)
            line = f"\r{self.prefix}step {step}/{self.total} [{bar}] {fields} eta={self._eta(step)}"
            self.stream.write(line.ljust(100))
            self._bar_open = True
        else:
            self.stream.write(f"{self.prefix}[step={step}] {fields} eta={self._eta(step)}\n")
        self.stream.flush()

    def log(self, step: int, message: str) -> None:
        if self._bar_open:
            self.stream.write("\n")
            self._bar_open = False
        self.stream.write(f"{self.prefix}[step={step}] {message}\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar_open:
            self.stream.write("\n")
            self.stream.flush()
            self._bar_open = False


def _fmt(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        return f"{v:.3e}"
    return f"{v:.4f}"
