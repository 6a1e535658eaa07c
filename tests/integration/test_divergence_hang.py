"""The real CLI on a diverging run (trainer.on_nonfinite) and a hung one (trainer.hang_timeout_s)."""

import math
import os
import subprocess
import sys
from pathlib import Path

from ftrain.ckpt import CheckpointManager
from ftrain.signals import EXIT_ERROR, EXIT_HUNG

from .conftest import TINY, records

# optim.lr=1e6 with the tiny GPT: step 1 is finite (its LR is 0 during warmup), step 2
# applies a 5e5 LR, and with the default seed 0 step 3's loss and grad norm are NaN, in
# every run (the run is deterministic; seeds 2 and 3 reach NaN at step 4).
DIVERGE = ["optim.lr=1e6", "trainer.eval_every=null", "trainer.max_steps=8"]


def _manager(run_dir) -> CheckpointManager:
    return CheckpointManager(Path(run_dir) / "checkpoints", async_save=False)


def test_divergence_stops_with_exit_1_naming_the_step_and_keeps_the_finite_checkpoint(
    cli, tmp_path
):
    run = tmp_path / "run"
    proc = cli(run, *DIVERGE, "checkpoint.every_steps=1", "checkpoint.keep_last=1")
    assert proc.returncode == EXIT_ERROR, proc.stdout + proc.stderr
    assert "step 3: non-finite loss=nan" in proc.stderr, proc.stderr
    assert "newest committed checkpoint: step 2" in proc.stderr
    assert "Traceback" not in proc.stderr, "one message, not a traceback"
    m = _manager(run)
    assert m.all_steps() == [2], "the NaN step was never saved; the finite one was kept"
    assert math.isfinite(m.metadata(2)["metrics"]["loss"])
    (event,) = records(run, "nonfinite")
    assert event["step"] == 3 and event["action"] == "stopped"
    assert not records(run, "emergency_save")
    # re-running continues from the finite step; step 2's params already took a 5e5 LR
    # update, so step 3 diverges again: the same exit and message, nothing lost or saved
    again = cli(run, *DIVERGE, "checkpoint.every_steps=1", "checkpoint.keep_last=1")
    assert records(run, "resume")[-1]["from_step"] == 2
    assert again.returncode == EXIT_ERROR and "step 3: non-finite" in again.stderr
    assert m.all_steps() == [2]


def test_divergence_skip_drops_the_bad_updates_and_finishes(cli, tmp_path):
    run = tmp_path / "run"
    cli(run, *DIVERGE, "trainer.on_nonfinite=skip", "checkpoint.every_steps=4", check=0)
    skipped = records(run, "nonfinite")
    assert [r["step"] for r in skipped] == list(range(3, 9))
    assert {r["action"] for r in skipped} == {"skipped"}
    m = _manager(run)
    assert m.all_steps()[-1] == 8
    state = m.restore(8)
    assert int(state["data", "position"]) == 8 * 4, "the cursor moved past every bad batch"
    assert all(t.isfinite().all() for t in state["params"].values(True, True))
    assert all(math.isfinite(m.metadata(s)["metrics"]["loss"]) for s in m.all_steps())


# A real mechanism a user has: a launcher script that registers its own data source and
# runs the CLI. This one is the text corpus, whose train split blocks forever at the
# HANG_AT_READ-th read (0: never) -- a file system or loader that stopped answering.
HANGING_LAUNCHER = """
import os, sys, threading
from ftrain.cli.run import main
from ftrain.data import register_source
from ftrain.data.text import TextCorpusSource

HANG_AT = int(os.environ.get("HANG_AT_READ", "0"))
reads = {"train": 0}


def wait_for_storage_that_never_answers():
    threading.Event().wait()


class HangingText(TextCorpusSource):
    def get(self, indices):
        if self.split == "train":
            reads["train"] += 1
            if reads["train"] == HANG_AT:
                wait_for_storage_that_never_answers()
        return super().get(indices)


register_source("hanging_text", HangingText)
sys.exit(main(sys.argv[1:]))
"""


