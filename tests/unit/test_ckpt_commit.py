"""The commit protocol: only marked steps count, stale staging is swept, never a live one."""

from __future__ import annotations

import ctypes
import errno
import json
import os

import crc32c
import pytest
import torch
from tensordict import TensorDict

from ftrain.ckpt import commit as protocol
from ftrain.ckpt.format import CheckpointFormatError, CorruptCheckpointError
from ftrain.ckpt.store import write_tree


def _state(step: int) -> TensorDict:
    return TensorDict({"step": torch.tensor(step), "w": torch.arange(10.0) + step}, [])


def _save(root, step):
    st = protocol.begin(root, step)
    return protocol.commit(st, write_tree(st.path, _state(step), {}))


def test_step_dirname_and_listing(tmp_path):
    assert protocol.step_dirname(400) == "step_00000400"
    with pytest.raises(ValueError, match="step=-1"):
        protocol.step_dirname(-1)
    _save(tmp_path, 1)
    _save(tmp_path, 20)
    (tmp_path / "step_00000030").mkdir()  # no marker
    (tmp_path / "step_00000040.tmp-1-ab").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    bad = []
    steps = protocol.committed_steps(tmp_path, on_invalid=lambda p, why: bad.append(p.name))
    assert list(steps) == [1, 20] and bad == ["step_00000030"]
    assert protocol.committed_steps(tmp_path / "missing") == {}


@pytest.mark.parametrize(
    "damage", ["marker_missing", "marker_garbage", "manifest_edited", "step_mismatch"]
)
def test_marker_must_match_manifest(tmp_path, damage):
    final = _save(tmp_path, 5)
    if damage == "marker_missing":
        (final / "COMMITTED").unlink()
    elif damage == "marker_garbage":
        (final / "COMMITTED").write_text("{not json")
    elif damage == "manifest_edited":
        (final / "manifest.json").write_text((final / "manifest.json").read_text() + " ")
    else:
        os.rename(final, tmp_path / "step_00000006")
        final = tmp_path / "step_00000006"
    with pytest.raises(CorruptCheckpointError):
        protocol.read_committed(final)
    assert protocol.committed_steps(tmp_path) == {}


def test_commit_of_an_existing_step_moves_the_old_one_aside(tmp_path):
    old = _save(tmp_path, 3)
    old_marker = (old / "COMMITTED").read_bytes()
    st = protocol.begin(tmp_path, 3)
    final = protocol.commit(st, write_tree(st.path, _state(3), {}))
    assert not st.path.exists() and not st.lock_path.exists()
    (aside,) = protocol.set_aside_steps(tmp_path)[3]
    assert aside.name.startswith("step_00000003.replaced-")
    assert (aside / "COMMITTED").read_bytes() == old_marker  # kept, never deleted
    assert protocol.committed_steps(tmp_path) == {3: final}
    assert protocol.sweep_stale(tmp_path) == []  # set-aside steps are not swept


def test_a_marker_less_step_dir_is_set_aside_not_deleted(tmp_path):
    junk = tmp_path / "step_00000004"
    junk.mkdir(parents=True)
    (junk / "precious.bin").write_bytes(b"x")
    st = protocol.begin(tmp_path, 4)
    protocol.commit(st, write_tree(st.path, _state(4), {}))
    (aside,) = protocol.set_aside_steps(tmp_path)[4]
    assert aside.name.startswith("step_00000004.unreadable-")
    assert (aside / "precious.bin").read_bytes() == b"x"


def as_format(path, version: int, manifest_too: bool = True, writer: str = "9.9.9") -> None:
    """Make the step at ``path`` name format ``version``: as a newer ftrain would write it
    (marker and the manifest it seals, resealed), or only in its marker (a damaged one)."""
    marker = json.loads((path / "COMMITTED").read_text())
    marker |= {"format_version": version, "ftrain": writer}
    if manifest_too:
        manifest = json.loads((path / "manifest.json").read_text())
        raw = json.dumps(manifest | {"format_version": version}).encode()
        (path / "manifest.json").write_bytes(raw)
        marker |= {"manifest_crc32c": crc32c.crc32c(raw), "manifest_bytes": len(raw)}
    (path / "COMMITTED").write_text(json.dumps(marker))


