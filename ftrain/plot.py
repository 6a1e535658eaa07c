"""``python -m ftrain.plot RUN_DIR [-o OUT.png]``: loss, val loss and LR against step.

Committed checkpoints are marked as thin green lines (a save that started but never
committed is not marked: only ``committed`` records count), resume points as dashed red lines,
and each segment of the run (between resumes) is drawn separately, so the seam a resume
leaves — or doesn't — is visible: a correct resume continues the loss curve exactly
where the redone steps overlap the first attempt.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ftrain.metrics import read_records

__all__ = ["commit_steps", "main", "plot_run", "segments"]


def segments(records: list[dict]) -> list[list[dict]]:
    """Split step/eval records into the run's segments (a new one at each start/resume)."""
    out: list[list[dict]] = [[]]
    for r in records:
        if r.get("kind") in ("start", "resume") and out[-1]:
            out.append([])
        if r.get("kind") in ("step", "eval"):
            out[-1].append(r)
    return [s for s in out if s]


def _has_step(r: dict) -> bool:
    return isinstance(r.get("step"), int) and not isinstance(r.get("step"), bool)


def commit_steps(records: list[dict]) -> list[int]:
    """Steps whose checkpoint is known to have committed (``save_started`` alone is not)."""
    return [r["step"] for r in records if r.get("kind") == "committed" and _has_step(r)]


def _series(seg: list[dict], kind: str, key: str) -> tuple[list[int], list[float]]:
    pts = [
        (r["step"], r[key])
        for r in seg
        if r.get("kind") == kind and _has_step(r) and isinstance(r.get(key), int | float)
    ]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run's curves to ``out`` (default ``RUN_DIR/training.png``) and return the path.

    Raises:
        FileNotFoundError: ``RUN_DIR/metrics.jsonl`` does not exist.
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
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), height_ratios=(3, 1))
    for i, seg in enumerate(segments(records)):
        color = f"C{i % 10}"  # one colour per segment, shared by its loss, val loss and lr
        ax_loss.plot(
            *_series(seg, "step", "loss"), lw=1, color=color, label=f"loss (segment {i + 1})"
        )
        ax_lr.plot(*_series(seg, "step", "lr"), lw=1, color=color)
        xs, ys = _series(seg, "eval", "val_loss")
        if xs:
            ax_loss.plot(xs, ys, "o--", ms=3, color=color, label=f"val loss (segment {i + 1})")
    for step in commit_steps(records):
        for ax in (ax_loss, ax_lr):
            ax.axvline(step, color="tab:green", lw=0.5, alpha=0.5)
    for r in filter(_has_step, records):
        if r.get("kind") == "resume":
            for ax in (ax_loss, ax_lr):
                ax.axvline(r["step"], color="tab:red", ls="--", lw=1)
            ax_loss.annotate(
                f"resume @{r['step']}",
                (r["step"], 1),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                fontsize=7,
                color="tab:red",
            )
    ax_loss.set_ylabel("loss")
    ax_loss.legend(fontsize=7)
    ax_lr.set_ylabel("lr")
    ax_lr.set_xlabel("step (green: checkpoint committed, red: resumed)")
    fig.tight_layout()
    path = Path(out) if out else run_dir / "training.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ftrain.plot", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir")
    parser.add_argument(
        "-o", "--out", default=None, help="output PNG (default RUN_DIR/training.png)"
    )
    args = parser.parse_args(argv)
    try:
        print(plot_run(args.run_dir, args.out))
    except FileNotFoundError as err:
        print(f"ftrain.plot: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
