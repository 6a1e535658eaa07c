"""``python -m ftrain.ckpt advise`` on a real tiny run: killed once, resumed, then advised."""

from __future__ import annotations

import math
import os
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from ftrain.ckpt import CheckpointManager
from ftrain.ckpt import __main__ as ckpt_cli
from ftrain.ckpt import advisor as adv

from .conftest import TINY, records
from .test_cli import _wait_for_step

_UNIT = {"ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def _advise(run_dir, *args):
    cmd = [sys.executable, "-m", "ftrain.ckpt", "advise", str(run_dir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _row(text: str, label: str) -> str:
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(label))
    return line.strip()[len(label) :].strip()


def _seconds(cell: str) -> float:
    value, unit = re.match(r"([\d.e+-]+) (ms|s|min|h|d)\b", cell).groups()
    return float(value) * _UNIT[unit]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, cache_dir, forkserver):
    """12 steps, checkpoints every 4, with a SIGKILL after step 6 and a resume."""
    run = tmp_path_factory.mktemp("advise") / "run"
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    base = [sys.executable, "-m", "ftrain", f"run.dir={run}", *TINY, "checkpoint.every_steps=4"]
    proc = subprocess.Popen(
        # sync saves: by the time step 6 is seen, step 4 is committed, so the kill is a
        # failure that a resume must follow (an async save could still be in flight)
        [*base, "trainer.max_steps=400", "checkpoint.async_save=false"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    _wait_for_step(run, proc, 6)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = forkserver.run([*base[3:], "trainer.max_steps=12"], env, 240)  # the resume
    assert done.returncode == 0, done.stdout + done.stderr
    return run


def _stalls(recs: list[dict]) -> list[float]:
    """The resumed (last) process's async saves: the step-to-step times that overlap each
    write (its start to its commit), each from the latest of its start, the save's start and
    an eval's end in it (this run evaluates on its save steps), beyond the median step."""
    last = max(i for i, r in enumerate(recs) if r["kind"] == "resume")
    session = recs[last:]
    steps = [r for r in session if r["kind"] == "step"]
    pairs = zip(steps, steps[1:], strict=False)
    spans = [(a["time"], b["time"]) for a, b in pairs if b["step"] == a["step"] + 1]
    median = statistics.median(b - a for a, b in spans)
    after = {r["step"]: r["after_s"] for r in session if r["kind"] == "committed"}
    evals = [r["time"] for r in session if r["kind"] == "eval"]
    out = []
    for r in session:
        if r["kind"] == "save_started" and r["async_save"] and r["step"] in after:
            lo = r["time"] - r["blocking_s"]
            hi = lo + after[r["step"]]
            over = [b - _start(a, b, lo, evals) - median for a, b in spans if a < hi and b > lo]
            out += [sum(over)] if over else []
    return out


def _start(a: float, b: float, save_start: float, evals: list[float]) -> float:
    """Where the span (a, b) starts counting: after an eval in it and not before the save."""
    return max(a, save_start, *(t for t in evals if a < t < b))


def test_advise_numbers_match_the_records_and_the_index(run_dir):
    out = _advise(run_dir, "--mtbf", "6h")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    index = CheckpointManager(run_dir / "checkpoints", async_save=False).index()
    assert index[-1]["step"] == 12

    # size: the newest step's array bytes, as listed in the index
    assert f"step 12: {index[-1]['bytes']:,} array bytes" in _row(text, "checkpoint size")
    # total save cost: the median of the retained steps' save_seconds
    total = statistics.median(e["save_seconds"] for e in index)
    assert _seconds(_row(text, "save cost (total)")) == pytest.approx(total, rel=0.01)
    # blocking cost: the median of the save events' blocking_s
    blocking = statistics.median(r["blocking_s"] for r in records(run_dir, "save_started"))
    assert _seconds(_row(text, "save cost (blocking)")) == pytest.approx(blocking, rel=0.01)
    # C: the resumed process's async saves, each charged the steps its write overlapped
    stall = statistics.median(_stalls(records(run_dir)))
    cost = max(blocking, stall)
    assert _seconds(_row(text, "save cost C (stall)")) == pytest.approx(cost, rel=0.01)
    # restore: the resume event of this run
    (resume,) = records(run_dir, "resume")
    assert _seconds(_row(text, "restore cost R")) == pytest.approx(resume["restore_s"], rel=0.01)
    assert "1 failure(s)" in _row(text, "history")

    # the recommendation is tau* = sqrt(2 C MTBF) (at least one full save) in steps
    step_s = _seconds(_row(text, "step time"))
    tau = max(math.sqrt(2 * cost * 6 * 3600), total)
    advised = int(re.search(r"checkpoint\.every_steps=(\d+)", text.splitlines()[-1]).group(1))
    # whole steps (rounded), from printed figures (3 significant digits)
    assert abs(advised - tau / step_s) <= 0.5 + 0.02 * tau / step_s
    current = _row(text, "checkpoint.every_steps").split()
    assert current[:2] == ["4", str(advised)]


def test_advise_estimates_mtbf_from_the_failure(run_dir, capsys):
    assert ckpt_cli.main(["advise", str(run_dir)]) == 0
    text = capsys.readouterr().out
    stats = adv.measure(run_dir)
    assert stats.failures == 1 and stats.continuations == 0
    assert "estimated" in _row(text, "MTBF")
    assert _seconds(_row(text, "MTBF")) == pytest.approx(stats.train_s, rel=0.01)
    assert stats.n_stalls >= 1 and stats.cost_s >= stats.blocking_s
    advised = adv.advised_every_steps(stats, stats.cost_s, stats.train_s)
    assert text.splitlines()[-1] == f"recommendation: checkpoint.every_steps={advised}"


def _fails(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        ckpt_cli.main(argv)
    return f"{e.value.code} {capsys.readouterr().err}"


def test_advise_errors_are_clear(run_dir, tmp_path, capsys):
    assert "number and a unit" in _fails(["advise", str(run_dir), "--mtbf", "6"], capsys)
    assert "2d" in _fails(["advise", str(run_dir), "--mtbf", "six hours"], capsys)
    assert f"{tmp_path} is not an ftrain run directory" in _fails(["advise", str(tmp_path)], capsys)
    wrong = _fails(["advise", str(Path(run_dir) / "checkpoints")], capsys)
    assert f"try {run_dir}" in wrong
