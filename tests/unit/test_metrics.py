import io
import json
import os
from pathlib import Path

import pytest

from ftrain.metrics import Heartbeat, MetricsWriter, Progress, format_duration, read_records
from ftrain.plot import plot_run, segments


def test_writer_appends_and_reader_skips_a_torn_last_line(tmp_path):
    w = MetricsWriter(tmp_path)
    w.write("step", step=1, loss=2.5, lr=float("nan"))
    w.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "step", "step": 2, "lo')  # a kill mid-write
    recs = list(read_records(tmp_path))
    assert len(recs) == 1 and recs[0]["loss"] == 2.5 and recs[0]["lr"] == "nan"


def test_heartbeat_is_replaced_atomically(tmp_path):
    hb = Heartbeat(tmp_path)
    hb.beat(7)
    info = json.loads((tmp_path / "heartbeat.json").read_text())
    assert info["step"] == 7 and info["pid"] > 0 and not list(tmp_path.glob("*.tmp"))


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_tty_and_lines_otherwise():
    tty, plain = FakeTTY(), io.StringIO()
    Progress(10, stream=tty).step(5, {"loss": 1.0})
    Progress(10, rank=1, world=2, stream=plain).step(5, {"loss": 1.0})
    assert tty.getvalue().startswith("\rstep 5/10 [############............] loss=1.0000")
    assert plain.getvalue().startswith("[rank=1][step=5] loss=1.0000")
    assert format_duration(3725) == "1h02m" and format_duration(75) == "1m15s"


def test_plot_marks_segments(tmp_path):
    w = MetricsWriter(tmp_path)
    w.write("start", step=0)
    for s in range(1, 6):
        w.write("step", step=s, loss=5.0 - s * 0.1, lr=1e-3)
    w.write("save", step=4)
    w.write("resume", step=4)
    for s in range(5, 8):
        w.write("step", step=s, loss=5.0 - s * 0.1, lr=1e-3)
    w.write("eval", step=6, val_loss=4.5)
    w.close()
    segs = segments(list(read_records(tmp_path)))
    assert [len(s) for s in segs] == [5, 4]
    path = plot_run(tmp_path)
    assert path.exists() and path.stat().st_size > 1000
    # -o DIR/ (or an existing DIR) is inside it: it wrote DIR.png beside the directory
    plots = tmp_path / "plots"
    assert plot_run(tmp_path, f"{plots}/") == plots / "training.png"
    assert (plots / "training.png").exists() and not (tmp_path / "plots.png").exists()
    assert plot_run(tmp_path, plots) == plots / "training.png"


def test_plot_has_the_run_name_a_smoothed_loss_over_the_raw_one_and_commits_only(
    tmp_path, monkeypatch
):
    import matplotlib.pyplot as plt

    from ftrain.plot import smooth

    w = MetricsWriter(tmp_path)
    for s in range(1, 31):
        w.write("step", step=s, loss=5.0 - 0.1 * s + (0.5 if s % 2 else -0.5), lr=1e-3)
    w.write("save_started", step=10)
    w.write("committed", step=10)
    w.write("save_started", step=20)  # never committed: not marked
    w.close()
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot_run(tmp_path, title="tiny-demo")
    (fig,) = figures
    assert fig._suptitle.get_text() == "tiny-demo"
    ax_loss = fig.axes[0]
    raw, smoothed = ax_loss.lines[0], ax_loss.lines[1]
    assert list(raw.get_ydata()) != list(smoothed.get_ydata())
    gaps = [abs(a - b) for a, b in zip(raw.get_ydata(), smoothed.get_ydata(), strict=True)]
    assert max(gaps[1:-1]) > 0.4, "the zig-zag is smoothed away"
    commits = [ln.get_xdata()[0] for ln in ax_loss.lines if ln.get_color() == "tab:green"]
    assert commits == [10]
    monkeypatch.undo()
    plt.close(fig)
    a, b, nan, d = smooth([1.0, 3.0, float("nan"), 5.0], window=3)
    assert (a, b, d) == (2.0, 2.0, 5.0) and nan != nan, "a NaN is passed through, not averaged"


def test_plot_of_a_run_restarted_many_times_names_few_segments_and_smooths_across_seams(
    tmp_path, monkeypatch
):
    """300 restarts gave a legend of 600 entries (the figure 4,669 px tall, 22 s to draw),
    and each segment was smoothed on its own, so a redone step's smoothed value differed
    from its first attempt's at every seam. The legend names six segments and counts the
    rest; the smoothed curve is the whole run's."""
    import matplotlib.pyplot as plt

    w = MetricsWriter(tmp_path)
    w.write("start", step=0)
    loss = {s: 5.0 - 0.01 * s + (0.3 if s % 2 else -0.3) for s in range(1, 200)}
    for start in range(0, 180, 10):  # each segment redoes the last 5 steps of the one before
        if start:
            w.write("resume", step=start - 5)
        for s in range(max(1, start - 4), start + 10):
            w.write("step", step=s, loss=loss[s], lr=1e-3)
    w.close()
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot_run(tmp_path)
    (fig,) = figures
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert len(labels) <= 8 and labels[-1] == "... 18 segments in all", labels
    at: dict = {}
    for line in fig.axes[0].lines[1::2][:18]:  # the smoothed curves, one per segment
        for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True):
            assert at.setdefault(x, y) == y, f"step {x}: the seams disagree"
    monkeypatch.undo()
    plt.close(fig)


