"""The checkpoint-interval advisor: Young/Daly arithmetic, retention, MTBF, run reading."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from ftrain.ckpt import AnyOf, CheckpointManager, EveryKSteps, LatestN
from ftrain.ckpt import advisor as adv
from ftrain.ckpt.advice_report import render
from ftrain.ckpt.policies import StepInfo

# ---- the formula -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cost", "mtbf", "tau"),
    [
        (2.0, 3600.0, 120.0),
        (0.5, 21600.0, math.sqrt(21600.0)),
        (8.0, 86400.0, 1175.755),
        (0, 60, 0),
    ],
)
def test_young_daly_matches_hand_values(cost, mtbf, tau):
    assert adv.young_daly(cost, mtbf) == pytest.approx(tau, rel=1e-6)


def test_young_daly_rejects_bad_inputs():
    with pytest.raises(ValueError, match="MTBF must be positive"):
        adv.young_daly(1.0, 0)
    with pytest.raises(ValueError, match="cannot be negative"):
        adv.young_daly(-1.0, 3600)


def test_overhead_lost_work_and_waste_by_hand():
    assert adv.save_overhead(2.0, 120.0) == pytest.approx(1 / 60)
    assert adv.lost_work(120.0, 10.0) == 70.0
    assert adv.expected_waste(2.0, 120.0, 10.0, 3600.0) == pytest.approx(1 / 60 + 70 / 3600)
    with pytest.raises(ValueError, match="interval must be positive"):
        adv.save_overhead(1.0, 0.0)


def test_young_daly_balances_the_terms_and_is_the_minimum():
    cost, mtbf = 3.0, 7200.0
    tau = adv.young_daly(cost, mtbf)
    # at the optimum the save overhead equals the expected redo fraction tau/(2 MTBF)
    assert adv.save_overhead(cost, tau) == pytest.approx(tau / 2 / mtbf)
    waste = lambda t: adv.expected_waste(cost, t, 0.0, mtbf)  # noqa: E731
    assert waste(tau) < waste(0.9 * tau) and waste(tau) < waste(1.1 * tau)
    # flat near the optimum: a factor 2 off costs (2 + 1/2) / 2 = 1.25x the waste
    assert waste(2 * tau) / waste(tau) == pytest.approx(1.25)


# ---- durations and MTBF ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("6h", 21600), ("2d", 172800), ("1.5h", 5400), (" 6H ", 21600)],
)
def test_parse_duration(text, seconds):
    assert adv.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["6", "6x", "", "h", "six hours", "1e3s"])
def test_parse_duration_refuses_unclear_values(text):
    with pytest.raises(ValueError, match="number and a unit"):
        adv.parse_duration(text)


def test_parse_duration_refuses_zero_and_overflow():
    with pytest.raises(ValueError, match="must be positive"):
        adv.parse_duration("0h")
    with pytest.raises(ValueError, match="must be positive, got '-5h'"):  # "cannot read" before
        adv.parse_duration("-5h")
    with pytest.raises(ValueError, match="positive and finite"):  # was an OverflowError later
        adv.parse_duration("9" * 400 + "h")


def test_estimate_mtbf():
    assert adv.estimate_mtbf(3600.0, 2) == 1800.0
    assert adv.estimate_mtbf(3600.0, 0) is None
    assert adv.estimate_mtbf(0.0, 1) is None


# ---- storage -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kept"),
    [
        ((1000, 100, 3, None, None), 3),
        ((1000, 100, 3, 500, None), 4),  # 800 900 1000 + 500
        ((1000, 100, None, None, None), 10),  # no keep setting: everything
        ((1050, 100, 3, None, None), 3),  # 900 1000 1050 (final save off the grid)
        ((1050, 100, 3, 500, None), 4),  # 900 1000 1050 + 500
        ((1000, 100, None, 300, None), 4),  # 300 600 900 + the newest 1000
        ((12, 4, 3, None, 2), 3),  # best-N cannot keep more than was saved
        ((10, 100, 3, None, None), 1),  # interval longer than the run: the final save
        ((0, 100, 3, None, None), 0),
    ],
)
def test_retained_count_by_hand(args, kept):
    assert adv.retained_count(*args) == kept


def _simulate(max_steps: int, every: int, keep_last: int | None, keep_every: int | None):
    """Run the real keep policies like the manager does; return (kept at end, peak on disk)."""
    parts = ([LatestN(keep_last)] if keep_last else []) + (
        [EveryKSteps(keep_every)] if keep_every else []
    )
    policy = AnyOf(*parts)
    on_disk: set[int] = set()
    peak = 0
    for s in [*range(every, max_steps + 1, every), max_steps]:
        if s in on_disk:
            continue
        on_disk.add(s)
        peak = max(peak, len(on_disk))
        infos = [StepInfo(x, float(x), {}) for x in on_disk]
        on_disk = policy.keep(infos, 0.0) | {max(on_disk)}
    return len(on_disk), peak


@pytest.mark.parametrize("max_steps", [7, 12, 100, 101, 250])
@pytest.mark.parametrize("every", [1, 3, 10, 40])
@pytest.mark.parametrize(("keep_last", "keep_every"), [(1, None), (3, None), (2, 20), (None, 6)])
def test_retained_count_matches_the_real_keep_policies(max_steps, every, keep_last, keep_every):
    kept, peak = _simulate(max_steps, every, keep_last, keep_every)
    assert adv.retained_count(max_steps, every, keep_last, keep_every, None) == kept
    assert adv.peak_count(max_steps, every, keep_last, keep_every, None) == peak


# ---- plans -------------------------------------------------------------------------------


def _stats(**kw) -> adv.RunStats:
    base = adv.RunStats(
        run_dir=Path("run"),
        policy=adv.Policy(every_steps=100, keep_last=3, max_steps=1000, async_save=True),
        step_s=0.1,
        n_steps=100,
        blocking_s=0.5,
        n_saves=10,
        total_s=4.0,
        n_total=3,
        restore_s=2.0,
        n_restores=1,
        size_bytes=900,
        disk_bytes=1000,
        size_step=1000,
        train_s=7200.0,
        sessions=3,
        failures=2,
        continuations=0,
        redo_steps=5,
    )
    return replace(base, **kw)


def test_plan_at_the_current_interval():
    s = _stats()
    p = adv.plan(s, "current", adv.current_every_steps(s), 3600.0, s.blocking_s)
    assert p.every_steps == 100 and p.interval_s == pytest.approx(10.0)
    assert p.overhead == pytest.approx(0.05)
    assert p.lost_s == pytest.approx(5.0 + 2.0) and p.lost_steps == pytest.approx(70.0)
    assert p.waste == pytest.approx(0.05 + 7.0 / 3600)
    assert (p.kept, p.peak, p.storage_bytes) == (3, 4, 4000)


def test_advice_uses_blocking_cost_and_shows_the_total_cost_variant():
    a = adv.advise(_stats(), 3600.0)
    assert a.mtbf_source == "--mtbf"
    assert a.advised.every_steps == 600  # sqrt(2 * 0.5 * 3600) = 60 s = 600 steps of 0.1 s
    assert a.advised_total.every_steps == round(math.sqrt(2 * 4.0 * 3600) / 0.1)
    assert a.advised_total.overhead == pytest.approx(4.0 / a.advised_total.interval_s)
    assert a.recommendation == "checkpoint.every_steps=600"


def test_sync_saves_have_one_advised_column():
    a = adv.advise(
        _stats(policy=adv.Policy(every_steps=100, max_steps=1000, async_save=False)), 3600
    )
    assert a.advised is not None and a.advised_total is None


def test_async_interval_is_at_least_one_full_save():
    # tau* = sqrt(2 * 0.001 * 60) = 0.35 s, but a save takes 4 s and only one is in flight
    s = _stats(blocking_s=0.001)
    assert adv.advised_every_steps(s, s.blocking_s, 60.0) == 40
    assert "raised to one full save" in render(adv.advise(s, 60.0))


def test_mtbf_is_estimated_from_failures_or_left_unknown():
    a = adv.advise(_stats())
    assert a.mtbf_s == 3600.0 and a.mtbf_source.startswith("estimated")
    none = adv.advise(_stats(failures=0))
    assert none.mtbf_s is None and none.advised is None and none.current.waste is None
    assert "pass --mtbf" in none.recommendation


def test_every_seconds_policy_is_converted_and_overridden():
    s = _stats(policy=adv.Policy(every_steps=100, every_seconds=5.0, keep_last=3, max_steps=1000))
    assert adv.current_every_steps(s) == 50  # 5 s / 0.1 s fires before 100 steps
    assert adv.advise(s, 3600.0).recommendation.endswith("checkpoint.every_seconds=null")


def test_restore_falls_back_to_total_save_time_when_never_measured():
    s = _stats(restore_s=None, n_restores=0)
    p = adv.plan(s, "current", 100, None, s.blocking_s)
    assert p.lost_s == pytest.approx(5.0 + 4.0)
    assert "proxy" in render(adv.advise(s))


def test_render_has_a_table_and_a_recommendation():
    text = render(adv.advise(_stats(), 3600.0))
    assert "save overhead C/tau" in text and "expected waste" in text
    assert text.splitlines()[-1] == "recommendation: checkpoint.every_steps=600"


# ---- reading a run directory -------------------------------------------------------------


def _records(path: Path, recs: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "st')  # torn tail


def _fake_run(tmp_path: Path) -> Path:
    """Steps every 0.5 s; a crash after step 6 (saved at 4), resume redoes 5..6; then an end."""
    run = tmp_path / "run"
    config = {
        "checkpoint": {"every_steps": 4, "keep_last": 2, "async_save": True},
        "trainer": {"max_steps": 12},
    }
    with CheckpointManager(run / "checkpoints", keep_policy=LatestN(2), async_save=False) as m:
        for step in (4, 8, 12):
            state = TensorDict({"step": torch.tensor(step), "w": torch.zeros(256)}, [])
            m.save(state, metadata={"config": config})
    steps = lambda a, b, t0: [  # noqa: E731
        {"kind": "step", "step": s, "time": t0 + 0.5 * (s - a)} for s in range(a, b + 1)
    ]
    _records(
        run / "metrics.jsonl",
        [
            {"kind": "start", "step": 0, "time": 99.5},
            *steps(1, 6, 100.0),
            {"kind": "save", "step": 4, "blocking_s": 0.2, "time": 101.6},
            {"kind": "resume", "step": 4, "restore_s": 1.5, "redo": [5, 6], "time": 200.0},
            *steps(5, 12, 200.5),
            {"kind": "save", "step": 8, "blocking_s": 0.1, "time": 202.1},
            {"kind": "save", "step": 12, "blocking_s": 0.3, "time": 204.1},
            {"kind": "end", "step": 12, "time": 204.2},
            {"kind": "resume", "step": 12, "restore_s": 2.5, "redo": None, "time": 300.0},
            {"kind": "end", "step": 12, "time": 300.5},
        ],
    )
    return run


def test_measure_reads_the_records_and_the_index(tmp_path):
    s = adv.measure(_fake_run(tmp_path))
    assert s.step_s == pytest.approx(0.5) and s.n_steps == 5 + 7
    assert s.blocking_s == pytest.approx(0.2) and s.n_saves == 3
    assert s.n_total == 2 and s.total_s > 0  # the two retained steps' total save seconds
    assert s.restore_s == pytest.approx(2.0) and s.n_restores == 2
    assert (s.failures, s.continuations, s.redo_steps, s.sessions) == (1, 1, 2, 3)
    assert s.train_s == pytest.approx(3.0 + 4.2 + 0.5)
    newest = CheckpointManager(s.run_dir / "checkpoints").index()[-1]
    assert (s.size_step, s.size_bytes) == (12, newest["bytes"]) and s.size_bytes >= 256 * 4
    assert s.disk_bytes > s.size_bytes  # plus metadata and manifest
    assert s.policy == adv.Policy(every_steps=4, keep_last=2, max_steps=12, async_save=True)
    assert adv.advise(s).mtbf_s == pytest.approx(s.train_s)  # one failure


def test_a_run_logging_every_few_steps_is_measured_per_step(tmp_path):
    """trainer.log_every=3: step records 3 steps apart (it was refused, "fewer than two
    consecutive step records"); the step time is the gap over the steps it spans."""
    run = _fake_run(tmp_path)
    path = run / "metrics.jsonl"
    kept = [
        line
        for line in path.read_text().splitlines()[:-1]  # less the torn tail
        if json.loads(line)["kind"] != "step" or json.loads(line)["step"] % 3 == 0
    ]
    path.write_text("\n".join(kept) + "\n")
    s = adv.measure(run)
    assert s.step_s == pytest.approx(0.5) and s.n_steps >= 2
    assert "not measured yet (it needs step records of consecutive steps" in render(
        adv.advise(s, 3600.0)
    )


def test_saves_and_evals_inside_logged_gaps_are_not_step_time():
    """log_every=10 with every_steps=10: every gap holds a 2 s save (and every other one a
    1 s eval); the step time was 0.3 s where the steps took 0.1 s."""
    recs, t = [], 0.0
    for n in range(1, 201):
        t += 0.1
        if n % 10:
            continue
        recs.append({"kind": "step", "step": n, "time": t})
        if n % 20 == 0:
            t += 1.0
            recs.append({"kind": "eval", "step": n, "val_loss": 1.0, "time": t})
        t += 2.0
        recs.append({"kind": "save_started", "step": n, "blocking_s": 2.0, "time": t})
    assert statistics.median(adv._step_deltas(recs)) == pytest.approx(0.1)
    for r in recs:  # an eval not right after its step's record cannot be timed
        if r["kind"] == "save_started":
            del r["blocking_s"]
    assert statistics.median(adv._step_deltas(recs)) > 0.2  # the only gaps there are


def _stalled_records(t0: float = 100.0, eval_s: float = 0.0) -> list[dict]:
    """Steps of 0.5 s; an async save after step 4 (blocking 10 ms) whose 1.21 s write slows
    steps 5 and 6 by 0.3 s each; one after step 8 that never committed; a sync one after 10.
    ``eval_s``: an eval of that long runs after step 4, before its save, and one during the
    write, after step 5 (how the loop orders them: step record, eval, save)."""
    step_s = {5: 0.81, 6: 0.8}  # 5: the blocking 10 ms + 0.3 s of the writer's competition
    recs, t = [{"kind": "start", "step": 0, "time": t0 - 0.5}], t0
    for k in range(1, 13):
        t += step_s.get(k, 0.5) if k > 1 else 0.0
        recs.append({"kind": "step", "step": k, "time": t})
        if eval_s and k in (4, 5):
            t += eval_s
            recs.append({"kind": "eval", "step": k, "val_loss": 1.0, "time": t})
        if k == 4:
            recs.append(
                {
                    "kind": "save_started",
                    "step": 4,
                    "blocking_s": 0.01,
                    "async_save": True,
                    "time": t + 0.01,
                }
            )
        if k == 8:
            recs.append(
                {
                    "kind": "save_started",
                    "step": 8,
                    "blocking_s": 0.01,
                    "async_save": True,
                    "time": t + 0.01,
                }
            )
        if k == 10:
            recs.append(
                {
                    "kind": "save_started",
                    "step": 10,
                    "blocking_s": 0.2,
                    "async_save": False,
                    "time": t + 0.2,
                }
            )
            recs.append({"kind": "committed", "step": 10, "after_s": 0.2, "time": t + 0.2})
    recs.append({"kind": "committed", "step": 4, "after_s": 1.21, "time": t})  # seen at the end
    return recs


def test_an_async_saves_cost_is_the_stall_of_the_steps_its_write_overlapped(tmp_path):
    run = _fake_run(tmp_path)  # its policy: async saves
    _records(run / "metrics.jsonl", _stalled_records())
    s = adv.measure(run)
    assert s.step_s == pytest.approx(0.5)
    # steps 4->5 and 5->6 overlap the write [t4, t4 + 1.21]: 0.31 + 0.30 beyond the median;
    # the save at 8 has no commit record and the sync one at 10 is not an async stall
    assert s.n_stalls == 1 and s.stall_s == pytest.approx(0.61)
    assert s.cost_s == pytest.approx(0.61) and s.blocking_s == pytest.approx(0.01)
    a = adv.advise(s, 3600.0)
    assert a.advised.every_steps == round(math.sqrt(2 * 0.61 * 3600) / 0.5)
    assert a.advised.overhead == pytest.approx(0.61 / a.advised.interval_s)
    text = render(a)
    assert "save cost C (stall)" in text and "median of 1 async saves" in text
    assert "save cost (blocking)" in text


def test_an_eval_before_the_save_or_during_its_write_is_not_charged_to_it(tmp_path):
    run = _fake_run(tmp_path)
    _records(run / "metrics.jsonl", _stalled_records(eval_s=2.0))
    s = adv.measure(run)
    # the window now also spans the eval after step 5 (2 s longer): still steps 4->5, 5->6
    assert s.n_stalls == 1 and s.stall_s == pytest.approx(0.61)


def test_a_stall_below_the_blocking_time_or_of_sync_saves_is_not_c():
    assert _stats(stall_s=0.1).cost_s == 0.5  # noise cannot make a save cheaper than its block
    assert _stats(stall_s=2.0).cost_s == 2.0
    sync = adv.Policy(every_steps=100, max_steps=1000, async_save=False)
    assert _stats(stall_s=2.0, policy=sync).cost_s == 0.5
    assert "not measured yet" in render(adv.advise(_stats(), 3600.0))


def test_a_sigterm_stop_counts_as_a_failure_and_a_fresh_start_does_not():
    recs = [
        {"kind": "start", "time": 0.0},
        {"kind": "stop", "time": 10.0},
        {"kind": "resume", "time": 20.0},
        {"kind": "end", "time": 30.0},
        {"kind": "start", "time": 40.0},
    ]
    hist = adv._history(adv._sessions(recs))
    assert (hist["failures"], hist["continuations"], hist["train"]) == (1, 0, 20.0)


def test_not_a_run_directory(tmp_path):
    with pytest.raises(adv.AdvisorError, match=f"{tmp_path} is not an ftrain run directory"):
        adv.measure(tmp_path)


def test_checkpoint_directory_given_instead_of_run_directory(tmp_path):
    run = _fake_run(tmp_path)
    with pytest.raises(adv.AdvisorError, match=f"try {run}"):
        adv.measure(run / "checkpoints")


def test_run_without_saves(tmp_path):
    _records(tmp_path / "metrics.jsonl", [{"kind": "step", "step": s, "time": s} for s in (1, 2)])
    with pytest.raises(adv.AdvisorError, match="holds no committed checkpoint"):
        adv.measure(tmp_path)


def test_run_without_steps(tmp_path):
    _records(tmp_path / "metrics.jsonl", [{"kind": "start", "time": 1.0}])
    with pytest.raises(adv.AdvisorError, match="fewer than two step records of one process"):
        adv.measure(tmp_path)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0123, "12.3 ms"),
        (90, "90 s"),
        (5400, "90 min"),
        (21600, "6 h"),
        (172800, "2 d"),
        (None, "-"),
    ],
)
def test_format_duration(seconds, text):
    assert adv.format_duration(seconds) == text


def test_note_when_the_advice_misses_keep_every():
    s = _stats(policy=adv.Policy(every_steps=100, keep_last=3, keep_every=1000, max_steps=20000))
    a = adv.advise(replace(s, step_s=0.212, blocking_s=0.038), 21600.0)
    assert a.advised.every_steps == 191
    assert a.advised.kept == 3  # lcm(191, 1000) > 20000: no key checkpoint survives
    assert "every_steps=200 divides it" in render(a)
