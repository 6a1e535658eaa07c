"""The drill's own safety: a reused drill.dir is refused, and it kills only its ranks."""

import os
import subprocess
import sys

import pytest

from ftrain import drill


def test_a_non_empty_drill_dir_is_refused(tmp_path):
    """An earlier drill's runs there were resumed (a reference that trained nothing
    passed) and their stale heartbeats named pids the drill then SIGKILLed."""
    (tmp_path / "reference").mkdir()
    with pytest.raises(SystemExit, match="is not empty: an earlier drill's runs") as refused:
        drill._parse([f"drill.dir={tmp_path}"])
    assert refused.value.code == 2


def test_only_a_descendant_of_the_launcher_is_killed():
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert drill._descends_from(stranger.pid, os.getpid())
        assert not drill._descends_from(os.getpid(), stranger.pid)
        with pytest.raises(drill.DrillFailed, match="not a rank of this drill"):
            drill._kill_rank(os.getpid(), stranger.pid)  # never kills the test process
    finally:
        stranger.kill()
        stranger.wait()


def test_a_failed_scenario_stops_its_whole_torchrun_group(tmp_path, monkeypatch):
    """A scenario whose kill never came (the run too slow, a step not committed) left its
    torchrun and ranks training through the later scenarios and after the drill exited."""
    import time

    code = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    rank = int(proc.stdout.readline())
    monkeypatch.setattr(drill, "_TIMEOUT_S", 0.5)
    with pytest.raises(drill.DrillFailed, match="never reached step 6"):
        drill._kill_at(tmp_path, proc, 6, [0], after_commit=4)
    assert proc.returncode is not None
    for _ in range(100):  # the rank (a grandchild) is gone too
        if not _alive(rank):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"rank {rank} still runs")


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for init to reap it)."""
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
