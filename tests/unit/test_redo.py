"""Which steps a start redoes (ftrain.cli.redo): read from the records and the heartbeat,
within the history being continued, up to trainer.max_steps."""

import json

from ftrain.ckpt import advisor as adv
from ftrain.cli.redo import reached_steps, recorded_commits, redo_range


def _write(run, records, beat=None):
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if beat is not None:
        (run / "heartbeat.json").write_text(json.dumps(beat))


def test_steps_between_logged_ones_come_from_the_heartbeat_and_other_records(tmp_path):
    recs = [{"kind": "start", "step": 0, "time": 0.0}]
    recs += [{"kind": "step", "step": s, "time": float(s)} for s in (5, 10)]
    recs += [{"kind": "save_started", "step": 12, "time": 12.0}]
    _write(tmp_path, recs, {"step": 13, "time": 13.5, "pid": 1})
    assert redo_range(tmp_path, 8) == (9, 13)
    assert redo_range(tmp_path, 12, until=20) == (13, 13)
    (tmp_path / "heartbeat.json").unlink()  # the save record still says step 12 was reached
    assert redo_range(tmp_path, 8) == (9, 12)


def test_nothing_past_max_steps_is_redone(tmp_path):
    _write(tmp_path, [{"kind": "step", "step": s, "time": float(s)} for s in range(1, 13)])
    assert redo_range(tmp_path, 4, until=8) == (5, 8)
    assert redo_range(tmp_path, 4, until=2) is None
    assert redo_range(tmp_path, 4, also=[15], until=20) == (5, 15)  # a skipped committed step


def test_a_resume_that_went_back_leaves_the_old_history_out(tmp_path):
    recs = [{"kind": "step", "step": s, "time": float(s)} for s in range(1, 13)]
    recs += [{"kind": "resume", "step": 4, "from_step": 4, "reason": "resume=4", "time": 100.0}]
    recs += [{"kind": "step", "step": s, "time": 100.0 + s} for s in (5, 6, 7, 8)]
    recs += [{"kind": "committed", "step": 8, "time": 109.5}]
    recs += [{"kind": "end", "step": 8, "time": 110.0}]
    _write(tmp_path, recs, {"step": 8, "time": 109.0})
    assert list(reached_steps(tmp_path)) == [1, 2, 3, 4, 5, 6, 7, 8, 8, 8, 8]
    assert redo_range(tmp_path, 8, until=20) is None
    # killed during the restore, before any commit: the old history is still the listed
    # one, and a start going back to 4 again redoes its steps 5..12 (as the first said)
    _write(tmp_path, recs[:13], {"step": 12, "time": 50.0})
    assert redo_range(tmp_path, 4, until=20) == (5, 12)


def test_a_resume_of_the_latest_step_keeps_the_steps_it_redoes(tmp_path):
    recs = [{"kind": "step", "step": s, "time": float(s)} for s in range(1, 14)]
    recs += [{"kind": "resume", "step": 10, "from_step": 10, "reason": "resume=latest",
              "time": 20.0}]  # fmt: skip
    _write(tmp_path, recs, {"step": 10, "time": 19.0})  # killed again before step 11 ended
    assert redo_range(tmp_path, 10) == (11, 13)


def test_an_explicit_resume_of_the_newest_commit_keeps_the_steps_it_redoes(tmp_path):
    """resume=5 with 5 the newest commit abandons nothing: steps 6..8 reached before it are
    still to be redone (the report said 6..6 after a later kill at 6)."""
    recs = [{"kind": "step", "step": s, "time": float(s)} for s in range(1, 9)]
    went = {"kind": "resume", "step": 5, "from_step": 5, "reason": "resume=5", "time": 20.0}
    recs += [went | {"went_back": False}]
    _write(tmp_path, recs, {"step": 6, "time": 21.0})  # killed again at step 6
    assert redo_range(tmp_path, 5) == (6, 8)
    back = [*recs[:-1], went | {"went_back": True}, {"kind": "committed", "step": 6}]
    _write(tmp_path, back, {"step": 7, "time": 22.0})
    assert redo_range(tmp_path, 6) == (7, 7)  # it went back: old 7 and 8 are another history's


def test_a_go_back_that_never_committed_leaves_the_old_history_to_redo(tmp_path):
    """resume=20 killed (or Ctrl-C'd) before its first commit moved nothing aside: a plain
    re-run resumes the old newest commit (35) and redoes 36..43, which the first run had
    reached; the report said nothing and the record had redo None."""
    old = [{"kind": "start", "step": 0, "time": 0.0}]
    old += [{"kind": "step", "step": s, "time": float(s)} for s in range(1, 44)]
    old += [{"kind": "committed", "step": s, "time": s + 0.5} for s in (5, 35)]
    back = [{"kind": "resume", "step": 20, "from_step": 20, "reason": "resume=20",
             "went_back": True, "time": 100.0}]  # fmt: skip
    back += [{"kind": "step", "step": s, "time": 100.0 + s} for s in (21, 22)]
    again = [{"kind": "resume", "step": 35, "from_step": 35, "reason": "resume=latest",
              "time": 200.0}]  # fmt: skip
    _write(tmp_path, old + back + again, {"step": 35, "time": 201.0})
    assert redo_range(tmp_path, 35, until=60) == (36, 43)
    _write(tmp_path, old + back[:1] + again, {"step": 43, "time": 50.0})  # Ctrl-C at once
    assert redo_range(tmp_path, 35, until=60) == (36, 43)
    # its first save began (and failed: a full disk): the write had set the old history
    # aside, so the re-run resumes 20 and redoes only what the go-back itself reached
    saved = [{"kind": "step", "step": s, "time": 100.0 + s} for s in (23, 24, 25)]
    saved += [{"kind": k, "step": 25, "time": 126.0} for k in ("save_started", "save_failed")]
    again20 = [{**again[0], "step": 20, "from_step": 20}]
    _write(tmp_path, old + back + saved + again20, {"step": 20, "time": 201.0})
    assert redo_range(tmp_path, 20, until=60) == (21, 25)


