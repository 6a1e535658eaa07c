"""One writing CheckpointManager per local directory (ftrain.ckpt.writerlock): two writers
replaced each other's steps without a word, and restore() resumed whichever wrote last."""

import gc
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from tensordict import TensorDict

from ftrain.ckpt import CheckpointDirInUseError, CheckpointManager


def _state(step: int, w: float) -> TensorDict:
    return TensorDict({"step": torch.tensor(step), "w": torch.full((2,), w)}, [])


def test_a_second_manager_in_this_process_is_refused_until_the_first_closes(tmp_path):
    first = CheckpointManager(tmp_path, async_save=False)
    second = CheckpointManager(tmp_path, async_save=False)
    assert first.save(_state(5, 1.0), force=True)
    with pytest.raises(CheckpointDirInUseError, match="one in this process"):
        second.save(_state(5, 2.0), force=True)
    assert CheckpointManager(tmp_path).restore(5)["w"][0] == 1.0, "the first's step stands"
    assert second.all_steps() == [5], "reading takes no lock"
    first.close()
    assert second.save(_state(6, 2.0), force=True)
    second.close()
    assert CheckpointManager(tmp_path).all_steps() == [5, 6]


def test_a_manager_collected_without_close_frees_the_directory(tmp_path):
    first = CheckpointManager(tmp_path, async_save=False)
    first.save(_state(1, 1.0), force=True)
    del first
    gc.collect()
    with CheckpointManager(tmp_path, async_save=False) as again:
        assert again.save(_state(2, 1.0), force=True)


HOLDER = """
import sys, time, torch
from tensordict import TensorDict
from ftrain.ckpt import CheckpointManager
m = CheckpointManager(sys.argv[1], async_save=False)
m.save(TensorDict({"step": torch.tensor(1), "w": torch.ones(2)}, []), force=True)
print("saved", flush=True)
time.sleep(600)
"""


def test_another_process_is_refused_naming_it_and_its_death_frees_the_directory(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "saved\n"
        mine = CheckpointManager(tmp_path, async_save=False)
        with pytest.raises(CheckpointDirInUseError, match=f"pid {holder.pid} on host"):
            mine.save(_state(2, 2.0), force=True)
    finally:
        holder.send_signal(signal.SIGKILL)  # the kernel drops a dead process's flock
        holder.wait(timeout=60)
    assert mine.save(_state(2, 2.0), force=True)
    mine.close()
    assert CheckpointManager(tmp_path).all_steps() == [1, 2]


def test_a_forked_child_does_not_keep_the_lock_after_close(tmp_path):
    """A DataLoader worker forked after the first save shares the lock's open file: closing
    the manager's descriptor alone left the lock held by the child."""
    first = CheckpointManager(tmp_path, async_save=False)
    first.save(_state(1, 1.0), force=True)
    child = os.fork()
    if child == 0:  # the worker: holds the inherited descriptor, does nothing
        time.sleep(30)
        os._exit(0)
    try:
        first.close()
        with CheckpointManager(tmp_path, async_save=False) as again:
            assert again.save(_state(2, 1.0), force=True)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_an_unused_fallback_is_neither_made_nor_locked(tmp_path):
    """The fallback may sit on a volume that is not mounted: a lock made it there."""
    fallback = tmp_path / "not-mounted" / "fallback"
    with CheckpointManager(tmp_path / "ckpt", async_save=False, fallback_directory=fallback) as m:
        assert m.save(_state(1, 1.0), force=True)
    assert not fallback.exists()
