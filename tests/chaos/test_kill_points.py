"""Kills at one exact point, with a known outcome (found by the chaos drills)."""

import json
import signal

import pytest

from . import drill

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

TINY_RUN = [
    "trainer.eval_every=null",
    "trainer.max_steps=5",
    "checkpoint.every_steps=1",
    "checkpoint.keep_last=2",
]


def test_a_kill_while_the_index_is_replaced_leaves_no_temporary_file(tmp_path, cache_dir):
    run, arm, log, out = (
        tmp_path / "run",
        tmp_path / "arm.json",
        tmp_path / "fired",
        tmp_path / "out",
    )
    arm.write_text(json.dumps({"id": "index", "phase": "index_written", "count": 2, "rank": 0}))
    try:
        proc = drill.spawn(drill.cli_cmd(run, TINY_RUN), drill.base_env(cache_dir, arm, log), out)
        assert drill.finish(proc) == -signal.SIGKILL, drill.tail(out)
        assert list((run / "checkpoints").glob(".checkpoints.json.*")), "the kill point was hit"
        proc = drill.spawn(drill.cli_cmd(run, TINY_RUN), drill.base_env(cache_dir), out)
        assert drill.finish(proc) == 0, drill.tail(out)
    finally:
        drill.reap()
    assert drill.committed(run)[-1] == 5
    left = sorted(p.name for p in (run / "checkpoints").glob(".checkpoints.json.*"))
    assert left == [], f"left behind after a clean exit: {left}"
