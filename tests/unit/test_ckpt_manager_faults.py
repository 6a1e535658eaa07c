"""CheckpointManager fault paths found by review: a step whose metadata cannot be read
for a moment, a save failing with something other than an OSError, a commit into a
directory that holds newer steps, the wall clock stepping back, an old step restored mid
run, a failure after the rename, and a sharded manifest with a hole."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import types
import warnings

import pytest
import torch

from ftrain.ckpt import (
    AnyOf,
    BestN,
    CheckpointManager,
    CheckpointReadError,
    CheckpointSaveError,
    EveryKSteps,
    EveryNSeconds,
    LatestN,
    manager,
    store,
)
from ftrain.ckpt import commit as protocol
from ftrain.ckpt import format as fmt
from ftrain.ckpt.store import merge_manifests
from tests.unit.test_ckpt_commit import as_format
from tests.unit.test_ckpt_manager import make_state, same


def _listed(d) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("step_"))


def test_a_step_whose_metadata_cannot_be_read_for_a_moment_is_kept_not_deleted(
    tmp_path, monkeypatch
):
    with CheckpointManager(tmp_path, async_save=False, keep_policy=LatestN(5)) as m:
        for s in (1, 2):
            m.save(make_state(s), force=True)
    (tmp_path / "checkpoints.json").unlink()  # killed before the index write
    real_open = os.open

    def emfile_on_step_1(path, flags, *a, **k):
        if str(path).endswith("step_00000001/zarr.json"):
            raise OSError(errno.EMFILE, "Too many open files", str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(fmt.os, "open", emfile_on_step_1)
    with CheckpointManager(tmp_path, async_save=False, keep_policy=LatestN(1)) as m:
        assert m.save(make_state(3), force=True)
    monkeypatch.setattr(fmt.os, "open", real_open)
    again = CheckpointManager(tmp_path, async_save=False, keep_policy=LatestN(5))
    # step 2 was the policy's to delete (LatestN(1), readable); step 1 was not judged
    assert again.all_steps() == [1, 3]
    assert same(again.restore(1), make_state(1))


@pytest.mark.parametrize(
    "where, err, said, code",
    [
        ("marker", errno.EMFILE, "a limit of this machine", 1),
        ("marker", errno.EACCES, "give this user read access", 2),
        ("chunk", errno.EACCES, "give this user read access", 2),
    ],
)
def test_a_file_the_machine_or_the_user_cannot_read_judges_no_step(
    tmp_path, monkeypatch, capsys, where, err, said, code
):
    """EMFILE reading the newest step's marker made it "not committed", and a chunk or
    marker of another user's (mode 600) was "corrupt": restore took the step before (its
    steps trained again) and the next save of that number set the intact step aside. The
    restore now raises CheckpointReadError (CheckpointAccessError, a PermissionError, for a
    permission); the steps are as they were; the tools say it in one line, exit 1 for a
    limit of the machine (retry), 2 for a permission (a retry fails the same way)."""
    from ftrain.ckpt import chunkio
    from ftrain.ckpt.__main__ import main as ckpt_tool
    from ftrain.ckpt.format import CheckpointAccessError

    with CheckpointManager(tmp_path, async_save=False) as m:
        for s in (1, 2):
            m.save(make_state(s), force=True)
    module = fmt if where == "marker" else chunkio
    real_open = module.os.open

    def refused_in_step_2(path, flags, *a, **k):
        if "step_00000002" in str(path) and (where == "marker" or "/params/" in str(path)):
            raise OSError(err, os.strerror(err), str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(module.os, "open", refused_in_step_2)
    raised = CheckpointAccessError if err == errno.EACCES else CheckpointReadError
    with pytest.raises(raised, match=said):
        CheckpointManager(tmp_path, async_save=False).restore()
    capsys.readouterr()
    assert ckpt_tool(["verify", str(tmp_path)]) == code  # one line, not a traceback
    assert said in capsys.readouterr().err
    monkeypatch.setattr(module.os, "open", real_open)
    again = CheckpointManager(tmp_path, async_save=False)
    assert again.all_steps() == [1, 2] and same(again.restore(), make_state(2))


def test_a_step_larger_than_the_memory_available_now_is_not_judged_corrupt(tmp_path, monkeypatch):
    """The memory check called an intact step that did not fit in the memory available
    at the moment (another process holding it) corrupt: restore fell back to an older step
    (its steps trained again) and the next save of the newest number set it aside. Now it
    is CheckpointReadError; once memory is free, the newest step restores."""
    from ftrain.ckpt import reader

    with CheckpointManager(tmp_path, async_save=False) as m:
        for s in (1, 2):
            m.save(make_state(s), force=True)
    monkeypatch.setattr(reader, "_available_memory", lambda: 64)
    with pytest.raises(CheckpointReadError, match="bytes of memory, only 64 are available"):
        CheckpointManager(tmp_path, async_save=False).restore()
    monkeypatch.undo()
    again = CheckpointManager(tmp_path, async_save=False)
    assert again.all_steps() == [1, 2] and same(again.restore(), make_state(2))


def test_a_manifest_declaring_more_than_its_files_hold_is_corrupt_not_a_memory_limit(
    tmp_path, monkeypatch
):
    """The sizes are checked before the memory: a shape its chunk files do not back is
    the step's fault (restore falls back), whatever the memory."""
    from ftrain.ckpt import reader

    with CheckpointManager(tmp_path, async_save=False) as m:
        for s in (1, 2):
            m.save(make_state(s), force=True)
    chunk = tmp_path / "step_00000002" / "params" / "w" / "c.0.0"
    chunk.write_bytes(chunk.read_bytes()[:-1])
    monkeypatch.setattr(reader, "_available_memory", lambda: 64)
    m = CheckpointManager(tmp_path, async_save=False)
    with (
        pytest.warns(RuntimeWarning, match="chunk is"),
        pytest.raises(CheckpointReadError, match="only 64 are available"),
    ):
        m.restore()  # step 2 is passed over as corrupt; step 1 is intact, too large


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_failing_with_a_memory_error_leaves_the_step_unsaved_for_the_emergency_save(
    tmp_path, monkeypatch, async_save
):
    m = CheckpointManager(tmp_path, async_save=async_save)
    real = store.write_chunk

    def out_of_memory(*a, **k):
        raise MemoryError("cannot allocate the compression buffer")

    monkeypatch.setattr(store, "write_chunk", out_of_memory)
    with pytest.raises(CheckpointSaveError, match="MemoryError"):
        m.save(make_state(7), force=True)
        m.wait()
    monkeypatch.setattr(store, "write_chunk", real)
    assert m.save(make_state(7), force=True), "the emergency save of the same step runs"
    m.close()
    assert m.all_steps() == [7] and _listed(tmp_path) == ["step_00000007"]


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_background_save_is_said_when_it_fails_and_named_when_raised(
    tmp_path, monkeypatch, caplog, failure
):
    """A script that ended without wait() or close() never heard that its last save failed
    (exit 0, no step on disk); a KeyboardInterrupt in the writer was raised as "a background
    checkpoint save failed: " with nothing after it."""
    m = CheckpointManager(tmp_path, async_save=True)

    def failing(*a, **k):
        raise failure

    monkeypatch.setattr(store, "write_chunk", failing)
    with caplog.at_level(logging.ERROR, logger="ftrain.ckpt"):
        assert m.save(make_state(7), force=True)
        m._thread.join()  # the writer is done; nobody has called the manager since
    said = "No space left" if isinstance(failure, OSError) else "KeyboardInterrupt"
    assert "the background save of step 7 failed (" in caplog.text and said in caplog.text
    with pytest.raises(CheckpointSaveError, match=said):
        m.close()


