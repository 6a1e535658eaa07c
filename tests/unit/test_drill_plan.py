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
    with pytest.raises(SystemExit, match="is not empty: an earlier drill's runs"):
        drill._parse([f"drill.dir={tmp_path}"])


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
