"""The run lock: one run per run.dir, a dead holder taken over (whatever host name it wrote,
on a local disk), a foreign host refused on a shared file system."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftrain import runlock
from ftrain.config import load_config
from ftrain.dist import World
from ftrain.runlock import (
    RunDirError,
    RunLockError,
    acquire,
    check_writable,
    claim_run_dir,
    stale_note,
)
from tests.procs import first_line

HOLD = """
import sys, time
from ftrain.runlock import acquire
lock = acquire(sys.argv[1], argv=["holder"])
print("held", flush=True)
time.sleep(120)
"""


def _holder(run_dir):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    assert first_line(proc).strip() == "held"
    return proc


def test_a_live_holder_refuses_a_second_run_with_its_pid_and_host(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(RunLockError) as info:
            acquire(tmp_path)
        msg = str(info.value)
        assert f"pid {proc.pid} on host {socket.gethostname()}" in msg and "holder" in msg
        assert "two runs must not train in one run directory" in msg
    finally:
        proc.kill()
        proc.wait()


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    proc = _holder(tmp_path)
    proc.send_signal(signal.SIGKILL)  # no cleanup: the record stays, the kernel drops the flock
    proc.wait()
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == proc.pid
    with acquire(tmp_path, argv=["me"]) as lock:
        assert lock.taken_over["pid"] == proc.pid
        assert f"pid {proc.pid}" in stale_note(lock) and "no longer running" in stale_note(lock)
        now = json.loads((tmp_path / ".lock").read_text())
        assert now["pid"] == os.getpid() and now["argv"] == ["me"]
    assert (tmp_path / ".lock").read_text() == "", "a clean release leaves no holder"
    with acquire(tmp_path) as again:
        assert again.taken_over == {} and stale_note(again) is None


def test_a_lock_file_from_another_host_on_a_shared_fs_is_refused_with_how_to_clear_it(
    tmp_path, monkeypatch
):
    record = {"pid": 4242, "host": "node-elsewhere", "started": time.time(), "argv": ["x"]}
    (tmp_path / ".lock").write_text(json.dumps(record))
    monkeypatch.setattr(runlock, "_fs_type", lambda path: "nfs4")
    with pytest.raises(RunLockError) as info:
        acquire(tmp_path)
    msg = str(info.value)
    assert "pid 4242 on host node-elsewhere" in msg and f"rm {tmp_path / '.lock'}" in msg
    assert "shared file system (nfs4)" in msg
    (tmp_path / ".lock").unlink()
    acquire(tmp_path).release()


def test_a_free_lock_from_another_host_name_on_a_local_disk_is_taken_over(tmp_path):
    """A container restarted after a SIGKILL gets a new host name; on a local file system
    the free flock proves the old holder is gone, so the restart is not blocked."""
    assert runlock._fs_type(tmp_path) in runlock._LOCAL_FS, "the test needs a local tmp dir"
    record = {"pid": 4242, "host": "old-container", "started": time.time(), "argv": ["x"]}
    (tmp_path / ".lock").write_text(json.dumps(record))
    with acquire(tmp_path) as lock:
        assert lock.taken_over["host"] == "old-container"
        assert "pid 4242 on host old-container" in stale_note(lock)


def test_the_file_system_type_is_the_longest_mount_point_holding_the_path(tmp_path):
    assert runlock._fs_type(Path("/proc/self")) == "proc"
    assert runlock._fs_type(tmp_path / "not-yet" / "made") == runlock._fs_type(tmp_path)


def test_claim_checks_writability_before_anything_and_holds_the_lock(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = load_config([f"run.dir={blocker}/run"])
    with pytest.raises(RunDirError, match="run.dir=.*a file is in the way"):
        claim_run_dir(cfg, World())
    cfg = load_config([f"run.dir={tmp_path}/run", f"checkpoint.dir={blocker}"])
    with pytest.raises(RunDirError, match="checkpoint.dir=.*not a writable directory"):
        claim_run_dir(cfg, World())
    assert (tmp_path / "run" / ".lock").read_text() == "", "a refused start holds no lock"
    cfg = load_config([f"run.dir={tmp_path}/run"])
    lock = claim_run_dir(cfg, World())
    with pytest.raises(RunLockError, match=f"pid {os.getpid()}"):
        claim_run_dir(cfg, World())
    lock.release()
    assert not list((tmp_path / "run").glob(".ftrain-write-test-*")), "the probe is removed"


def test_a_read_only_location_is_refused(tmp_path):
    target = "/sys/kernel"  # not writable even by root
    try:
        with open(f"{target}/.ftrain-probe", "w"):
            pass
        pytest.skip(f"{target} is writable here")
    except OSError:
        pass
    with pytest.raises(RunDirError, match="/sys/kernel"):
        check_writable(target, "checkpoint.dir")
    with pytest.raises(RunDirError, match="run.dir='/sys/kernel/ftrain-run'"):
        check_writable(f"{target}/ftrain-run", "run.dir")


def test_mount_points_are_decoded_and_the_top_mount_wins(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_bytes(
        b"22 1 0:20 / / rw - overlay overlay rw\n"
        b"30 22 8:1 / /mnt/donn\xc3\xa9es rw - ext4 /dev/sda1 rw\n"
        b"31 30 0:40 / /mnt/donn\xc3\xa9es rw - nfs4 srv:/x rw\n"  # mounted over it
        b"32 22 0:41 / /mnt/a\\040b rw,relatime shared:5 - cifs //srv/s rw\n"
    )
    kind = lambda p: runlock._fs_type(Path(p), mountinfo=info)  # noqa: E731
    assert kind("/mnt/données/run") == "nfs4", "the visible (last) mount of that point"
    assert kind("/mnt/a b/run") == "cifs", "\\040 is a space"
    assert kind("/mnt/ab") == "overlay" and kind("/") == "overlay"
    assert runlock._fs_type(Path("/"), mountinfo=tmp_path / "missing") == "unknown"


@pytest.mark.parametrize("inodes", [False, True], ids=["bytes", "inodes"])
def test_a_full_disk_under_the_run_dir_is_its_state_not_the_config(tmpfs, inodes):
    """A full run.dir disk said "point run.dir at a directory this process can write"
    (exit 2: a supervisor never restarts), and a lock file that could be created but not
    written was a raw ENOSPC traceback. Both are RunDirDiskError now (exit 1), naming
    free space and inodes."""
    from tests.conftest import fill

    disk = tmpfs("256k", nr_inodes=64 if inodes else None)
    run_dir = disk / "run"
    run_dir.mkdir()
    lock = run_dir / runlock.LOCK_NAME
    lock.touch()  # its inode exists: creating it works, writing the record cannot
    fill(disk, inodes)
    with pytest.raises(runlock.RunDirDiskError, match=r"run.dir=.*df -h, df -i"):
        runlock.check_writable(run_dir, "run.dir")
    if not inodes:  # a full inode table still lets the lock's existing block be written
        with pytest.raises(runlock.RunDirDiskError, match="cannot write the run lock"):
            runlock.acquire(run_dir)


def test_lock_and_checkpoint_files_take_the_umask_mode_so_a_group_can_resume(tmp_path):
    """A group-shared run directory (umask 002): the run lock and the writer lock were
    0o644 whatever the umask, so a teammate's resume failed with "cannot create the run
    lock: Permission denied" (the file existed; chmod g+w was the fix)."""
    from ftrain.ckpt import CheckpointManager
    from tests.unit.test_ckpt_manager import make_state

    old = os.umask(0o002)
    try:
        lock = runlock.acquire(tmp_path / "run")
        with CheckpointManager(tmp_path / "run" / "checkpoints", async_save=False) as mgr:
            mgr.save(make_state(1))
        lock.release()
    finally:
        os.umask(old)
    made = [tmp_path / "run" / ".lock", tmp_path / "run" / "checkpoints" / ".writer.lock"]
    made += [p for p in (tmp_path / "run" / "checkpoints").rglob("c*") if p.is_file()]
    assert len(made) > 2 and {oct(p.stat().st_mode & 0o777) for p in made} == {"0o664"}