def test_plot_draws_an_abandoned_attempt_with_its_own_trend_not_the_later_ones(
    tmp_path, monkeypatch
):
    """resume=20 with another lr: steps 21..40 of the first attempt (loss ~4) and the
    second (loss ~3) were both smoothed from the last value of each step, so the first
    attempt's bold curve lay exactly under the second's: the plot hid a resume that
    differed."""
    import matplotlib.pyplot as plt

    w = MetricsWriter(tmp_path)
    w.write("start", step=0)
    for s in range(1, 41):
        w.write("step", step=s, loss=4.0 + (0.1 if s % 2 else -0.1), lr=1e-3)
    w.write("resume", step=20)
    for s in range(21, 41):
        w.write("step", step=s, loss=3.0 + (0.1 if s % 2 else -0.1), lr=6e-3)
    w.close()
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot_run(tmp_path)
    (fig,) = figures
    first, second = fig.axes[0].lines[1], fig.axes[0].lines[3]  # the smoothed curves
    mine = dict(zip(first.get_xdata(), first.get_ydata(), strict=True))
    theirs = dict(zip(second.get_xdata(), second.get_ydata(), strict=True))
    assert all(abs(mine[s] - 4.0) < 0.11 for s in range(22, 40)), mine
    assert all(abs(theirs[s] - 3.0) < 0.11 for s in range(24, 40)), theirs
    assert all(abs(mine[s] - 4.0) < 0.11 for s in range(3, 20)), "not pulled by the redo"
    monkeypatch.undo()
    plt.close(fig)


def test_smooth_is_the_centred_average_of_the_finite_values_in_linear_time():
    """Running sums (a slice per point was O(n * window): minutes for a million-step run)."""
    import math
    import random

    from ftrain.plot import smooth

    rng = random.Random(0)
    values = [rng.random() if i % 7 else float("nan") for i in range(301)]
    got = smooth(values, window=9)
    for i, v in enumerate(values):
        near = [x for x in values[max(0, i - 4) : i + 5] if math.isfinite(x)]
        want = sum(near) / len(near) if math.isfinite(v) else v
        assert got[i] == pytest.approx(want, rel=1e-12) or (got[i] != got[i] and v != v)
    # a huge finite loss leaving the window does not take the small ones' digits with it
    assert smooth([1e17] + [1.0] * 10, window=3)[-3:] == [1.0, 1.0, 1.0]


def test_plot_shows_nonfinite_losses_as_gaps_with_marks(tmp_path, monkeypatch):
    """metrics.jsonl writes NaN as "nan": those steps vanished and a line was drawn over."""
    import matplotlib.pyplot as plt

    w = MetricsWriter(tmp_path)
    for s in range(1, 7):
        w.write("step", step=s, loss=float("nan") if s in (3, 4) else 2.0, lr=1e-3)
        if s in (3, 4):
            w.write("nonfinite", step=s, action="continued", loss=float("nan"))
    w.write("eval", step=4, val_loss=float("inf"))
    w.close()
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot_run(tmp_path)
    (fig,) = figures
    monkeypatch.undo()
    raw = fig.axes[0].lines[0]
    assert list(raw.get_xdata()) == [1, 2, 3, 4, 5, 6]  # the NaN steps are there, as gaps
    marks = [ln for ln in fig.axes[0].lines if ln.get_label() == "non-finite step"]
    assert marks and list(marks[0].get_xdata()) == [3, 4]
    plt.close(fig)


def test_plot_cli_paths_and_empty_runs_are_clear(tmp_path, capsys):
    from ftrain.plot import NothingToPlot, main

    w = MetricsWriter(tmp_path)
    w.write("start", step=0)
    w.close()
    with pytest.raises(NothingToPlot, match="no step records yet"):
        plot_run(tmp_path)
    assert main([str(tmp_path)]) == 2 and "nothing to plot" in capsys.readouterr().err
    w = MetricsWriter(tmp_path)
    w.write("step", step=1, loss=1.0, lr=1e-3)
    w.close()
    assert main([str(tmp_path), "-o", str(tmp_path / "fig")]) == 0  # matplotlib adds .png
    assert capsys.readouterr().out.strip() == str(tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 1000
    (tmp_path / "afile").write_text("x")
    for bad in (tmp_path / "afile" / "x.png", tmp_path / "x.xyz"):
        assert main([str(tmp_path), "-o", str(bad)]) == 2, bad
        err = capsys.readouterr().err
        assert err.startswith("ftrain.plot: ") and "Traceback" not in err, err


def test_plot_of_a_run_whose_name_is_not_utf8_draws_and_prints_its_real_path(
    tmp_path, capsysbinary
):
    """A run directory named with a non-UTF-8 byte: matplotlib refused the title (a
    ``TypeError`` traceback), and printing the path raised ``UnicodeEncodeError``."""
    from ftrain.plot import main

    run = Path(os.fsdecode(bytes(tmp_path) + b"/run\xff"))
    w = MetricsWriter(run)
    w.write("step", step=1, loss=1.0, lr=1e-3)
    w.write("step", step=2, loss=0.5, lr=1e-3)
    w.close()
    assert main([str(run)]) == 0
    assert capsysbinary.readouterr().out == bytes(tmp_path) + b"/run\xff/training.png\n"
    assert (run / "training.png").stat().st_size > 1000
