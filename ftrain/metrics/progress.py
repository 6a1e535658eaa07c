"""Human-facing progress: a one-line bar on a TTY, plain ``[rank=r][step=n]`` lines otherwise.

A step line shows the numbers rounded for reading, in a fixed order::

    [step=120] loss=3.2145 lr=0.000593 grad_norm=0.84 tokens/s=6.91k steps/s=13.5 max_rss=412M elapsed=9s eta=13s

- throughput is ``tokens/s`` when the loss reports a token count, else ``samples/s``
  (labelled so);
- memory is the peak resident set size of the process (``max_rss``) on the CPU, the peak
  CUDA memory allocated by tensors (``cuda_max_alloc``) on a GPU;
- ``elapsed`` is this process's training time, ``eta`` the time to ``trainer.max_steps``
  at the speed measured since the first logged step (``?`` until there is one).

When the stream is not a TTY every line ends with a newline (logs and tests parse them).
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Mapping
from typing import TextIO

__all__ = ["Progress", "format_duration", "format_field", "format_step", "memory_fields"]


def format_duration(seconds: float) -> str:
    """``3725 -> '1h02m'``, ``75 -> '1m15s'``, ``4.2 -> '4s'``."""
    s = int(max(seconds, 0))
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _number(v: float) -> str:
    """Four significant digits: ``118.1812 -> '118.2'``, ``0.00059312 -> '0.0005931'``."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    if isinstance(v, int):
        return str(v)
    return f"{v:.4g}"


def _rate(v: float) -> str:
    """``6907.6 -> '6.91k'``, ``1.25e6 -> '1.25M'``, ``54.21 -> '54.2'``."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{suffix}"
    return f"{v:.3g}"


def _megabytes(mb: float) -> str:
    """``412.3 -> '412M'``, ``1536 -> '1.5G'``."""
    return f"{mb / 1024:.1f}G" if mb >= 1024 else f"{mb:.0f}M"


def format_field(key: str, value) -> str:
    """One ``key=value`` for a human: losses with 4 decimals, rates with k/M, MB as M/G,
    seconds as durations when long, other numbers with 4 significant digits.

    Example:
        >>> format_field("val_loss", 5.251816987991333), format_field("tokens_per_s", 118.1812)
        ('val_loss=5.2518', 'tokens/s=118')
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{key}={value}"
    if key.endswith("_per_s"):
        return f"{key[: -len('_per_s')]}/s={_rate(value)}"
    if key.endswith("_mb"):
        return f"{key[:-3]}={_megabytes(value)}"
    if "loss" in key and isinstance(value, float) and abs(value) < 1e4:
        return f"{key}={value:.4f}"
    if key.endswith("_s") and isinstance(value, float) and value >= 60:
        return f"{key}={format_duration(value)}"
    return f"{key}={_number(value)}"


# what a step line shows, in this order (others are in metrics.jsonl and the loggers)
_STEP_KEYS = (
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "samples_per_s",
    "steps_per_s",
    "max_rss_mb",
    "cuda_max_alloc_mb",
)


def format_step(values: Mapping[str, float], *, elapsed: float, eta: float | None) -> str:
    """The fields of one step line (without the ``[step=n]`` prefix).

    Example:
        >>> format_step({"loss": 5.30971, "lr": 6e-05, "tokens_per_s": 6907.6, "steps_per_s": 2.1},
        ...             elapsed=3.2, eta=None)
        'loss=5.3097 lr=6e-05 tokens/s=6.91k steps/s=2.1 elapsed=3s eta=?'
    """
    shown = [k for k in _STEP_KEYS if k in values]
    shown += sorted(k for k in values if k.startswith("lr_"))  # per-group learning rates
    parts = [format_field(k, values[k]) for k in shown]
    parts.append(f"elapsed={format_duration(elapsed)}")
    parts.append(f"eta={format_duration(eta) if eta is not None else '?'}")
    return " ".join(parts)


def memory_fields(device=None) -> dict[str, float]:
    """Peak memory in MB: ``{"cuda_max_alloc_mb": ...}`` for a CUDA device (tensors'
    allocations, ``torch.cuda.max_memory_allocated``), else ``{"max_rss_mb": ...}``
    (the process's peak resident set size); ``{}`` where neither can be read."""
    if device is not None and getattr(device, "type", str(device)).startswith("cuda"):
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return {"cuda_max_alloc_mb": torch.cuda.max_memory_allocated(device) / 2**20}
    try:
        import resource
    except ImportError:  # Windows
        return {}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"max_rss_mb": peak / (2**20 if sys.platform == "darwin" else 2**10)}


class Progress:
    """Prints step progress; ``log`` also prints events (saves, resume, eval) on their own line.

    Args:
        total: the step the run ends at (``trainer.max_steps``).
        start: the step the run starts from (after a resume).
        rank, world: shown as a ``[rank=r]`` prefix when ``world > 1``.
        stream: where to print (default stdout); a TTY gets a redrawn bar.
        clock: seconds for ``elapsed`` and ``eta`` (default ``time.perf_counter``).
    """

    def __init__(
        self,
        total: int,
        start: int = 0,
        *,
        rank: int = 0,
        world: int = 1,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.total, self.start, self.clock = total, start, clock
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.prefix = f"[rank={rank}]" if world > 1 else ""
        self._t0 = clock()
        self._first: tuple[int, float] | None = None  # (step, time) of the first logged step
        self._bar_open = False

    def eta(self, step: int, values: Mapping[str, float], now: float) -> float | None:
        """Seconds to ``total`` at the speed since the first logged step (that one carries
        start-up costs: compilation, caches); before a second one, the step's ``steps_per_s``."""
        left = max(self.total - step, 0)
        if self._first is not None and step > self._first[0]:
            return left * (now - self._first[1]) / (step - self._first[0])
        rate = values.get("steps_per_s")
        return left / rate if rate else (0.0 if left == 0 else None)

    def step(self, step: int, values: Mapping[str, float]) -> None:
        now = self.clock()
        eta = self.eta(step, values, now)
        if self._first is None:
            self._first = (step, now)
        fields = format_step(values, elapsed=now - self._t0, eta=eta)
        if self.tty:
            width = 24
            filled = int(width * step / max(self.total, 1))
            bar = "#" * filled + "." * (width - filled)
            line = f"{self.prefix}step {step}/{self.total} [{bar}] {fields}"
            columns = shutil.get_terminal_size((120, 24)).columns - 1
            self.stream.write("\r" + line[:columns].ljust(columns))
            self._bar_open = True
        else:
            self.stream.write(f"{self.prefix}[step={step}] {fields}\n")
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
