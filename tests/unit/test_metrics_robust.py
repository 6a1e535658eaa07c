"""Run records are advisory: damaged metrics.jsonl never blocks a run; save records are true."""

import json
import logging
import os

import pytest
import torch
from tensordict import TensorDict

from ftrain.ckpt import CheckpointSaveError
from ftrain.cli.redo import redo_range
from ftrain.cli.session import Session
from ftrain.config import load_config
from ftrain.dist import World
from ftrain.metrics import Heartbeat, MetricsWriter, read_records
from ftrain.plot import commit_steps, plot_run


def _damaged(run_dir):
    """A metrics.jsonl with a 0xff byte, a non-object line, a non-JSON line and a torn end."""
    good = [json.dumps({"kind": "step", "step": s, "loss": 1.0, "time": s}) for s in (1, 2, 3)]
    raw = (
        good[0].encode()
        + b"\n\xff\xfe broken\n"
        + b"[1, 2, 3]\n"
        + b'"a string"\n'
        + good[1].encode()
        + b"\nnot json\n"
        + good[2].encode()
        + b'\n{"kind": "step", "st'  # a killed writer's torn last line: not reported
    )
    (run_dir / "metrics.jsonl").write_bytes(raw)


def test_reader_skips_and_counts_bad_lines(tmp_path, caplog):
    _damaged(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ftrain.metrics.jsonl"):
        recs = list(read_records(tmp_path))
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert "skipped 4 unreadable or malformed lines (first: line 2)" in caplog.text
    assert redo_range(tmp_path, 1) == (2, 3), "the resume report reads around the damage"


def test_a_directory_in_place_of_metrics_jsonl_is_warned_about_not_fatal(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").mkdir()
    with caplog.at_level(logging.WARNING, logger="ftrain.metrics.jsonl"):
        assert list(read_records(tmp_path)) == []
        w = MetricsWriter(tmp_path)
        w.write("step", step=1)  # dropped, no exception
        w.close()
    assert not w.enabled
    assert "cannot read" in caplog.text and "cannot open" in caplog.text
    assert "training goes on" in caplog.text


def test_a_writer_after_a_torn_line_starts_a_fresh_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "step", "step": 1}\n{"kind": "st')
    w = MetricsWriter(tmp_path)
    w.write("resume", step=1)
    w.close()
    assert [r["kind"] for r in read_records(tmp_path)] == ["step", "resume"]


def test_records_written_after_metrics_jsonl_is_deleted_go_to_a_new_file(tmp_path, caplog):
    """A cleanup deleting metrics.jsonl mid-run: the records went on into the unlinked file,
    silently lost (and with them the next start's redo report and lost-steps check)."""
    w = MetricsWriter(tmp_path)
    w.write("step", step=1)
    (tmp_path / "metrics.jsonl").unlink()
    with caplog.at_level(logging.WARNING):
        w.write("committed", step=2)
        w.write("step", step=3)
    w.close()
    assert [(r["kind"], r["step"]) for r in read_records(tmp_path)] == [
        ("committed", 2),
        ("step", 3),
    ]
    assert caplog.text.count("was deleted while the run wrote it") == 1


def test_a_failing_write_disables_records_and_the_heartbeat_warns(tmp_path, caplog):
    w = MetricsWriter(tmp_path)
    w._file.close()
    w._file = _Broken()  # a full disk from now on
    with caplog.at_level(logging.WARNING, logger="ftrain.metrics.jsonl"):
        w.write("step", step=1)
        w.write("step", step=2)
        hb = Heartbeat(tmp_path / "no" / "such" / "dir")
        hb.beat(1)
        hb.beat(2)
    assert not w.enabled and not hb.enabled
    assert caplog.text.count("cannot write") == 2, "one warning each, not one per record"


class _Broken:
    def write(self, data):
        raise OSError(28, "No space left on device")

    def fileno(self):
        raise OSError(5, "Input/output error")

    def flush(self):
        pass

    def close(self):
        raise OSError(28, "No space left on device")


def test_plot_marks_only_the_commits_of_the_history_the_run_continues():
    """After ``resume=10`` went back and saved, the old history's step 20 and 30 were moved
    aside, yet the plot drew "checkpoint committed" lines at them; a go-back that never
    saved moved nothing, and a plain re-run continues the old history (30 stays)."""
    first = [{"kind": "start", "from_step": None}]
    first += [{"kind": "committed", "step": s} for s in (10, 20, 30)]
    back = [{"kind": "resume", "from_step": 10, "reason": "resume=10"}]
    saved = [{"kind": "save_started", "step": 15}, {"kind": "committed", "step": 15}]
    assert commit_steps(first + back + saved) == [10, 15]
    assert commit_steps(first + back) == [10, 20, 30]
    again = [{"kind": "resume", "from_step": 30, "reason": "resume=latest"}]
    assert commit_steps(first + back + again + [{"kind": "committed", "step": 40}]) == [
        10,
        20,
        30,
        40,
    ]


def test_plot_survives_damage_and_marks_commits_only(tmp_path):
    _damaged(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("\n")
        for rec in (
            {"kind": "save_started", "step": 2},
            {"kind": "committed", "step": 2},
            {"kind": "save_started", "step": 3},  # never committed
            {"kind": "committed"},  # no step: ignored
            {"kind": "resume", "step": "x"},  # a bad step: ignored
        ):
            f.write(json.dumps(rec) + "\n")
    recs = list(read_records(tmp_path))
    assert commit_steps(recs) == [2]
    assert plot_run(tmp_path).stat().st_size > 1000
    with open(tmp_path / "metrics.jsonl", "a") as f:  # values no axis spans (hand-edited,
        for rec in (  # float64): an OverflowError traceback, "arange: cannot compute length"
            {"kind": "step", "step": 10**400, "loss": 1.0},
            {"kind": "step", "step": 5, "loss": 1e308, "lr": 1e308},
            {"kind": "step", "step": 6, "loss": -1e308, "lr": -1e308},
        ):
            f.write(json.dumps(rec) + "\n")
    assert plot_run(tmp_path).stat().st_size > 1000


def test_the_figure_is_replaced_whole_never_written_in_place(tmp_path):
    """The run's end and `python -m ftrain.plot` both write training.png: a reader (a
    viewer, a web page) opened mid-write saw half a PNG. It is written beside and renamed."""
    _damaged(tmp_path)
    old = plot_run(tmp_path)
    old_bytes = old.read_bytes()
    with open(old, "rb") as reader:  # open across the rewrite: keeps the whole old figure
        plot_run(tmp_path, title="another title")
        assert reader.read() == old_bytes
    assert old.read_bytes() != old_bytes and old.read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir() if "training" in p.name) == ["training.png"]
    assert old.stat().st_mode & 0o777 == 0o666 & ~_umask()
    served = tmp_path / "served.png"  # a link to a copy served elsewhere stays a link
    old.rename(served)
    old.symlink_to(served)
    before = served.read_bytes()
    plot_run(tmp_path, title="a third")
    assert old.is_symlink() and served.read_bytes() != before  # its target was redrawn
    assert served.read_bytes().startswith(b"\x89PNG")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# -- truthful save records through the Session ------------------------------------------


def _state(step):
    return TensorDict({"step": torch.tensor(step), "w": torch.ones(4) * step}, batch_size=[])


class _FakeManager:
    """An async manager's contract: ``save`` queues (after waiting for the save in flight),
    the commit happens later (``commit_now``) or fails; ``wait`` raises a failure."""

    def __init__(self, directory):
        self.directory, self.fallback_directory = directory, None
        self.in_flight, self.error, self.committed = None, None, set()

    def commit_now(self):
        if self.in_flight is not None:
            step_dir = self.directory / f"step_{self.in_flight:08d}"
            step_dir.mkdir(parents=True)
            (step_dir / "COMMITTED").write_text("{}")
            self.committed.add(self.in_flight)
            self.in_flight = None

    def committed_here(self, step):
        return step in self.committed

    def wait(self):
        if self.error is not None:
            err, self.error, self.in_flight = self.error, None, None
            raise CheckpointSaveError(f"a background checkpoint save failed: {err}")
        self.commit_now()

    def save(self, state, *, metrics=None, metadata=None, force=False):
        if not force:
            return False
        self.wait()
        self.in_flight = int(state["step"])
        return True

    def close(self):
        self.wait()


def _session(tmp_path, manager, async_save=True):
    cfg = load_config([f"run.dir={tmp_path}", f"checkpoint.async_save={str(async_save).lower()}"])
    return Session(cfg, World(), manager)


def _kinds(run_dir):
    return [(r["kind"], r.get("step")) for r in read_records(run_dir) if r["kind"] != "step"]


def test_async_save_is_started_first_and_committed_when_known(tmp_path):
    mgr = _FakeManager(tmp_path / "checkpoints")
    with _session(tmp_path, mgr) as session:
        assert session.save(_state(2), {}, force=True, reason="policy")
        session.save(_state(2), {}, force=False, reason="policy")  # a step boundary: polled
        assert _kinds(tmp_path) == [("save_started", 2)], "not committed yet: no commit record"
        mgr.commit_now()
        session.save(_state(3), {}, force=False, reason="policy")  # next boundary: marker seen
        assert _kinds(tmp_path) == [("save_started", 2), ("committed", 2)]
        assert session.save(_state(4), {}, force=True, reason="policy")
        assert session.save(_state(5), {}, force=True, reason="final")  # waited for 4 first
        session.wait_commits()
        assert _kinds(tmp_path)[2:] == [
            ("save_started", 4),
            ("committed", 4),
            ("save_started", 5),
            ("committed", 5),
        ]


class _UnreachableStore:
    """An object-store location in an outage: each request (a marker's HEAD) fails after
    obstore's minutes of retries; counted."""

    url = "s3://bucket/run"

    def __init__(self, name: str = ""):
        self.name, self.requests = name, [0]

    def __truediv__(self, part: str):
        key = _UnreachableStore(f"{self.name}/{part}")
        key.requests = self.requests
        return key

    def stat(self):
        self.requests[0] += 1
        raise OSError(110, "Connection timed out")


def test_a_pending_save_is_polled_from_the_manager_not_the_location(tmp_path):
    """An S3 outage held an asynchronous save's training loop for minutes at every step:
    each step boundary asked the store for the pending step's marker."""
    mgr = _FakeManager(tmp_path / "checkpoints")
    mgr.directory = store = _UnreachableStore()
    mgr.commit_now = lambda: mgr.committed.add(mgr.in_flight)
    with _session(tmp_path, mgr) as session:
        assert session.save(_state(2), {}, force=True, reason="policy")
        for step in (3, 4, 5):
            session.save(_state(step), {}, force=False, reason="policy")
        assert store.requests[0] == 0, "no request to the location while the save is pending"
        mgr.commit_now()
        session.save(_state(6), {}, force=False, reason="policy")
        assert _kinds(tmp_path) == [("save_started", 2), ("committed", 2)]
        assert store.requests[0] <= 1, "at most the marker's stats, once, at the commit"


def test_an_old_directory_of_the_same_step_is_not_taken_for_the_commit(tmp_path):
    old = tmp_path / "checkpoints" / "step_00000002"
    old.mkdir(parents=True)
    (old / "COMMITTED").write_text("{}")
    os.utime(old / "COMMITTED", (1e9, 1e9))  # written long before this save started
    mgr = _FakeManager(tmp_path / "checkpoints")
    mgr.commit_now = lambda: None  # the new save of step 2 is still in flight
    with _session(tmp_path, mgr) as session:
        session.save(_state(2), {}, force=True, reason="policy")
        session.save(_state(2), {}, force=False, reason="policy")
        assert _kinds(tmp_path) == [("save_started", 2)]


def test_failed_async_save_is_recorded_as_failed_and_emergency_says_not_committed(tmp_path):
    mgr = _FakeManager(tmp_path / "checkpoints")
    session = _session(tmp_path, mgr)
    assert session.save(_state(2), {}, force=True, reason="policy")
    mgr.error = OSError(5, "Input/output error")
    session.record("emergency_save", step=2, saved=True, error="RuntimeError('boom')")
    recs = [r for r in read_records(tmp_path) if r["kind"] != "step"]
    assert [r["kind"] for r in recs] == ["save_started", "save_failed", "emergency_save"]
    emergency = recs[-1]
    assert emergency["save_started"] is True and emergency["committed"] is False
    assert "Input/output error" in emergency["commit_error"] and emergency["saved"] is False
    assert session.save(_state(3), {}, force=True, reason="policy")
    mgr.error = OSError(28, "No space left on device")
    with pytest.raises(CheckpointSaveError):
        session.save(_state(4), {}, force=True, reason="final")  # still raised to the loop
    assert [r["kind"] for r in read_records(tmp_path)][-2:] == ["save_started", "save_failed"]


def test_emergency_save_that_commits_says_so(tmp_path):
    session = _session(tmp_path, _FakeManager(tmp_path / "checkpoints"))
    assert session.save(_state(2), {}, force=True, reason="emergency")
    session.record("emergency_save", step=2, saved=True, error="RuntimeError('boom')")
    recs = list(read_records(tmp_path))
    assert [r["kind"] for r in recs] == ["save_started", "committed", "emergency_save"]
    assert recs[-1]["committed"] is True and recs[-1]["save_started"] is True
    assert recs[-1]["saved"] is True


@pytest.mark.parametrize(
    "record",
    [
        {"kind": ["step"], "step": 1},
        {"kind": None, "step": 1},
        {"step": 1},
        {"kind": "committed"},
        {"kind": "committed", "step": "4"},
        {"kind": "step", "step": True},
        {"kind": "step", "step": 2.0},
        {"kind": "resume", "step": 2, "from_step": [2]},
        {"kind": "resume", "step": 2, "restore_s": "slow"},
        {"kind": "save_started", "step": 2, "blocking_s": True},
        {"kind": "step", "step": 2, "time": "noon"},
        {"kind": "start", "step": 0, "checkpoint_dirs": 5},
        {"kind": "start", "step": 0, "checkpoint_dirs": ["/a", 5]},
    ],
)
def test_a_record_whose_fields_have_other_types_is_skipped_as_malformed(tmp_path, record, caplog):
    good = {"kind": "committed", "step": 4, "time": 1.0, "checkpoint_dirs": ["/a"]}
    lines = [json.dumps(r) for r in (good, record, {"kind": "hang", "time": 2.0})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="ftrain.metrics.jsonl"):
        recs = list(read_records(tmp_path))
    assert recs == [good, {"kind": "hang", "time": 2.0}]  # a kind without a step is fine
    assert "skipped 1 unreadable or malformed line (first: line 2)" in caplog.text


def test_a_save_failing_while_another_error_ends_the_run_does_not_replace_it(tmp_path):
    """A peer died mid-collective while step 100's sharded save was in flight: the session's
    close raised the save's failure in place of the error that ended the run (a chain of
    three tracebacks). It is now recorded and said beside it; with no other error, the
    failure is still raised."""
    mgr = _FakeManager(tmp_path / "checkpoints")
    with pytest.raises(RuntimeError, match="peer closed"), _session(tmp_path, mgr) as session:
        assert session.save(_state(100), {}, force=True, reason="policy")
        mgr.error = RuntimeError("sharded save failed: peer gone")
        raise RuntimeError("Connection closed by peer closed")
    assert _kinds(tmp_path)[-1] == ("save_failed", 100)
    mgr = _FakeManager(tmp_path / "other")
    with pytest.raises(CheckpointSaveError), _session(tmp_path, mgr) as session:
        session.save(_state(2), {}, force=True, reason="policy")
        mgr.error = OSError(28, "No space left on device")
