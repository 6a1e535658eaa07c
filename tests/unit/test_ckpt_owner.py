"""A checkpoint location outside run.dir is claimed for one run directory
(``ftrain.ckpt.owner``): another run directory is refused, a restart of the same run
passes, a take-over replaces the claim, a damaged record never blocks a start, and a run
ends only its own record: freed where nothing is committed, kept (marked ended) where steps
are."""

from __future__ import annotations

import json
import threading

import pytest

from ftrain.ckpt.owner import OWNER, CheckpointOwnerError, claim


def test_a_second_run_directory_is_refused_with_the_owner_and_the_fix(tmp_path):
    ckpt = tmp_path / "shared"
    first = claim(ckpt, tmp_path / "run-a")
    with pytest.raises(CheckpointOwnerError) as err:
        claim(ckpt, tmp_path / "run-b")
    msg = str(err.value)
    assert str((tmp_path / "run-a").resolve()) in msg and "checkpoint.take_over=true" in msg
    assert json.loads((ckpt / OWNER).read_text())["token"] == first.record["token"]


def test_a_restart_of_the_same_run_directory_passes_and_rewrites_the_record(tmp_path):
    ckpt = tmp_path / "shared"
    old = claim(ckpt, tmp_path / "run-a")  # e.g. SIGKILLed: never released
    again = claim(ckpt, tmp_path / "run-a" / ".." / "run-a")  # the same directory, resolved
    assert again.record["token"] != old.record["token"]
    assert json.loads((ckpt / OWNER).read_text())["token"] == again.record["token"]


def test_take_over_replaces_another_run_directorys_claim(tmp_path, caplog):
    ckpt = tmp_path / "shared"
    claim(ckpt, tmp_path / "run-a")
    taken = claim(ckpt, tmp_path / "run-b", take_over=True)
    assert taken.taken_from["run_dir"] == str((tmp_path / "run-a").resolve())
    assert "checkpoint.take_over=true" in caplog.text
    assert json.loads((ckpt / OWNER).read_text())["run_dir"].endswith("run-b")


@pytest.mark.parametrize("damage", [b"", b'{"run_d', b"[1, 2]", b"\xff\xfe"])
def test_a_damaged_record_is_taken_over_not_a_blocked_start(tmp_path, damage, caplog):
    ckpt = tmp_path / "shared"
    ckpt.mkdir()
    (ckpt / OWNER).write_bytes(damage)
    got = claim(ckpt, tmp_path / "run-b")
    assert "unreadable" in caplog.text
    assert json.loads((ckpt / OWNER).read_text())["token"] == got.record["token"]


