"""``python -m ftrain.plot RUN_DIR [-o OUT.png] [--title T]``: loss, val loss and LR against step.

The raw training loss is drawn thin and faint with a smoothed curve over it (a centred
moving average over about 1/15 of the run, see :func:`smooth`), so the trend is readable
through step-to-step noise. The title names the run. Committed checkpoints are marked as thin green lines (a save that started but never
committed is not marked: only ``committed`` records count), resume points as dashed red lines,
and each segment of the run (between resumes) is drawn separately, so the seam a resume
leaves — or doesn't — is visible: a correct resume continues the loss curve exactly
where the redone steps overlap the first attempt, and an attempt that differed keeps its own
smoothed trend (see :func:`_smoothed_segments`).
"""

from __future__ import annotations

import argparse
import bisect
import math
import os
import sys
from pathlib import Path

from ftrain._stdio import run_tool
from ftrain.metrics import read_records
from ftrain.metrics.history import commits_on_line
from ftrain.metrics.jsonl import nonfinite_value

__all__ = ["NothingToPlot", "commit_steps", "main", "plot_run", "segments", "smooth"]


def smooth(values: list[float], window: int | None = None) -> list[float]:
    """A centred moving average (no lag: the trend sits on the raw curve, not behind it).

    Args:
        window: points averaged (default about 1/15 of the curve, at least 1). At the
            ends the window shrinks to the points there are. Non-finite values are left out
            of the averages and passed through.

    Example:
        >>> smooth([1.0, 2.0, 6.0, 4.0, 5.0], window=3)
        [1.5, 3.0, 4.0, 5.0, 4.5]
    """
    n = len(values)
    if window is None:
        window = max(1, n // 15)
    half = max(window, 1) // 2
    # a sliding window sum of the finite values: each average O(1), the curve O(n) (a slice
    # per point was O(n * window): minutes at the end of a million-step run), compensated
    # so a huge loss leaving the window takes none of the small ones' precision with it
    window_sum, out, lo, hi = _WindowSum(), [], 0, 0
    for i, v in enumerate(values):
        while hi < min(n, i + half + 1):  # the window is [i - half, i + half], clipped
            window_sum.add(values[hi])
            hi += 1
        while lo < i - half:
            window_sum.remove(values[lo])
            lo += 1
        out.append(window_sum.mean() if window_sum.count and math.isfinite(v) else v)
    return out


class _WindowSum:
    """Neumaier-compensated sum and count of the finite values added and not removed."""

    def __init__(self) -> None:
        self.total, self.carry, self.count = 0.0, 0.0, 0

    def add(self, x: float, sign: int = 1) -> None:
        if not math.isfinite(x):
            return
        x *= sign
        t = self.total + x
        big, small = (self.total, x) if abs(self.total) >= abs(x) else (x, self.total)
        self.carry += (big - t) + small
        self.total, self.count = t, self.count + sign

    def remove(self, x: float) -> None:
        self.add(x, -1)

    def mean(self) -> float:
        return (self.total + self.carry) / self.count


def segments(records: list[dict]) -> list[list[dict]]:
    """Split step/eval records into the run's segments (a new one at each start/resume)."""
    out: list[list[dict]] = [[]]
    for r in records:
        if r.get("kind") in ("start", "resume") and out[-1]:
            out.append([])
        if r.get("kind") in ("step", "eval"):
            out[-1].append(r)
    return [s for s in out if s]


_DRAWABLE = 1e300  # values (and steps) past this have no axis matplotlib can compute


def _has_step(r: dict) -> bool:
    s = r.get("step")  # a step past float range (a hand-edited 10**400) cannot be drawn
    return isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= _DRAWABLE


def commit_steps(records: list[dict]) -> list[int]:
    """Steps whose checkpoint is known to have committed (``save_started`` alone is not),
    in the history the run continues: a go-back's first save moved the later steps aside,
    and their lines are not drawn (:func:`~ftrain.metrics.history.commits_on_line`)."""
    return commits_on_line(records)


def _number(value) -> float | None:
    """A metric's value: a number, or the text metrics.jsonl writes for NaN and inf (a
    diverged step must show as a gap, not vanish under a line drawn over it)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value if abs(value) <= _DRAWABLE else math.nan  # a gap: no axis spans 1e308
    return nonfinite_value(value)


def _series(seg: list[dict], kind: str, key: str) -> tuple[list[int], list[float]]:
    pts = [
        (r["step"], _number(r.get(key)))
        for r in seg
        if r.get("kind") == kind and _has_step(r) and _number(r.get(key)) is not None
    ]
    return [p[0] for p in pts], [p[1] for p in pts]


class NothingToPlot(ValueError):
    """The run has recorded no step or eval yet."""


def _out_path(run_dir: Path, out: str | Path | None) -> Path:
    """Where the figure goes: ``out`` (``.png`` added when it has no suffix, as matplotlib
    would, so the path said is the file written; a directory, existing or spelt with a
    trailing ``/``, gets ``training.png`` inside), else ``RUN_DIR/training.png``."""
    if not out:
        return run_dir / "training.png"
    path = Path(out)
    if str(out).endswith(("/", os.sep)) or path.is_dir():  # -o plots/ wrote ./plots.png
        return path / "training.png"
    return path if path.suffix else path.with_name(path.name + ".png")


_NAMED_SEGMENTS = 6  # segments named in the legend; the rest are drawn, counted


def _smoothed_segments(segs: list[list[dict]]) -> list[dict[int, float]]:
    """Each segment's smoothed loss at its own steps: a centred average over the whole
    run's steps (the last value each step recorded: smoothed per segment alone, a
    resume's first steps and the steps before it disagreed at every seam), with the
    segment's own values at its own steps. With the whole run's last values alone, an
    attempt a go-back abandoned (or a redo that differed) was drawn with the later
    attempt's trend, and the two smoothed curves always coincided. A correct redo records
    the same values, so its curve still continues the first attempt's exactly."""
    own = [dict(zip(*_series(seg, "step", "loss"), strict=True)) for seg in segs]
    last: dict[int, float] = {}
    for values in own:
        last.update(values)
    steps = sorted(last)
    window = max(1, len(steps) // 15)
    half = window // 2
    out = []
    for values in own:  # the steps within half a window of the segment's: O(run + windows)
        if not values:
            out.append({})
            continue
        lo = max(0, bisect.bisect_left(steps, min(values)) - half)
        hi = min(len(steps), bisect.bisect_right(steps, max(values)) + half)
        xs = steps[lo:hi]
        ys = smooth([values.get(x, last[x]) for x in xs], window)
        out.append({x: y for x, y in zip(xs, ys, strict=True) if x in values})
    return out


def plot_run(
    run_dir: str | Path, out: str | Path | None = None, *, title: str | None = None
) -> Path:
    """Draw the run's curves to ``out`` (default ``RUN_DIR/training.png``) and return the path.

    Args:
        title: the figure's title (default: the run directory's name, i.e. ``run.name``
            for the default ``run.dir``).

    Raises:
        FileNotFoundError: ``RUN_DIR/metrics.jsonl`` does not exist.
        NothingToPlot: it holds no step or eval record yet.
        OSError / ValueError: ``out`` cannot be written, or names a format matplotlib lacks.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        raise FileNotFoundError(
            f"{run_dir / 'metrics.jsonl'} does not exist; is {run_dir} an ftrain run directory?"
        )
    records = list(read_records(run_dir))
    segs = segments(records)
    if not segs:
        raise NothingToPlot(
            f"{run_dir / 'metrics.jsonl'} holds no step records yet: nothing to plot"
        )
    path = _out_path(run_dir, out)
    fig, (ax_loss, ax_lr) = plt.subplots(
        2, 1, sharex=True, figsize=(9, 6), height_ratios=(3, 1), layout="constrained"
    )
    for i, (seg, smoothed) in enumerate(zip(segs, _smoothed_segments(segs), strict=True)):
        color = f"C{i % 10}"  # one colour per segment, shared by its loss, val loss and lr
        named = i < _NAMED_SEGMENTS  # a run restarted 300 times: a legend of 600 lines
        xs, ys = _series(seg, "step", "loss")
        raw = "loss (faint: raw)" if i == 0 else None
        ax_loss.plot(xs, ys, lw=0.8, alpha=0.3, color=color, label=raw)
        label = f"loss smoothed (segment {i + 1})" if named else None
        ax_loss.plot(xs, [smoothed[x] for x in xs], lw=1.6, color=color, label=label)
        ax_lr.plot(*_series(seg, "step", "lr"), lw=1, color=color)
        xs, ys = _series(seg, "eval", "val_loss")
        if xs:
            label = f"val loss (segment {i + 1})" if named else None
            ax_loss.plot(xs, ys, "o--", ms=3, color=color, label=label)
    if len(segs) > _NAMED_SEGMENTS:
        ax_loss.plot([], [], " ", label=f"... {len(segs)} segments in all")
    for step in commit_steps(records):
        for ax in (ax_loss, ax_lr):
            ax.axvline(step, color="tab:green", lw=0.5, alpha=0.5)
    bad = [r["step"] for r in records if r.get("kind") == "nonfinite" and _has_step(r)]
    if bad:  # marked along the bottom: a skipped step leaves no point to see
        ax_loss.plot(bad, [0.02] * len(bad), "x", ms=4, color="tab:red",
                     transform=ax_loss.get_xaxis_transform(), label="non-finite step")  # fmt: skip
    for r in filter(_has_step, records):
        if r.get("kind") == "resume":
            for ax in (ax_loss, ax_lr):
                ax.axvline(r["step"], color="tab:red", ls="--", lw=1)
            ax_loss.annotate(
                f"resume @{r['step']}",
                (r["step"], 1),
                xycoords=("data", "axes fraction"),
                xytext=(-2, -3),  # inside the axes, left of the line: never cut off
                textcoords="offset points",
                rotation=90,
                ha="right",
                va="top",
                fontsize=7,
                color="tab:red",
            )
    ax_loss.set_ylabel("loss")
    ax_loss.legend(fontsize=7)
    ax_lr.set_ylabel("lr")
    ax_lr.set_xlabel("step (green: checkpoint committed, red: resumed)")
    fig.suptitle(_drawable(title or run_dir.resolve().name))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # -o plots/ of a directory to be
        _save(fig, path)
    finally:
        plt.close(fig)
    return path


def _save(fig, path: Path) -> None:
    """Write the figure to a temporary file beside ``path``, then rename it over: the run's
    end and a ``python -m ftrain.plot`` of the same run both write ``training.png``, and a
    viewer reading it mid-write saw half a PNG. A path that is not a regular file (``-o
    /dev/stdout``, a FIFO) is written in place: renaming over it would replace it."""
    import tempfile

    from ftrain._umask import plain_file_mode

    options = {"dpi": 100, "bbox_inches": "tight"}  # nothing clipped at the edges
    if path.is_symlink():  # a link to a served copy stays a link: its target is replaced
        path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        fig.savefig(path, **options)
        return
    fmt = path.suffix.lstrip(".").lower() or "png"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        os.fchmod(fd, plain_file_mode())  # mkstemp's 0600: as a plain write would leave it
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format=fmt, **options)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _drawable(text: str) -> str:
    """``text`` with the bytes of a non-UTF-8 file name (surrogate escapes) shown as U+FFFD:
    matplotlib's font code refuses such a ``str`` with a ``TypeError``."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _print_path(path: Path) -> None:
    """The output path as its bytes, so a script reading it gets the file's real name
    (printing a non-UTF-8 name as ``str`` raised ``UnicodeEncodeError`` in a UTF-8 locale)."""
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:  # a text-only stream put in place by the caller
        print(_drawable(str(path)))
        return
    sys.stdout.flush()
    buffer.write(os.fsencode(path) + b"\n")
    buffer.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ftrain.plot", description=(__doc__ or "draw a run's curves").splitlines()[0]
    )
    parser.add_argument("run_dir")
    parser.add_argument(
        "-o", "--out", default=None, help="output PNG (default RUN_DIR/training.png)"
    )
    parser.add_argument("--title", default=None, help="figure title (default: the run's name)")
    args = parser.parse_args(argv)
    try:
        _print_path(plot_run(args.run_dir, args.out, title=args.title))
    except OSError as err:  # no such run; an output path that cannot be written
        print(f"ftrain.plot: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # nothing to plot yet; an output format matplotlib lacks
        print(f"ftrain.plot: {err}".splitlines()[0], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main, "ftrain.plot"))