def _launch(script, run, cache_dir, *overrides, hang_at=0):
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, HANG_AT_READ=str(hang_at))
    args = [f"run.dir={run}", *TINY, "data.name=hanging_text", "trainer.eval_every=null"]
    return subprocess.run(
        [sys.executable, str(script), *args, *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )


def test_a_hung_data_source_is_detected_dumped_saved_and_resumed(cache_dir, tmp_path):
    script = tmp_path / "hanging_launcher.py"
    script.write_text(HANGING_LAUNCHER)
    run = tmp_path / "run"
    # reads 1-4 feed steps 1-4 (the prefetch thread reads ahead); read 5 never returns
    proc = _launch(
        script,
        run,
        cache_dir,
        "trainer.max_steps=20",
        "trainer.hang_timeout_s=5",  # a slow fsync on a busy machine is not a hang
        "checkpoint.every_steps=3",
        "checkpoint.async_save=false",
        "resume=none",  # the same command would refuse the steps: the exit line says so
        hang_at=5,
    )
    out = proc.stdout + proc.stderr
    assert (
        "so a supervisor restarts the run; run it again with resume=latest to resume "
        "(this command's resume=none would refuse the committed steps)" in proc.stderr
    ), proc.stderr
    assert "hang watchdog: exit 4 after 5 s without progress (25 s for the first step)" in out
    assert proc.returncode == EXIT_HUNG, out
    assert "no progress for" in proc.stderr and "exiting with code 4" in proc.stderr
    (dump,) = run.glob("hang-*.txt")
    text = dump.read_text()
    assert "wait_for_storage_that_never_answers" in text, "the blocking frame is named"
    assert "at step 4, phase 'data'" in text
    (hang,) = records(run, "hang")
    assert hang["step"] == 4 and hang["saved"] is True
    assert _manager(run).all_steps() == [3, 4], "policy save of 3, the watchdog's save of 4"
    # the supervisor's restart: the same command (the storage answers again) resumes at 4
    proc = _launch(script, run, cache_dir, "trainer.max_steps=6", "trainer.hang_timeout_s=5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert records(run, "resume")[-1]["from_step"] == 4
    assert _manager(run).latest_step() == 6


# A launcher whose checkpoint storage stops answering while step HANG_STEP is written.
HUNG_SAVE_LAUNCHER = """
import os, sys, threading
import ftrain.ckpt.manager as manager
from ftrain.cli.run import main

HANG_STEP, real = int(os.environ["HANG_STEP"]), manager.write_tree


def write_to_storage_that_never_answers(path, snapshot, attrs, **kwargs):
    if attrs["step"] == HANG_STEP:
        threading.Event().wait()
    return real(path, snapshot, attrs, **kwargs)


manager.write_tree = write_to_storage_that_never_answers
sys.exit(main(sys.argv[1:]))
"""


def test_a_hung_async_final_save_ends_the_run_with_exit_4_not_never(cache_dir, tmp_path):
    """The loop had returned (its watchdog stopped) and the run waited for the final
    save's commit forever; the watchdog now watches that wait too."""
    script = tmp_path / "hung_save_launcher.py"
    script.write_text(HUNG_SAVE_LAUNCHER)
    run = tmp_path / "run"
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, HANG_STEP="6")
    args = [f"run.dir={run}", *TINY, "trainer.max_steps=6", "checkpoint.every_steps=4"]
    args += ["trainer.hang_timeout_s=4", "checkpoint.async_save=true"]
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=200
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_HUNG, out
    assert "phase 'save'" in proc.stderr and "did not finish within 4 s" in proc.stderr, out
    (dump,) = run.glob("hang-*.txt")
    assert "write_to_storage_that_never_answers" in dump.read_text()
    assert _manager(run).all_steps() == [4]  # the restart resumes there