def test_a_commit_is_never_deleted_by_its_own_retention(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(make_state(1000), force=True)
    with CheckpointManager(tmp_path, async_save=False, keep_policy=LatestN(1)) as m:
        assert m.save(make_state(100), force=True)  # a fresh start into the same directory
        assert m.all_steps() == [100, 1000], "the step just committed, and the newest"
        assert same(m.restore(100), make_state(100))


def test_an_older_step_saved_after_a_newer_commit_sets_nothing_aside(tmp_path):
    """An emergency save of the loop's last finished state (99) after the policy save of
    100 committed (an error between the two): no restore happened, so 100 is not of
    another history and stays the newest."""
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(make_state(100), force=True)
        assert m.save(make_state(99), force=True)
        assert m.all_steps() == [99, 100] and not m.set_aside_steps()
        assert same(m.restore(), make_state(100))


def test_time_based_saves_go_on_when_the_wall_clock_steps_back(tmp_path, monkeypatch):
    wall, mono = [1_000_000.0], [50.0]
    fake = types.SimpleNamespace(
        time=lambda: wall[0], monotonic=lambda: mono[0], perf_counter=time.perf_counter
    )
    monkeypatch.setattr(manager, "time", fake)
    m = CheckpointManager(tmp_path, async_save=False, save_policy=EveryNSeconds(60))
    assert m.save(make_state(1))
    wall[0] -= 3600  # NTP steps the clock back an hour
    saved = []
    for s in range(2, 5):
        wall[0] += 30
        mono[0] += 30
        saved.append(m.save(make_state(s)))
    assert saved == [False, True, False], "the interval is counted on the monotonic clock"
    assert m.all_steps() == [1, 3]


def test_looking_at_an_old_step_mid_run_sets_nothing_aside(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as m:
        for s in (10, 20, 30):
            m.save(make_state(s), force=True)
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.restore()  # the resume: from 30
        m.save(make_state(40), force=True)
        assert same(m.restore(20), make_state(20))  # e.g. to evaluate it
        m.save(make_state(50), force=True)
        assert m.all_steps() == [10, 20, 30, 40, 50] and not m.set_aside_steps()


def test_training_on_from_an_older_step_sets_the_abandoned_steps_aside(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as m:
        for s in (10, 20, 30):
            m.save(make_state(s), force=True)
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.restore()
        m.save(make_state(40), force=True)
        m.restore(20)  # went back, e.g. past a loss spike
        other = make_state(25, n=32)
        assert m.save(other, force=True)
        assert m.all_steps() == [10, 20, 25], "30 (the last run's) and 40 (its own) abandoned"
        assert sorted(m.set_aside_steps()) == [30, 40]
        assert m.save(make_state(40, n=32), force=True), "the new history saves its own 40"
        assert same(m.restore(), make_state(40, n=32))


def test_a_failed_directory_fsync_after_the_rename_still_reports_the_commit(
    tmp_path, monkeypatch, caplog
):
    real = protocol.fsync_dir

    def eio_on_the_root(path):
        if path == tmp_path:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path)

    monkeypatch.setattr(protocol, "fsync_dir", eio_on_the_root)
    with (
        caplog.at_level(logging.WARNING, logger="ftrain.ckpt.commit"),
        CheckpointManager(tmp_path, async_save=False) as m,
    ):
        assert m.save(make_state(5), force=True)
    assert "fsync of" in caplog.text and "Input/output error" in caplog.text
    monkeypatch.setattr(protocol, "fsync_dir", real)
    assert CheckpointManager(tmp_path).all_steps() == [5]


def test_a_retention_failure_after_the_commit_is_a_warning_not_a_lost_save(tmp_path, monkeypatch):
    m = CheckpointManager(tmp_path, async_save=False, keep_policy=LatestN(1))
    m.save(make_state(1), force=True)

    def read_only(path):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(protocol, "delete_step", read_only)
    assert m.save(make_state(2), force=True)
    assert not m.save(make_state(2), force=True), "step 2 is saved: not offered again"
    assert m.all_steps() == [1, 2]


def test_a_read_only_primary_does_not_stop_retention_at_the_fallback(tmp_path, monkeypatch, caplog):
    """The primary remounted read-only: the first step it could not delete raised out of
    retention, so the fallback that took every later save was never pruned (and the
    index and best marks never written) until its disk filled too. Now each copy that
    cannot be deleted is kept with a warning and retention goes on elsewhere."""
    primary, fallback = tmp_path / "p", tmp_path / "f"
    with CheckpointManager(primary, async_save=False, keep_policy=LatestN(2)) as m:
        for s in (1, 2):
            m.save(make_state(s), force=True)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    real_begin, real_delete = protocol.begin, protocol.delete_step
    monkeypatch.setattr(
        protocol,
        "begin",
        lambda root, step: read_only() if root == primary else real_begin(root, step),
    )
    monkeypatch.setattr(
        protocol,
        "delete_step",
        lambda p: read_only() if p.parent == primary else real_delete(p),
    )
    m = CheckpointManager(
        primary, async_save=False, fallback_directory=fallback, keep_policy=LatestN(2)
    )
    with caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the save's own "saving to fallback" warning
        for s in (3, 4, 5):
            assert m.save(make_state(s), force=True)
    warned = [r for r in caplog.records if "could not be deleted by keep policy" in r.message]
    assert len(warned) == 2, "once for each of the primary's copies, not at every save"
    assert "Read-only file system" in warned[0].message
    assert CheckpointManager(fallback).all_steps() == [4, 5]  # 3 pruned past the primary's
    assert m.all_steps() == [1, 2, 4, 5]  # the primary's copies kept, still listed


def _part(crcs, arrays=("w",)):
    return {
        "format_version": 2,
        "groups": [""],
        "documents": {},
        "nbytes": 8,
        "linked_bytes": 0,
        "arrays": {a: {"dtype": "float32", "shape": [len(crcs)], "chunk_shape": [1],
                       "crc32c": list(crcs), "stored_nbytes": [4 if c else None for c in crcs],
                       "compression": "zstd:3"}
                   for a in arrays},
    }  # fmt: skip


def test_a_sharded_manifest_with_a_chunk_no_rank_wrote_is_refused():
    merged = merge_manifests([_part([1, None]), _part([None, 2])])
    assert merged["arrays"]["w"]["crc32c"] == [1, 2]
    with pytest.raises(ValueError, match=r"array 'w': no rank wrote chunk\(s\) \[1\]"):
        merge_manifests([_part([1, None]), _part([None, None])])
    with pytest.raises(ValueError, match="different arrays"):
        merge_manifests([_part([1]), _part([2], arrays=("w", "v"))])
    zero = _part([])  # a (4, 0) leaf once planned a zero chunk dimension: never committed
    zero["arrays"]["w"] |= {"shape": [4, 0], "chunk_shape": [2, 0]}
    with pytest.raises(ValueError, match="not one a restore accepts.*chunk_shape holds 0"):
        merge_manifests([zero, zero])


@pytest.mark.parametrize("async_save", [False, True])
def test_a_step_reached_again_after_going_back_is_saved_from_the_new_history(tmp_path, async_save):
    """Committed 20, went back to 10 in the same process and trained on to 20 again with no
    commit in between: the new 20 is saved (the old one moved aside), never skipped as
    "already saved" — else a crash after it resumes from the abandoned history."""
    with CheckpointManager(tmp_path, async_save=async_save) as m:
        m.save(make_state(10), force=True)
        m.save(make_state(20), force=True)
        m.wait()
        m.restore(10)
        assert not m.save(make_state(10), force=True), "10 is the restored step, on disk"
        again = make_state(20, n=32)
        assert m.save(again, force=True)
        assert not m.save(again, force=True), "the new 20 is saved once"
        m.wait()
        assert m.all_steps() == [10, 20] and sorted(m.set_aside_steps()) == [20]
    assert same(CheckpointManager(tmp_path).restore(), again)


def test_a_failed_save_of_a_step_reached_again_can_be_retried(tmp_path, monkeypatch):
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(make_state(10), force=True)
        m.save(make_state(20), force=True)
        m.restore(10)
        real = manager.write_tree

        def enospc(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(manager, "write_tree", enospc)
        again = make_state(20, n=32)
        with pytest.raises(CheckpointSaveError):
            m.save(again, force=True)
        monkeypatch.setattr(manager, "write_tree", real)
        assert m.save(again, force=True), "the emergency save writes the new 20"
    assert same(CheckpointManager(tmp_path).restore(), again)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_newer_format_step_appearing_mid_run_does_not_unsay_a_commit(tmp_path, async_save):
    """A step written by a newer ftrain shows up beside this run's (a second version run on
    the same directory): this run's next commit stands and is reported as one; retention
    leaves everything alone and says why, instead of raising after the rename."""
    with CheckpointManager(tmp_path, async_save=async_save, keep_policy=LatestN(1)) as m:
        m.save(make_state(1), force=True)
        m.save(make_state(9), force=True)
        m.wait()
        newer = tmp_path / "step_00000009"
        as_format(newer, 99)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert m.save(make_state(2), force=True)
            m.wait()
        assert any("retention or the index failed" in str(w.message) for w in caught)
        assert not m.save(make_state(2), force=True), "step 2 is committed"
    assert (tmp_path / "step_00000002" / "COMMITTED").exists() and newer.exists()


def test_going_back_sets_aside_the_old_steps_before_the_new_commit_too(tmp_path):
    """Restored 10 with 20..40 committed, trained on and committed 25: the old 20 is of the
    abandoned history as much as 30 and 40 (a resume falling back past a corrupt 25 must
    not land in it)."""
    with CheckpointManager(tmp_path, async_save=False) as m:
        for s in (10, 20, 30, 40):
            m.save(make_state(s), force=True)
        m.restore(10)
        new = make_state(25, n=32)
        assert m.save(new, force=True)
        assert m.all_steps() == [10, 25] and sorted(m.set_aside_steps()) == [20, 30, 40]
    (tmp_path / "step_00000025" / "COMMITTED").unlink()  # the new step is lost
    assert same(CheckpointManager(tmp_path).restore(), make_state(10)), "the common ancestor"


def test_after_going_back_steps_retention_deleted_are_saved_again(tmp_path):
    """110 and 120 were committed then deleted by retention; after going back to 100 the
    new history's 110 and 120 are saved, never skipped as "already saved"."""
    keep = AnyOf(LatestN(1), EveryKSteps(100))
    with CheckpointManager(tmp_path, async_save=False, keep_policy=keep) as m:
        for s in (100, 110, 120, 130):
            m.save(make_state(s), force=True)
        assert m.all_steps() == [100, 130]
        m.restore(100)
        assert m.save(make_state(110, n=32), force=True)
        assert m.save(make_state(120, n=32), force=True), "a final or stop save of 120"
        assert m.all_steps() == [100, 120]
        assert same(m.restore(), make_state(120, n=32))


def test_a_look_at_an_old_step_before_the_first_commit_keeps_the_resumed_history(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as m:
        for s in (10, 20, 30):
            m.save(make_state(s), force=True)
    with CheckpointManager(tmp_path, async_save=False) as m:
        assert same(m.restore(), make_state(30))  # the resume
        assert same(m.restore(10), make_state(10))  # e.g. to evaluate it
        m.save(make_state(40), force=True)
        assert m.all_steps() == [10, 20, 30, 40] and not m.set_aside_steps()


def test_a_look_at_an_older_step_after_going_back_keeps_the_current_history(tmp_path):
    """Went back to 30, looked at 10, committed 35: the run went on from 30, so 20 and 30
    are its history (only 40 is the abandoned one)."""
    with CheckpointManager(tmp_path, async_save=False) as m:
        for s in (10, 20, 30, 40):
            m.save(make_state(s), force=True)
        m.restore(30)  # went back
        assert same(m.restore(10), make_state(10))  # a look, e.g. to evaluate it
        m.save(make_state(35, n=32), force=True)
        assert m.all_steps() == [10, 20, 30, 35] and sorted(m.set_aside_steps()) == [40]


def test_a_look_before_the_first_commit_of_an_explicit_resume_keeps_its_branch_point(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as m:
        for s in (10, 20, 30, 40):
            m.save(make_state(s), force=True)
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.restore(20)  # resume=20
        m.restore(10)  # a look
        new = make_state(30, n=32)
        m.save(new, force=True)
        assert m.all_steps() == [10, 20, 30] and sorted(m.set_aside_steps()) == [30, 40]
        assert same(m.restore(), new)


def test_going_back_past_the_branch_point_saves_the_branch_step_of_the_new_history(tmp_path):
    """Resumed from 20, committed 30, went back to 10 and committed 15: the new history's
    20 is saved (not skipped as the branch point), so a fallback never skips past it."""
    with CheckpointManager(tmp_path, async_save=False) as m:
        for s in (10, 20):
            m.save(make_state(s), force=True)
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.restore()  # from 20: the branch point
        m.save(make_state(30), force=True)
        m.restore(10)
        m.save(make_state(15, n=32), force=True)
        assert m.all_steps() == [10, 15] and sorted(m.set_aside_steps()) == [20, 30]
        new20 = make_state(20, n=32)
        assert m.save(new20, force=True), "the new history's 20"
        m.save(make_state(25, n=32), force=True)
    (tmp_path / "step_00000025" / "COMMITTED").unlink()
    assert same(CheckpointManager(tmp_path).restore(), new20)


@pytest.mark.parametrize("when", ["index", "retention"])
def test_a_stale_index_never_lends_a_redone_step_the_old_copys_metrics(tmp_path, when):
    """Step 10 redone at the same path (val .05 -> .5) and the run killed before the index
    was rewritten: the next manager must judge 10 by its new copy, or BestN would keep 10
    as the best and delete 5, the real best."""
    keep = AnyOf(BestN("val", 1), LatestN(2))
    with CheckpointManager(tmp_path, async_save=False, keep_policy=keep) as m:
        m.save(make_state(5), metrics={"val": 0.3}, force=True)
        m.save(make_state(10), metrics={"val": 0.05}, force=True)
    stale = (tmp_path / "checkpoints.json").read_bytes()
    with CheckpointManager(tmp_path, async_save=False, keep_policy=keep) as m:
        m.restore(5)
        m.save(make_state(10, n=32), metrics={"val": 0.5}, force=True)
    (tmp_path / "checkpoints.json").write_bytes(stale)  # as if killed before it was rewritten
    with CheckpointManager(tmp_path, async_save=False, keep_policy=keep) as m:
        if when == "index":
            assert {e["step"]: e["metrics"]["val"] for e in m.index()}[10] == 0.5
        m.save(make_state(15), metrics={"val": 0.4}, force=True)
        assert m.all_steps() == [5, 10, 15], "5 is the best, 10 and 15 the latest"


def test_a_step_held_in_both_locations_is_read_from_the_copy_asked_for(tmp_path):
    """The primary and the fallback location each hold a copy of step 5 (a redo whose
    older copy was not set aside yet): ``restore`` says which copy it read, and another
    rank given that copy reads exactly it, never the other one."""
    primary, fallback = tmp_path / "p", tmp_path / "f"
    a, b = make_state(5), make_state(5, n=32)
    CheckpointManager(primary, async_save=False).save(a, force=True)
    CheckpointManager(fallback, async_save=False).save(b, force=True)
    m = CheckpointManager(primary, async_save=False, fallback_directory=fallback)
    (_, seal_b), (_, seal_a) = m.committed_copies()
    assert seal_a != seal_b
    assert same(m.restore(5), b) and m.restored_copy == seal_b  # the copy saved last first
    assert same(m.restore(5, copy=seal_a), a) and m.restored_copy == seal_a
    with pytest.raises(manager.CheckpointNotFoundError, match="of copy 7"):
        m.restore(5, copy=7)


def test_a_write_killed_after_going_back_leaves_no_old_copy_of_its_step_listed(
    tmp_path, monkeypatch
):
    """Restored 3 over 3, 6, 9 and writing the new 6 when the process dies (emulated by an
    exception no save handles): the old 6 was set aside before the write with 9, so a
    restart resumes from 3, never from the abandoned history's 6."""

    class Killed(BaseException):
        pass

    with CheckpointManager(tmp_path, async_save=False) as m:
        for s in (3, 6, 9):
            m.save(make_state(s), force=True)
    m = CheckpointManager(tmp_path, async_save=False)
    m.restore(3)

    def killed(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(manager, "write_tree", killed)
    with pytest.raises(Killed):
        m.save(make_state(6, n=32), force=True)
    fresh = CheckpointManager(tmp_path, async_save=False)
    assert fresh.all_steps() == [3] and sorted(fresh.set_aside_steps()) == [6, 9]
    assert same(fresh.restore(), make_state(3))


@pytest.mark.parametrize("clock", ["right", "stepped back an hour"])
def test_a_location_refusing_the_set_aside_does_not_stop_every_later_save(
    tmp_path, monkeypatch, clock
):
    """After going back, the primary refuses to move the old history's steps (remounted
    read-only after a disk error): a warning, and the saves go on (to the fallback), where
    failing would leave the run unable to checkpoint again. The copy saved last is read,
    also when the wall clock stepped back between the histories (a VM restored from a
    snapshot): the copies were ordered by their recorded save time, and the old history's
    20 was read, and fallen back to past a damaged 30."""
    primary, fallback = tmp_path / "p", tmp_path / "f"
    with CheckpointManager(primary, async_save=False) as m:
        for s in (10, 20):
            m.save(make_state(s), force=True)
    if clock != "right":
        real_time = time.time
        monkeypatch.setattr(time, "time", lambda: real_time() - 3600)
    m = CheckpointManager(primary, async_save=False, fallback_directory=fallback)
    m.restore(10)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    real_begin = protocol.begin

    def begin(root, step):  # no staging on the primary either
        return read_only() if root == primary else real_begin(root, step)

    monkeypatch.setattr(protocol, "set_aside", read_only)
    monkeypatch.setattr(protocol, "begin", begin)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert m.save(make_state(20, n=32), force=True)
        assert m.save(make_state(30, n=32), force=True)
    assert any("could not move" in str(w.message) for w in caught)
    assert CheckpointManager(fallback).all_steps() == [20, 30]
    # a restart reads the new history's 20, not the primary's old copy left listed
    both = CheckpointManager(primary, async_save=False, fallback_directory=fallback)
    assert same(both.restore(20), make_state(20, n=32))
    assert both.metadata(20)["path"] == str(fallback / "step_00000020")
    chunk = next(p for p in (fallback / "step_00000030").rglob("c*") if p.is_file())
    chunk.write_bytes(bytes(b ^ 0xFF for b in chunk.read_bytes()))  # past it: the new 20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert same(both.restore(), make_state(20, n=32))


def test_the_metadata_of_a_restored_copy_is_that_copys(tmp_path):
    primary, fallback = tmp_path / "p", tmp_path / "f"
    CheckpointManager(primary, async_save=False).save(make_state(5), metadata={"w": "a"})
    CheckpointManager(fallback, async_save=False).save(make_state(5), metadata={"w": "b"})
    m = CheckpointManager(primary, async_save=False, fallback_directory=fallback)
    (_, seal_b), (_, seal_a) = m.committed_copies()  # the copy saved last first
    m.restore(5, copy=seal_a)
    assert m.metadata(5, copy=m.restored_copy)["w"] == "a"
    assert m.metadata(5)["w"] == "b"  # without a copy: the one saved last


def test_saves_from_two_threads_never_run_two_writers_at_once(tmp_path, monkeypatch):
    """The hang watchdog's save beside a loop that woke up: two threads that both waited
    for the save in flight started a background writer each (and could join a thread the
    other had just cleared). Now one save at a time, each committed."""
    real, active, most = manager.write_tree, [0], [0]
    lock = threading.Lock()

    def slow_write(*args, **kwargs):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            time.sleep(0.3)
            return real(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(manager, "write_tree", slow_write)
    m = CheckpointManager(tmp_path, async_save=True)
    assert m.save(make_state(1), force=True)  # in flight while the two threads arrive
    threads = [
        threading.Thread(target=m.save, args=(make_state(s),), kwargs={"force": True})
        for s in (2, 3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m.wait()
    assert most[0] == 1 and m.all_steps() == [1, 2, 3]


def test_a_fallback_that_is_the_primary_under_another_spelling_is_refused(tmp_path, monkeypatch):
    """Before: each commit moved itself aside as its own "replaced copy" in the other
    location; save() returned True and no step stayed listed."""
    from ftrain.ckpt import CheckpointLocationError

    monkeypatch.chdir(tmp_path)
    for fallback in ("ck", "./ck/", tmp_path / "x" / ".." / "ck"):
        with pytest.raises(CheckpointLocationError, match="under another spelling"):
            CheckpointManager(tmp_path / "ck", fallback_directory=fallback)
    CheckpointManager(tmp_path / "ck", fallback_directory="ck2").close()


def test_a_save_from_another_thread_cannot_outlive_close(tmp_path):
    """close() waited, then marked itself closed without the save lock: a save from another
    thread (the hang watchdog's) that got in between started a write close() never waited
    for, and its failure was never raised. Now it waits for close() and is refused."""
    m = CheckpointManager(tmp_path, async_save=True)
    m.save(make_state(1))
    m.wait()
    real_wait, in_gap, other_done = m.wait, threading.Event(), threading.Event()
    result = {}

    def wait_then_yield():  # close() preempted right after its wait
        real_wait()
        if threading.current_thread() is threading.main_thread() and not in_gap.is_set():
            in_gap.set()
            other_done.wait(2)

    def other():
        in_gap.wait(5)
        try:
            result["saved"] = m.save(make_state(2))
        except RuntimeError as e:
            result["refused"] = str(e)
        other_done.set()

    m.wait = wait_then_yield
    t = threading.Thread(target=other)
    t.start()
    m.close()
    t.join(10)
    assert result == {"refused": "this CheckpointManager is closed; create a new one"}
    assert m._thread is None and CheckpointManager(tmp_path).all_steps() == [1]


def test_a_negative_step_is_refused_by_save_itself(tmp_path):
    """An async save(step=-1) returned True and failed on the next call instead."""
    m = CheckpointManager(tmp_path, async_save=True)
    bad = make_state(1).clone()
    bad["step"] = torch.tensor(-1)
    with pytest.raises(ValueError, match=r"state\['step'\] must be >= 0 \(a step number\), got -1"):
        m.save(bad)
    assert m.save(make_state(2)) and (m.wait() is None) and m.all_steps() == [2]


def test_a_replaced_copy_that_cannot_move_does_not_stop_retention(tmp_path, monkeypatch):
    """Step 5 committed again in the primary while the fallback holds an older copy that
    cannot be moved aside (a read-only location): the commit stands, retention and the
    index still run (before, the error ended them for this and every later such save)."""
    primary, fallback = tmp_path / "p", tmp_path / "f"
    for s in (3, 4, 5):
        CheckpointManager(fallback, async_save=False).save(make_state(s), force=True)
    m = CheckpointManager(
        primary, async_save=False, fallback_directory=fallback, keep_policy=LatestN(1)
    )
    monkeypatch.setattr(
        protocol, "set_aside", lambda *a: (_ for _ in ()).throw(OSError(30, "EROFS"))
    )
    with pytest.warns(
        RuntimeWarning, match=r"could not move .*f/step_00000005 aside \(\[Errno 30\]"
    ):
        assert m.save(make_state(5), force=True)
    assert (primary / "step_00000005" / "COMMITTED").exists()
    assert not (fallback / "step_00000003").exists()  # retention ran: LatestN(1)


def test_a_time_policy_counts_from_the_resume(tmp_path, monkeypatch):
    # the restored step is the last save: a 60 s policy saved again at the first step of
    # every restart (an unplanned full checkpoint per restart, pushing out kept steps)
    mono = [50.0]
    fake = types.SimpleNamespace(
        time=time.time, monotonic=lambda: mono[0], perf_counter=time.perf_counter
    )
    monkeypatch.setattr(manager, "time", fake)
    with CheckpointManager(tmp_path, async_save=False, save_policy=EveryNSeconds(60)) as m:
        assert m.save(make_state(1))
    m = CheckpointManager(tmp_path, async_save=False, save_policy=EveryNSeconds(60))
    assert int(m.restore()["step"]) == 1
    saved = []
    for s in range(2, 5):
        mono[0] += 30
        saved.append(m.save(make_state(s)))
    assert saved == [False, True, False] and m.all_steps() == [1, 3]


def test_a_kill_between_the_renames_of_a_go_back_leaves_none_of_the_old_history_listed(
    tmp_path, monkeypatch
):
    """resume=2 on a run that reached 4, then the first save moves 3 and 4 aside one rename
    at a time: a kill between them left 2 and the old 4 listed (a hole at 3), and the next
    plain restart resumed the abandoned step 4. The names are journaled first: a kill
    anywhere leaves only the history resumed from 2 listed, and the next save finishes."""
    from ftrain.ckpt import aside

    with CheckpointManager(tmp_path, async_save=False) as m:
        for s in (1, 2, 3, 4):
            m.save(make_state(s), force=True)
    back = CheckpointManager(tmp_path, async_save=False)
    back.restore(2)
    real, calls = protocol.set_aside, []

    def killed_after_one(path, why):
        if calls:
            raise KeyboardInterrupt("SIGKILL stand-in: the process ends here")
        calls.append(path)
        return real(path, why)

    monkeypatch.setattr(protocol, "set_aside", killed_after_one)
    with pytest.raises((KeyboardInterrupt, CheckpointSaveError)):
        back.save(make_state(3), force=True)
    monkeypatch.setattr(protocol, "set_aside", real)
    back._writers.release()  # the process that held the directory is gone
    assert (tmp_path / aside.JOURNAL).exists() and len(calls) == 1
    again = CheckpointManager(tmp_path, async_save=False)
    assert again.all_steps() == [1, 2], "no step of the old history is listed"
    assert any("its move aside was cut short" in why for why in again.invalid_steps().values())
    assert same(again.restore(), make_state(2))
    assert again.save(make_state(3), force=True)
    again.close()
    assert again.all_steps() == [1, 2, 3] and not (tmp_path / aside.JOURNAL).exists()
    assert sorted(again.set_aside_steps()) == [3, 4]  # the old 3 and 4, kept on disk
    assert same(CheckpointManager(tmp_path, async_save=False).restore(3), make_state(3))


def test_a_journal_that_cannot_be_written_or_a_move_that_fails_never_fails_the_save(
    tmp_path, monkeypatch
):
    """A location that refuses the journal (read-only) gets the moves without one, and the
    save goes on, as before the journal; a move that fails keeps the journal, so that step
    stays unlisted until the next writing manager moves it."""
    from ftrain.ckpt import aside

    def go_back(d, when):
        with CheckpointManager(d, async_save=False) as m:
            for s in (1, 2, 3, 4):
                m.save(make_state(s), force=True)
        back = CheckpointManager(d, async_save=False)
        back.restore(2)
        when(back)
        return back

    def no_journal(root, names):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(aside, "write", no_journal)
    back = go_back(tmp_path / "a", lambda m: None)
    assert back.save(make_state(3), force=True) and back.all_steps() == [1, 2, 3]
    back.close()
    monkeypatch.undo()

    real, failing = protocol.set_aside, {"step_00000004"}

    def refusing(path, why):
        if path.name in failing:
            raise OSError(errno.EIO, "Input/output error")
        return real(path, why)

    monkeypatch.setattr(protocol, "set_aside", refusing)
    back = go_back(tmp_path / "b", lambda m: None)
    assert back.save(make_state(3), force=True)
    back.close()
    assert (tmp_path / "b" / aside.JOURNAL).exists()
    assert back.all_steps() == [1, 2, 3], "the step that did not move stays unlisted"
    failing.clear()
    again = CheckpointManager(tmp_path / "b", async_save=False)
    assert again.save(make_state(5), force=True)
    again.close()
    assert not (tmp_path / "b" / aside.JOURNAL).exists()
    assert sorted(again.set_aside_steps()) == [3, 4] and again.all_steps() == [1, 2, 3, 5]


def test_a_go_back_over_two_locations_is_journaled_in_both(tmp_path, monkeypatch):
    """Old 3 in the primary, old 4 in the fallback (saved while the primary was full): one
    move per directory wrote no journal, and a kill after the first move left the old 3
    listed for a plain restart to resume."""
    from ftrain.ckpt import aside

    primary, fallback = tmp_path / "p", tmp_path / "f"
    with CheckpointManager(primary, async_save=False, fallback_directory=fallback) as m:
        for s in (1, 2, 3):
            m.save(make_state(s), force=True)
    with CheckpointManager(fallback, async_save=False) as m:
        m.save(make_state(4), force=True)
    back = CheckpointManager(primary, async_save=False, fallback_directory=fallback)
    back.restore(2)
    real = protocol.set_aside

    def killed_after_one(path, why):
        real(path, why)
        raise KeyboardInterrupt("SIGKILL stand-in")

    monkeypatch.setattr(protocol, "set_aside", killed_after_one)
    with pytest.raises((KeyboardInterrupt, CheckpointSaveError)):
        back.save(make_state(3), force=True)
    monkeypatch.undo()
    back._writers.release()
    again = CheckpointManager(primary, async_save=False, fallback_directory=fallback)
    assert again.all_steps() == [1, 2] and same(again.restore(), make_state(2))
    assert again.save(make_state(3), force=True)
    again.close()
    assert not (primary / aside.JOURNAL).exists() and not (fallback / aside.JOURNAL).exists()
    assert again.all_steps() == [1, 2, 3] and same(again.restore(3), make_state(3))


def test_a_journal_that_outlives_its_moves_never_hides_the_new_historys_step(tmp_path, monkeypatch):
    """The journal names steps with their seals: when its removal failed (a transient
    error), the new step 3 committed under a moved step's name was unlisted, and the
    next save set it aside as "another history"."""
    from ftrain.ckpt import aside

    with CheckpointManager(tmp_path, async_save=False) as m:
        for s in (1, 2, 3, 4):
            m.save(make_state(s), force=True)
    back = CheckpointManager(tmp_path, async_save=False)
    back.restore(2)

    def failing_done(root):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(aside, "done", failing_done)
    assert back.save(make_state(3, n=32), force=True)
    assert (tmp_path / aside.JOURNAL).exists() and back.all_steps() == [1, 2, 3]
    monkeypatch.undo()
    assert back.save(make_state(5, n=32), force=True)  # finishes the journal: nothing to move
    back.close()
    assert not (tmp_path / aside.JOURNAL).exists() and back.all_steps() == [1, 2, 3, 5]
    assert sorted(back.set_aside_steps()) == [3, 4]  # the old 3 and 4 only
    assert same(CheckpointManager(tmp_path, async_save=False).restore(3), make_state(3, n=32))


@pytest.mark.parametrize("planted", ["fifo", "link to /dev/zero", "directory"])
def test_a_special_file_as_the_set_aside_journal_names_nothing_and_blocks_nothing(
    tmp_path, planted
):
    """A FIFO in the journal's place hung every listing and so every start (the manager's
    __init__ reads it); a link to /dev/zero read until memory ran out. Such a journal
    names nothing, as a damaged one does."""
    from ftrain.ckpt import aside

    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(make_state(1))
    journal = tmp_path / aside.JOURNAL
    if planted == "fifo":
        os.mkfifo(journal)
    elif planted == "directory":
        journal.mkdir()
    else:
        journal.symlink_to("/dev/zero")
    done = []
    reader = threading.Thread(target=lambda: done.append(CheckpointManager(tmp_path).all_steps()))
    reader.daemon = True  # a hang must fail the test, not keep pytest from ending
    reader.start()
    reader.join(timeout=30)
    assert done == [[1]]


@pytest.mark.parametrize("jump_s", [2 * 86400, -2 * 86400])
def test_a_clock_jump_does_not_age_or_rejuvenate_this_managers_steps(tmp_path, monkeypatch, jump_s):
    """``YoungerThan(1 day)`` judged each step by its recorded wall-clock time: a clock
    stepped two days ahead deleted every step but the newest, seconds after they were
    saved; steps saved while it ran behind were deleted once it was put right. The steps
    this manager saved are aged by the monotonic clock now."""
    from ftrain.ckpt.policies import YoungerThan

    real_time = time.time
    if jump_s < 0:  # saved while the clock ran behind, judged once it is right
        monkeypatch.setattr(time, "time", lambda: real_time() + jump_s)
    m = CheckpointManager(tmp_path, async_save=False, keep_policy=YoungerThan(86400))
    for s in range(1, 6):
        m.save(make_state(s), force=True)
    monkeypatch.setattr(time, "time", lambda: real_time() + max(jump_s, 0))
    m.save(make_state(6), force=True)
    assert m.all_steps() == [1, 2, 3, 4, 5, 6]
    m.close()


def test_a_file_size_limit_is_named_with_its_fix_and_the_step_saves_once_it_is_raised(tmp_path):
    """``ulimit -f`` in a job's shell: Python ignores SIGXFSZ, so a chunk write fails with
    a bare ``File too large``, which read like a disk fault."""
    import resource

    m = CheckpointManager(tmp_path, async_save=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))
    try:
        with pytest.raises(CheckpointSaveError, match=r"File too large \(.*`ulimit -f`"):
            m.save(make_state(7), force=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert m.all_steps() == [], "nothing half-written is listed"
    assert m.save(make_state(7), force=True), "the same step saves once the limit is raised"
    m.close()
    assert same(CheckpointManager(tmp_path).restore(7), make_state(7))
