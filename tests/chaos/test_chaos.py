"""Chaos: random SIGKILLs of the real CLI on 1 rank and on 2 ranks under torchrun.

After all kills the run is let finish; then (a) its final state is bit-identical to an
uninterrupted run of the same config, (b) every committed step restores and
``python -m ftrain.ckpt verify`` passes (on 1 rank every committed step is also restored
after every single kill, and the newest committed step never goes back), (c) no staging
(``*.tmp-*``), ``*.del-*``, lock or set-aside entries are left, and every loss logged for
a step (redone steps included) equals the uninterrupted run's. Kills, launches, restarts
and redone steps (from the ``resume`` records) are reported in the terminal summary.
See ``drill.py`` for the kinds of kill and docs/fault-tolerance.md for the figures.
"""

import json
import sys
import time

import pytest

from . import drill

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


def _split(total: int) -> tuple[int, int]:
    one = round(total * 0.7)
    return one, total - one


def _run(name, seed, kills, report_line, fn, *, replay, **kwargs):
    report = drill.Report(drill=name, seed=seed, planned=kills)
    t0 = time.time()
    try:
        fn(seed=seed, n_kills=kills, report=report, **kwargs)
    except Exception as e:
        report.duration_s = time.time() - t0
        report.outcome = f"FAIL: {type(e).__name__}"
        report_line(report.summary())
        print(json.dumps(report.kills, indent=1), file=sys.stderr)
        raise drill.DrillError(
            f"{name} failed with chaos seed {seed}; replay: {replay}\n{report.summary()}\n{e}"
        ) from e
    finally:
        drill.reap()
    report_line(report.summary())
    print(json.dumps(report.kills, indent=1))
    return report


def _replay(seed: int, total: int) -> str:
    return f"python -m pytest tests/chaos --chaos-seed={seed} --chaos-kills={total}"


def test_sigkills_on_one_rank_end_bit_identical(
    tmp_path, cache_dir, chaos_kills, chaos_seed, chaos_report
):
    kills, _ = _split(chaos_kills)
    report = _run(
        "1 rank",
        chaos_seed,
        kills,
        chaos_report,
        drill.one_rank_drill,
        replay=_replay(chaos_seed, chaos_kills),
        work=tmp_path,
        cache_dir=cache_dir,
        overrides=["trainer.eval_every=null", "checkpoint.every_steps=1", "checkpoint.keep_last=2"],
        max_steps=2 * kills + 6,
    )
    assert len(report.kills) == kills
    assert report.launches == kills + 1


def test_sigkills_on_two_ranks_under_torchrun_end_bit_identical(
    tmp_path, cache_dir, chaos_kills, chaos_seed, chaos_report
):
    _, kills = _split(chaos_kills)
    report = _run(
        "2 ranks",
        chaos_seed + 1,
        kills,
        chaos_report,
        drill.torchrun_drill,
        replay=_replay(chaos_seed, chaos_kills),
        work=tmp_path,
        cache_dir=cache_dir,
        overrides=["checkpoint.every_steps=2", "checkpoint.keep_last=2"],
        max_steps=3 * kills + 6,
        nproc=2,
    )
    assert len(report.kills) == kills
