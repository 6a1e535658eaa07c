"""Redone steps are committed again by the real CLI (issue 9, item 1).

A corrupt newest step is skipped, the steps after the fallback are redone and saved, the
corrupt directory is moved aside (not deleted), and the run ends bit-identical to the
uninterrupted one. A resume from an earlier step with a changed config starts a new
history whose steps replace the old ones; the old history is kept aside, never "latest".
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import crc32c
import pytest

from ftrain.ckpt import CheckpointManager
from ftrain.state import first_difference
from tests.unit.test_ckpt_commit import as_format

from ..unit.test_ckpt_trust import rewrite_manifest
from .conftest import records

SAVES = ("checkpoint.every_steps=3", "checkpoint.keep_last=5", "checkpoint.async_save=false")


def _manager(run) -> CheckpointManager:
    return CheckpointManager(Path(run) / "checkpoints", async_save=False)


def _verify(run, forkserver) -> subprocess.CompletedProcess:
    """``python -m ftrain.ckpt verify RUN/checkpoints`` (forked: see conftest)."""
    args = ["verify", str(Path(run) / "checkpoints")]
    return forkserver.run(args, dict(os.environ), 120, module="ftrain.ckpt")


def test_a_corrupt_newest_step_is_redone_and_committed_again(cli, forkserver, tmp_path):
    run = tmp_path / "run"
    cli(run, "trainer.max_steps=6", *SAVES, check=0)
    want = _manager(run).restore(6)
    chunk = max(
        (run / "checkpoints" / "step_00000006").rglob("c.0*"), key=lambda p: p.stat().st_size
    )
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0xFF
    chunk.write_bytes(bytes(raw))

    out = cli(run, "trainer.max_steps=6", *SAVES, check=0)
    assert "resumed from step 3" in out.stdout, out.stdout
    assert _verify(run, forkserver).returncode == 0  # the new step 6 verifies
    mgr = _manager(run)
    assert mgr.all_steps() == [3, 6]
    assert first_difference(mgr.restore(6), want) is None  # bit-identical to the first run
    (aside,) = mgr.set_aside_steps()[6]  # the corrupt one, kept
    assert ".superseded-" in aside.name or ".replaced-" in aside.name

    again = cli(run, "trainer.max_steps=6", *SAVES, check=0)  # nothing left to redo
    assert "resumed from step 6" in again.stdout


def test_a_resume_from_an_earlier_step_replaces_the_later_history(cli, tmp_path):
    run = tmp_path / "run"
    cli(run, "trainer.max_steps=9", *SAVES, check=0)
    old9 = _manager(run).restore(9)
    cli(
        run,
        "trainer.max_steps=9",
        "resume=3",
        "optim.lr=1e-3",
        "run.allow_config_change=true",
        *SAVES,
        check=0,
    )
    mgr = _manager(run)
    assert mgr.all_steps() == [3, 6, 9]
    assert mgr.metadata(9)["config"]["optim"]["lr"] == 1e-3  # the new history is latest
    assert first_difference(mgr.restore(9), old9) is not None
    aside = mgr.set_aside_steps()
    assert sorted(aside) == [6, 9]  # the old history, moved aside, not deleted
    # the old step 9 is whole: moved back under its name it restores bit-exact
    shutil.copytree(aside[9][0], tmp_path / "old" / "step_00000009")
    assert (
        first_difference(CheckpointManager(tmp_path / "old", async_save=False).restore(9), old9)
        is None
    )


def test_a_step_of_a_newer_format_stops_the_run_and_nothing_is_deleted(cli, tmp_path):
    run = tmp_path / "run"
    cli(run, "trainer.max_steps=3", *SAVES, check=0)
    as_format(run / "checkpoints" / "step_00000003", 99, writer="9.0")
    before = sorted(p.relative_to(run) for p in (run / "checkpoints").rglob("*"))
    out = cli(run, "trainer.max_steps=6", *SAVES, check=2)
    assert "written by ftrain 9.0 (format 99); this is ftrain" in out.stderr
    assert "Traceback" not in out.stderr
    assert sorted(p.relative_to(run) for p in (run / "checkpoints").rglob("*")) == before


def test_forged_run_metadata_of_the_newest_step_falls_back_not_crashes(cli, tmp_path):
    run = tmp_path / "run"
    cli(run, "trainer.max_steps=6", *SAVES, check=0)
    step = run / "checkpoints" / "step_00000006"
    doc = json.loads((step / "zarr.json").read_text())
    doc["attributes"]["config"] = ["not", "a", "dict"]  # consistently re-sealed below
    doc["attributes"]["schedule_horizon"] = "soon"
    raw = json.dumps(doc).encode()
    (step / "zarr.json").write_bytes(raw)
    rewrite_manifest(
        step, lambda m: m["documents"].update({"zarr.json": [crc32c.crc32c(raw), len(raw)]})
    )
    out = cli(run, "trainer.max_steps=6", *SAVES, check=0)
    assert "resumed from step 3" in out.stdout and "run metadata 'config'" in out.stdout
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("phase", ["data_written", "renamed"])
def test_a_kill_at_the_first_commit_after_going_back_does_not_resume_the_old_history(
    cli, cache_dir, tmp_path, phase
):
    """resume=3 over 3, 6, 9, SIGKILLed while the new history's 6 is written (its chunks
    written, nothing committed) or the moment it is committed: the restart (resume=latest)
    goes on from 3 or from that new 6, never from the abandoned history's 6 or 9 (set aside
    before the new write, so no kill leaves both histories listed)."""
    from ftrain.faults import inject_dir

    from .conftest import TINY

    run = tmp_path / "run"
    cli(run, "trainer.max_steps=9", *SAVES, check=0)
    new_history = ("optim.lr=1e-3", "run.allow_config_change=true")
    arm = tmp_path / "arm.json"
    arm.write_text(json.dumps({"id": "back", "phase": phase, "count": 1, "rank": 0}))
    path = os.pathsep.join(filter(None, [str(inject_dir()), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONPATH=path)
    env["FTRAIN_CHAOS_ARM"] = str(arm)
    cmd = ["-m", "ftrain", f"run.dir={run}", *TINY, "trainer.max_steps=9", "resume=3"]
    killed = subprocess.run(
        [sys.executable, *cmd, *new_history, *SAVES], env=env, capture_output=True, timeout=240
    )
    assert killed.returncode == -9 and arm.with_name("arm.json.fired").exists(), killed
    committed = phase == "renamed"
    assert _manager(run).all_steps() == ([3, 6] if committed else [3])  # old 6, 9 aside

    out = cli(run, "trainer.max_steps=9", *new_history, *SAVES, check=0)
    assert f"resumed from step {6 if committed else 3}" in out.stdout, out.stdout
    mgr = _manager(run)
    assert mgr.all_steps() == [3, 6, 9]
    assert mgr.metadata(9)["config"]["optim"]["lr"] == 1e-3  # the new history went on
    assert sorted(mgr.set_aside_steps()) == [6, 9]  # the old 6 and 9, kept


def test_a_go_back_killed_before_its_first_save_leaves_the_loggers_the_committed_history(
    cli, popen_cli, tmp_path
):
    """``resume=4`` with another lr, SIGKILLed before it saved; the plain re-run resumes
    step 8 (the go-back abandoned nothing). The go-back's TensorBoard file had purged steps
    5..8 and its own steps stood in for them; in the CSV its rows counted."""
    pytest.importorskip("tensorboard", reason="pip install 'ftrain[tensorboard]'")
    from tests.integration.test_cli import _wait_for_step
    from tests.unit.test_loggers import _csv_rows, _scalars

    run, logs = tmp_path / "run", "logger=[jsonl,tensorboard,csv]"
    keep = ("checkpoint.every_steps=4", "checkpoint.async_save=false", logs)
    cli(run, "trainer.max_steps=8", *keep, check=0)
    back = popen_cli(
        run, "resume=4", "optim.lr=0.1", "run.allow_config_change=true", logs,
        "trainer.max_steps=1000", "checkpoint.every_steps=1000",  # no save before the kill
    )  # fmt: skip
    _wait_for_step(run, back, 6, after=(run / "heartbeat.json").stat().st_mtime_ns)
    back.kill()
    back.communicate(timeout=60)
    assert _manager(run).all_steps() == [4, 8], "the go-back saved nothing"
    out = cli(run, "trainer.max_steps=10", *keep, check=0)
    assert "resumed from step 8" in out.stdout, out.stdout
    steps = records(run, "step")  # 1..8, the go-back's 5.., then 9 and 10
    first = {r["step"]: r["loss"] for r in [*steps[:8], *steps[-2:]]}
    assert sorted(first) == list(range(1, 11))
    went_back = {r["step"]: r["loss"] for r in steps[8:-2]}
    assert went_back.get(6) not in (None, first[6]), "another lr: step 6 on another loss"
    shown = _scalars(run / "tensorboard", "train/loss")
    assert shown == pytest.approx(first, rel=1e-6), "the committed history, every step"
    rows = [(int(r[0]), float(r[2])) for r in _csv_rows(run / "metrics.csv") if r[1] == "step"]
    assert rows == sorted(first.items()), "one row a step, the committed history's"