def test_a_newer_format_is_refused_not_ignored(tmp_path):
    path = _save(tmp_path, 5)
    as_format(path, 99)
    with pytest.raises(CheckpointFormatError, match=r"ftrain 9\.9\.9 \(format 99\)"):
        protocol.committed_steps(tmp_path)
    assert protocol.sweep_stale(tmp_path) == [] and path.exists()


@pytest.mark.parametrize("version", [0, 3, 6, 99])
def test_a_damaged_format_version_in_the_marker_is_a_corrupt_step_not_a_newer_one(
    tmp_path, version
):
    """One flipped bit ('2' -> '3', '0', '6') in the newest marker: that step is corrupt
    (its manifest still says format 2), the older one lists and restores."""
    _save(tmp_path, 4)
    path = _save(tmp_path, 5)
    as_format(path, version, manifest_too=False)
    bad = []
    assert list(protocol.committed_steps(tmp_path, on_invalid=lambda p, r: bad.append(r))) == [4]
    assert len(bad) == 1 and "damaged marker" in bad[0]
    with pytest.raises(CorruptCheckpointError, match="damaged marker"):
        protocol.read_committed(path)


def test_an_unknown_format_without_a_readable_sealed_manifest_is_refused(tmp_path):
    """Only positive evidence makes a marker damaged: a newer format whose manifest this
    ftrain cannot match (another name, another seal) is refused, never skipped."""
    path = _save(tmp_path, 5)
    as_format(path, 99, manifest_too=False)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointFormatError, match=r"\(format 99\)"):
        protocol.committed_steps(tmp_path)


def test_sweep_removes_dead_but_never_in_flight(tmp_path):
    live = protocol.begin(tmp_path, 7)  # lock held by this process
    dead = protocol.begin(tmp_path, 8)
    os.close(dead.lock_fd)  # the writer "died": its lock is free
    dead.lock_fd = -1
    nolock = tmp_path / "step_00000009.tmp-1-aa"
    nolock.mkdir()
    orphan = tmp_path / ".step_00000010.tmp-2-bb.lock"
    orphan.write_text("")
    deleting = tmp_path / "step_00000011.del-ab12"
    deleting.mkdir()
    removed = {p.name for p in protocol.sweep_stale(tmp_path)}
    assert removed == {dead.path.name, nolock.name, orphan.name, deleting.name}
    assert live.path.exists() and live.lock_path.exists()
    final = protocol.commit(live, write_tree(live.path, _state(7), {}))
    assert final.name == "step_00000007" and not live.lock_path.exists()
    assert protocol.sweep_stale(tmp_path) == []


def test_delete_step_is_atomic_rename_then_remove(tmp_path):
    final = _save(tmp_path, 2)
    protocol.delete_step(final)
    assert not final.exists() and os.listdir(tmp_path) == []