def test_a_fifo_in_place_of_the_record_is_taken_over_not_a_hang(tmp_path, caplog):
    """Reading it blocked every start on the location forever."""
    import os
    import threading

    ckpt = tmp_path / "shared"
    ckpt.mkdir()
    os.mkfifo(ckpt / OWNER)
    got = {}
    worker = threading.Thread(target=lambda: got.update(c=claim(ckpt, tmp_path / "b")), daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "hung on the FIFO"
    assert "not a regular file" in caplog.text
    assert json.loads((ckpt / OWNER).read_text())["token"] == got["c"].record["token"]


def test_release_removes_only_its_own_record(tmp_path):
    ckpt = tmp_path / "shared"
    a = claim(ckpt, tmp_path / "run-a")
    b = claim(ckpt, tmp_path / "run-b", take_over=True)  # a is gone, b took over
    a.release()  # a's late exit must not free b's location
    assert json.loads((ckpt / OWNER).read_text())["token"] == b.record["token"]
    b.release()
    assert not (ckpt / OWNER).exists()
    claim(ckpt, tmp_path / "run-c")  # free again


def test_a_finished_runs_steps_stay_claimed_and_the_refusal_names_init_from(tmp_path):
    """The record was removed at every run's end: another run.dir pointed at a finished
    run's checkpoints resumed its last step and committed into its directory (the next job
    of a sweep sharing checkpoint.dir trained on from the previous job's state)."""
    from ftrain.ckpt import CheckpointManager
    from tests.unit.test_ckpt_manager import make_state

    ckpt = tmp_path / "shared"
    a = claim(ckpt, tmp_path / "run-a")
    with CheckpointManager(ckpt, async_save=False) as mgr:
        mgr.save(make_state(5))
    a.release()
    kept = json.loads((ckpt / OWNER).read_text())
    assert kept["token"] == a.record["token"] and kept["ended"] >= kept["started"]
    with pytest.raises(CheckpointOwnerError) as err:
        claim(ckpt, tmp_path / "run-b")
    msg = str(err.value)
    assert "holds the checkpoints of another run" in msg and ", ended 20" in msg
    assert f"init.from={(tmp_path / 'run-a').resolve()}" in msg
    assert "checkpoint.take_over=true" in msg
    again = claim(ckpt, tmp_path / "run-a")  # its own restart (more steps) passes
    assert "ended" not in json.loads((ckpt / OWNER).read_text())
    again.release()
    claim(ckpt, tmp_path / "run-b", take_over=True)  # continuing it, said so


def test_of_two_starts_at_once_exactly_one_claims(tmp_path):
    ckpt = tmp_path / "shared"
    ckpt.mkdir()
    results: dict[str, object] = {}
    barrier = threading.Barrier(8)

    def start(name: str) -> None:
        barrier.wait()
        try:
            results[name] = claim(ckpt, tmp_path / name)
        except CheckpointOwnerError as e:
            results[name] = e

    threads = [threading.Thread(target=start, args=(f"run-{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [n for n, r in results.items() if not isinstance(r, Exception)]
    assert len(won) == 1
    assert json.loads((ckpt / OWNER).read_text())["run_dir"].endswith(won[0])
    assert [p.name for p in ckpt.iterdir()] == [OWNER]  # no temporary file left


def _failing_writes(monkeypatch):
    from ftrain.ckpt import owner

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(owner, "_write", full)


def test_an_unwritable_location_starts_unclaimed_with_a_warning(tmp_path, monkeypatch, caplog):
    """A full or read-only checkpoint.dir (what fallback_dir is for) must not stop a start;
    the claim is then not held, and releasing it touches nothing."""
    _failing_writes(monkeypatch)
    got = claim(tmp_path / "full", tmp_path / "run-a")
    assert not got.held and "could not claim" in caplog.text and "No space left" in caplog.text
    got.release()


def test_an_unwritable_location_still_refuses_another_runs_record(tmp_path, monkeypatch):
    ckpt = tmp_path / "shared"
    claim(ckpt, tmp_path / "run-a")
    _failing_writes(monkeypatch)
    with pytest.raises(CheckpointOwnerError, match="belongs to another run"):
        claim(ckpt, tmp_path / "run-b")
    assert claim(ckpt, tmp_path / "run-a").taken_from is not None  # its own restart passes


def test_a_record_neither_written_nor_read_refuses_the_start(tmp_path, monkeypatch):
    from ftrain.ckpt import owner

    _failing_writes(monkeypatch)

    def unreadable(location):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(owner, "_read", unreadable)
    with pytest.raises(CheckpointOwnerError, match="reading it failed"):
        claim(tmp_path / "bad", tmp_path / "run-a")


def test_a_write_that_landed_but_failed_to_answer_is_held_and_released(tmp_path, monkeypatch):
    from ftrain.ckpt import owner

    real = owner._write

    def landed_then_failed(*args, **kwargs):
        real(*args, **kwargs)
        raise OSError(104, "Connection reset by peer")

    monkeypatch.setattr(owner, "_write", landed_then_failed)
    got = claim(tmp_path / "ckpt", tmp_path / "run-a")
    assert got.held
    got.release()
    assert not (tmp_path / "ckpt" / OWNER).exists()


def test_a_moved_run_directory_takes_its_claim_along_but_a_copy_does_not(tmp_path):
    """A run's own checkpoints carry its record: after ``mv runs/a runs/b`` (on this host,
    the old path gone) the restart in the new place takes it over; a copy whose original
    still exists is refused (two runs could continue one history)."""
    import shutil

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    claim(a / "checkpoints", a)  # left behind, as by a SIGKILL
    shutil.copytree(a, c)
    with pytest.raises(CheckpointOwnerError, match="belongs to another run"):
        claim(c / "checkpoints", c)  # a copy: the original run directory is still there
    a.rename(b)
    moved = claim(b / "checkpoints", b)
    assert moved.taken_from["run_dir"] == str(a.resolve())
    assert json.loads((b / "checkpoints" / OWNER).read_text())["run_dir"] == str(b.resolve())
    with pytest.raises(CheckpointOwnerError, match="belongs to another run"):
        claim(b / "checkpoints", tmp_path / "elsewhere")  # not inside that run.dir


def test_a_release_racing_a_take_over_leaves_the_new_owners_record(tmp_path, monkeypatch):
    """Run a ends (reads its token) while run b takes over: a's remove must not land on b's
    record, or a third run could then claim b's live location."""
    from ftrain.ckpt import owner

    ckpt = tmp_path / "shared"
    a = claim(ckpt, tmp_path / "run-a")
    real_read, got = owner._read, {}

    def take_over_between_read_and_delete(location):
        held = real_read(location)
        if "b" not in got:  # only a's release: start b's take-over now and give it time
            got["b"] = None
            b = threading.Thread(
                target=lambda: got.update(b=claim(ckpt, tmp_path / "run-b", take_over=True))
            )
            b.start()
            b.join(0.5)  # blocked on the location's lock: it waits for a's release
            got["thread"] = b
        return held

    monkeypatch.setattr(owner, "_read", take_over_between_read_and_delete)
    a.release()
    got["thread"].join(30)
    monkeypatch.setattr(owner, "_read", real_read)
    assert json.loads((ckpt / OWNER).read_text())["token"] == got["b"].record["token"]
    with pytest.raises(CheckpointOwnerError, match="belongs to another run"):
        claim(ckpt, tmp_path / "run-c")


def test_a_finished_runs_copied_or_moved_directory_continues_from_any_host(tmp_path, caplog):
    """A finished run's record stays; a copy of its run directory (`cp -r runs/a runs/b`, a
    move to a node where the old path is not seen) holds it inside the new run.dir: that
    copy is its own history in its own place, continued with a warning."""
    import os
    import shutil

    from ftrain.ckpt import CheckpointManager
    from tests.unit.test_ckpt_manager import make_state

    old = os.umask(0o002)
    try:
        a = claim(tmp_path / "a" / "checkpoints", tmp_path / "a")
        with CheckpointManager(tmp_path / "a" / "checkpoints", async_save=False) as mgr:
            mgr.save(make_state(3))
        a.release()
    finally:
        os.umask(old)
    record = tmp_path / "a" / "checkpoints" / OWNER
    assert oct(record.stat().st_mode & 0o777) == "0o664"  # a teammate reads it (was 0600)
    held = json.loads(record.read_text())
    record.write_text(json.dumps(held | {"host": "another-node"}))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    with caplog.at_level("WARNING"):
        claim(tmp_path / "b" / "checkpoints", tmp_path / "b")
    assert "moved or copied here" in caplog.text
    with pytest.raises(CheckpointOwnerError):  # a third run.dir pointed at a's: refused
        claim(tmp_path / "a" / "checkpoints", tmp_path / "c")


def test_ending_a_claim_never_raises(tmp_path, monkeypatch):
    """A step of a newer format (a RuntimeError from the listing) raised out of the end of
    the claim, a traceback after the start's own one-line refusal."""
    c = claim(tmp_path / "ck", tmp_path / "run")

    def newer(*args, **kwargs):
        raise RuntimeError("step 10 was written by a newer ftrain")

    monkeypatch.setattr("ftrain.ckpt.owner._holds_steps", newer)
    c.release()  # no raise; the record stays for the next start to decide
    assert (tmp_path / "ck" / OWNER).exists()