def test_damaged_heartbeats_are_ignored(tmp_path):
    recs = [{"kind": "step", "step": 3, "time": 3.0}]
    for beat in ("not json", json.dumps([1]), json.dumps({"step": "7"}), json.dumps({"step": -1})):
        _write(tmp_path, recs)
        (tmp_path / "heartbeat.json").write_text(beat)
        assert redo_range(tmp_path, 1) == (2, 3), beat


def test_the_advisor_counts_a_fresh_restart_after_a_crash_as_a_failure():
    recs = [
        {"kind": "start", "time": 0.0},
        {"kind": "step", "step": 3, "time": 3.0},  # killed before its first commit
        {"kind": "start", "time": 10.0, "redo": [1, 3]},
        {"kind": "end", "time": 20.0},
    ]
    hist = adv._history(adv._sessions(recs))
    assert (hist["failures"], hist["continuations"], hist["redo"]) == (1, 0, 3)


def test_a_fresh_start_after_a_run_that_ended_redoes_nothing(tmp_path):
    from ftrain.cli.redo import last_run_ended

    recs = [{"kind": "start", "step": 0, "time": 0.0}]
    recs += [{"kind": "step", "step": s, "time": float(s)} for s in (1, 2, 3)]
    _write(tmp_path, recs)
    assert not last_run_ended(tmp_path)  # killed: its steps are redone
    _write(tmp_path, recs + [{"kind": "end", "step": 3, "time": 4.0}])
    assert last_run_ended(tmp_path)
    hist = adv._history(adv._sessions(recs + [{"kind": "end", "time": 4.0},
                                               {"kind": "start", "time": 5.0, "redo": [1, 3]}]))  # fmt: skip
    assert (hist["failures"], hist["continuations"], hist["redo"]) == (0, 0, 0)


def test_a_restart_continues_only_its_own_jobs_history_after_resume_n(tmp_path):
    """The records a torchrun restart reads: commits after *this* job's resume=3 (another
    job's, or commits before it, do not make it skip resume=3)."""
    from ftrain.cli.restarts import committed_since_going_back

    yesterday = {
        "kind": "resume",
        "step": 3,
        "reason": "resume=3",
        "from_step": 3,
        "elastic_job": "h:1:x",
    }
    today = dict(yesterday, elastic_job="h:2:y")
    commit = [{"kind": "committed", "step": s} for s in (3, 6, 9)]
    _write(tmp_path, [yesterday, *commit])
    assert committed_since_going_back(tmp_path, 3, "h:2:y") == []  # not this job's resume
    assert committed_since_going_back(tmp_path, 3, "h:1:x") == [6, 9]
    _write(tmp_path, [yesterday, *commit, today])
    assert committed_since_going_back(tmp_path, 3, "h:2:y") == []  # nothing committed since
    _write(tmp_path, [yesterday, *commit, today, commit[1]])
    assert committed_since_going_back(tmp_path, 3, "h:2:y") == [6]
    assert committed_since_going_back(tmp_path, 4, "h:2:y") == []  # resume=4 never ran


def test_recorded_commits_are_those_of_the_history_being_continued(tmp_path):
    """A process that resumed from S and began a save moved the steps after S aside: the
    commits recorded before it beyond S are another history's. Until it saves, they are
    still the run's (a kill before the first save leaves the old history listed)."""
    recs = [{"kind": "start", "step": 0, "from_step": None}]
    recs += [{"kind": "committed", "step": s} for s in (2, 4, 6)]
    recs += [{"kind": "resume", "step": 2, "from_step": 2, "reason": "resume=2"}]
    _write(tmp_path, recs)
    assert recorded_commits(tmp_path) == [2, 4, 6]
    recs += [{"kind": "save_started", "step": 3}, {"kind": "committed", "step": 3}]
    _write(tmp_path, recs)
    assert recorded_commits(tmp_path) == [2, 3]
    recs += [{"kind": "resume", "step": 3, "from_step": 3, "reason": "resume=latest"}]
    recs += [{"kind": "save_started", "step": 4}, {"kind": "committed", "step": 4}]
    _write(tmp_path, recs)
    assert recorded_commits(tmp_path) == [2, 3, 4]
    recs += [{"kind": "start", "step": 0, "from_step": None}, {"kind": "save_started", "step": 1}]
    _write(tmp_path, recs)
    assert recorded_commits(tmp_path) == []  # a fresh start's first save: none of them