def test_fault_hook_phases(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(protocol, "fault_hook", seen.append)
    _save(tmp_path, 1)
    assert seen == ["data_written", "manifest_written", "marker_written", "renamed"]


def test_per_file_fsync_path_without_syncfs(tmp_path, monkeypatch):
    from ftrain.ckpt import store

    monkeypatch.setattr(store, "_HAVE_SYNCFS", False)
    final = _save(tmp_path, 4)
    assert list(protocol.committed_steps(tmp_path)) == [4] and final.exists()


def test_syncfs_goes_through_a_descriptor_opened_before_the_first_write(tmp_path, monkeypatch):
    """Linux reports a write-back error to ``syncfs`` only through descriptors opened
    before it happened: the watch must be opened before any chunk is written, and an
    error it reports fails the save (nothing committed)."""
    from ftrain.ckpt import store

    events, writes = [], store._Writer.do

    def recording_syncfs(fd):
        events.append(("sync", os.fstat(fd).st_ino))
        return 0

    def recording_write(self, job):
        events.append(("write", None))
        return writes(self, job)

    real_init = store.FsSync.__init__

    def recording_open(self, path):
        real_init(self, path)
        events.append(("open", os.fstat(self.fd).st_ino))

    monkeypatch.setattr(store, "_SYNCFS", recording_syncfs)
    monkeypatch.setattr(store, "_HAVE_SYNCFS", True)
    monkeypatch.setattr(store._Writer, "do", recording_write)
    monkeypatch.setattr(store.FsSync, "__init__", recording_open)
    _save(tmp_path, 1)
    kinds = [k for k, _ in events]
    assert kinds[0] == "open" and kinds[-1] == "sync" and "write" in kinds
    assert events[0][1] == events[-1][1], "the same descriptor (the staging directory)"

    def eio(fd):
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(store, "_SYNCFS", eio)
    with pytest.raises(OSError, match="syncfs failed"):
        _save(tmp_path, 2)
    assert list(protocol.committed_steps(tmp_path)) == [1]


def test_a_sharded_part_without_syncfs_fsyncs_its_directories_too(tmp_path, monkeypatch):
    """The per-file path (no syncfs, or a kernel before 5.8): a file's name is durable only
    once its directory is fsynced, so a rank's part syncs every directory it wrote into."""
    from ftrain.ckpt import sharded, store

    synced = []
    monkeypatch.setattr(sharded, "_HAVE_SYNCFS", False)
    monkeypatch.setattr(store, "fsync_dir", lambda d: synced.append(d.relative_to(tmp_path)))
    state = TensorDict({"step": torch.tensor(1), "p": {"w": torch.arange(12.0)}}, [])
    sharded.write_part(tmp_path, state, {}, rank=0, world=1, chunk_bytes=16, workers=2)
    made = {str(p.relative_to(tmp_path)) for p in [tmp_path, *tmp_path.rglob("*")] if p.is_dir()}
    assert made == {".", "p", "p/w", "step"} and {str(d) for d in synced} == made


def test_sharded_save_spreads_only_identical_replicated_leaves():
    """Replicated parameters/optimizer leaves are spread chunk by chunk over the ranks; any
    other replicated leaf (a buffer each rank updates from its own batches) is written
    whole by rank 0, so a leaf that differs per rank is never stored as a mix of ranks."""
    from ftrain.ckpt.format import plan_array
    from ftrain.ckpt.sharded import own_slices

    t = torch.arange(4096.0)  # 16 KiB: 4 chunks of 4 KiB
    chunks = {}
    for key in ("params/w", "opt/mu/w", "buffers/running_mean", "data/cursor"):
        spec = plan_array(key, t, 4096, None)
        assert spec.n_chunks == 4
        chunks[key] = [[i for i, *_ in own_slices(spec, t, r, 2)] for r in range(2)]
    assert chunks["params/w"] == chunks["opt/mu/w"] == [[0, 2], [1, 3]]
    assert chunks["buffers/running_mean"] == chunks["data/cursor"] == [[0, 1, 2, 3], []]


def test_sweep_removes_an_owner_record_temp_a_kill_left_but_not_a_live_writers(tmp_path):
    """A kill between writing the owner record's temporary file and linking it into place
    left ``.owner.XXXXXXXX`` in the checkpoint directory for good."""
    import subprocess
    import sys

    from ftrain.ckpt import owner

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True, check=True).stdout.strip()  # fmt: skip
    dead = tmp_path / f".owner.{gone}-ab_cd123"
    live = tmp_path / f".owner.{os.getpid()}-zz9_x0y1"
    dead.write_text("{}")
    live.write_text("{}")
    assert {p.name for p in protocol.sweep_stale(tmp_path)} == {dead.name}
    assert live.exists()
    owner.claim(tmp_path, tmp_path / "run").release()  # its own temporary file is named so
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]
