"""The real CLI never loses work silently: bad input is one message and exit 2, a damaged
record file never blocks a resume, one run per run.dir, truthful save and resume records."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftrain.ckpt import CheckpointManager
from ftrain.cli.resume import ResumeReport
from tests.procs import first_line

from .conftest import TINY, records


def _committed(run_dir):
    return CheckpointManager(Path(run_dir) / "checkpoints", async_save=False).all_steps()


def _one_clear_error(proc, *needles):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


def test_bad_input_is_one_message_and_exit_2(cli, tmp_path):
    _one_clear_error(
        cli(tmp_path / "a", "checkpoint.every_steps=0"),
        "checkpoint.every_steps=0",
        "checkpoint.every_steps=null",
    )
    _one_clear_error(cli(tmp_path / "b", "+trainer.max_step=10"), "trainer.max_step")
    _one_clear_error(cli(tmp_path / "c", "model=model_schema"), "model=gpt2_tiny")
    blocker = tmp_path / "file"
    blocker.write_text("a regular file where run.dir should be")
    out = cli(blocker / "run")
    _one_clear_error(out, "run.dir=", "a file is in the way")
    assert "resumed" not in out.stdout and "starting fresh" not in out.stdout, "nothing built"


def test_records_are_true_and_damage_or_overwrite_never_mix_or_block(cli, tmp_path):
    run = tmp_path / "run"
    cli(run, "trainer.max_steps=4", "checkpoint.every_steps=2", check=0)
    saves = [(r["kind"], r["step"]) for r in records(run) if r["kind"] in SAVE_KINDS]
    # an async save is recorded when queued, and as committed once that is known
    assert saves == [("save_started", 2), ("committed", 2), ("save_started", 4), ("committed", 4)]
    assert [r["step"] for r in records(run, "committed")] == _committed(run) == [2, 4]
    for r in records(run, "committed"):  # the marker's bytes: written + linked = the step's
        assert r["written_bytes"] + r["linked_bytes"] == r["bytes"] > 0, r

    # a damaged metrics.jsonl: one 0xff byte, a line that is JSON but not an object, and
    # objects whose fields have other types (each stopped the restart with a TypeError or
    # KeyError from the resume check, the redo report or the location list)
    malformed = [
        {"kind": ["step"], "step": 3, "time": 1.0},
        {"kind": "committed", "time": 1.0},
        {"kind": "committed", "step": "4", "time": 1.0},
        {"kind": "start", "step": 0, "time": 1.0, "checkpoint_dirs": 5},
        {"kind": "resume", "step": 2, "from_step": [2], "time": 1.0, "restore_s": "slow"},
    ]
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b"\xff\n[1, 2]\n" + b"".join(json.dumps(r).encode() + b"\n" for r in malformed))
    out = cli(run, "trainer.max_steps=6", "checkpoint.every_steps=2", check=0)
    assert "metrics.jsonl: skipped 7 unreadable or malformed lines" in out.stderr
    assert "Traceback" not in out.stderr
    assert records_tolerant(run, "resume")[-1]["from_step"] == 4

    # run.overwrite=true moves the whole old run aside: records and checkpoints together
    cli(
        run,
        "trainer.max_steps=2",
        "checkpoint.every_steps=2",
        "resume=none",
        "run.overwrite=true",
        check=0,
    )
    (aside,) = run.glob("overwritten-*")
    assert (aside / "metrics.jsonl").exists() and (aside / "heartbeat.json").exists()
    assert [p.name for p in sorted((aside / "checkpoints").glob("step_*"))][-1] == "step_00000006"
    fresh = records(run)
    assert [r["kind"] for r in fresh].count("start") == 1 and not records(run, "resume")
    assert max(r["step"] for r in records(run, "step")) == 2

    # a directory in place of metrics.jsonl: the run trains on, with a warning
    (run / "metrics.jsonl").rename(run / "old.jsonl")
    (run / "metrics.jsonl").mkdir()
    out = cli(run, "trainer.max_steps=4", "checkpoint.every_steps=2", check=0)
    assert "cannot open" in out.stderr and "training goes on" in out.stderr
    assert _committed(run) == [2, 4]


SAVE_KINDS = ("save", "save_started", "committed", "save_failed")


def records_tolerant(run_dir, kind):
    from ftrain.metrics import read_records

    return [r for r in read_records(run_dir) if r.get("kind") == kind]


def _wait_for_beat(run_dir, proc, timeout=120):
    beat = Path(run_dir) / "heartbeat.json"
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            return json.loads(beat.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.05)
    raise AssertionError("no heartbeat")


def test_a_second_run_on_a_busy_run_dir_is_refused_naming_the_holder(cli, popen_cli, tmp_path):
    run = tmp_path / "run"
    first = popen_cli(run, "trainer.max_steps=100000", "checkpoint.every_steps=null")
    try:
        _wait_for_beat(run, first)
        second = cli(run, "trainer.max_steps=2")
        _one_clear_error(second, f"pid {first.pid}", "on host", "in use")
    finally:
        first.send_signal(signal.SIGTERM)  # saves at the step reached, exits 3
        first.communicate(timeout=120)
    assert first.returncode == 3
    reached = _committed(run)[-1]
    cli(run, f"trainer.max_steps={reached + 1}", check=0)  # the lock was released


SLOW_START = """
import sys, time
from ftrain.cli.build import _gpt2, register_model
from ftrain.cli.run import main

@register_model("gpt2_slow_start")
def build(cfg, generator):
    print("BUILDING", flush=True)
    time.sleep(120)  # a slow start-up (a big model, a slow file system)
    return _gpt2(cfg, generator)

sys.exit(main(sys.argv[1:]))
"""


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_during_start_up_is_one_line_and_exit_130(cache_dir, tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    args = [f"run.dir={run}", *TINY, "model.name=gpt2_slow_start", "trainer.max_steps=2"]
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_START, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # Ctrl-C in a terminal reaches the foreground process; a suite started in the
        # background (`nohup ... &`) hands its children SIGINT ignored, which they keep
        preexec_fn=_default_sigint,
    )
    assert first_line(proc).strip() == "BUILDING"  # inside start-up, lock held
    assert json.loads((run / ".lock").read_text())["pid"] == proc.pid
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "interrupted (SIGINT)" in err and len(err.strip().splitlines()) == 1, err
    assert (run / ".lock").read_text() == "", "the run lock is released"


def test_resume_after_a_corrupt_newest_step_tells_what_happened(cli, tmp_path):
    run = tmp_path / "run"
    cli(run, "trainer.max_steps=6", "checkpoint.every_steps=3", check=0)
    (run / "checkpoints" / "step_00000006" / "zarr.json").write_text("{not json")
    stray = run / "checkpoints" / "step_00000009"
    stray.mkdir()  # a step directory without a marker: does not count, is reported
    out = cli(run, "trainer.max_steps=6", "checkpoint.every_steps=3", check=0)
    resume = records(run, "resume")[-1]
    assert resume["from_step"] == 3 and resume["redo"] == [4, 6]
    assert "6" in resume["skipped"] and str(stray) in " ".join(resume["ignored"])
    assert "step 6 was committed but is unreadable" in out.stdout
    assert "ran before but were not committed" not in out.stdout
    assert "step(s) 6 were committed but are unreadable" in out.stdout
    assert f"ignored {stray}" in out.stdout


def test_resume_report_names_a_world_size_change_and_skipped_steps():
    report = ResumeReport(
        True,
        step=57,
        reason="resume=latest",
        next_lr=1e-3,
        redo=(58, 60),
        skipped={60: "checkpoint .../step_00000060 is corrupt (crc mismatch)"},
        ignored=["/ck/step_00000061: no COMMITTED marker"],
        world_sizes=(2, 1),
    )
    text = "\n".join(report.lines())
    assert "step 60 was committed but is unreadable, skipped in favour of step 57" in text
    assert "steps 58..60 ran before and will be redone" in text
    assert "were not committed: they will be redone" not in text
    assert "world size changed: checkpoint written by 2 rank(s), resumed on 1" in text
    assert "ignored /ck/step_00000061: no COMMITTED marker" in text
    one = ResumeReport(True, step=6, reason="resume=latest", next_lr=1e-3, redo=(7, 7))
    assert "step 7 ran before but was not committed: it will be redone" in one.lines()
    fresh = ResumeReport(False, reason="no checkpoint yet", ignored=["/ck/step_00000003: x"])
    assert fresh.lines() == ["starting fresh (no checkpoint yet)", "ignored /ck/step_00000003: x"]


@pytest.mark.slow
def test_under_torchrun_a_held_lock_stops_every_rank(cache_dir, tmp_path):
    from ftrain.runlock import acquire

    run = tmp_path / "run"
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    cmd += ["-m", "ftrain", f"run.dir={run}", *TINY, "trainer.max_steps=2"]
    with acquire(run, argv=["the-other-run"]):  # this test process holds run.dir
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert f"in use by pid {os.getpid()}" in out and "the-other-run" in out  # rank 0
    assert "the coordinator (rank 0) refused to start" in out  # rank 1 heard of it
    # torchrun reports the first failed rank's exit code (it may stop the other before that
    # one's exit is seen), so "exit 2" is asserted once; both messages above show both ranks
    assert "exitcode  : 2" in out
    # torchrun prints its own launcher traceback for failed workers; none comes from ftrain
    assert not [ln for ln in out.splitlines() if ln.strip().startswith("File") and "/ftrain/" in ln]
    assert not (run / "checkpoints").exists()


def test_start_state_reports_a_world_size_change_and_the_skipped_newer_step(tmp_path):
    """Library level (no CLI run): a checkpoint written by 2 ranks, resumed on 1, after
    its newest step turned out unreadable."""
    from ftrain.cli.build import build_model, build_tx
    from ftrain.cli.resume import checkpoint_metadata, start_state
    from ftrain.config import load_config
    from ftrain.dist import World
    from ftrain.state import init_state

    cfg = load_config([f"run.dir={tmp_path}", "model.n_layer=1", "trainer.max_steps=4"])
    model, _ = build_model(cfg)
    tx = build_tx(cfg)
    fresh = init_state(model, tx, seed=0)
    meta = checkpoint_metadata(cfg, "fp", {}, World(0, 2), cfg.trainer.max_steps)
    manager = CheckpointManager(cfg.checkpoint.dir, async_save=False)
    for step in (2, 4):
        at_step = fresh.clone().unlock_().set("step", fresh["step"] + step)
        manager.save(at_step, metadata=meta, force=True)
    (Path(cfg.checkpoint.dir) / "step_00000004" / "zarr.json").write_text("{not json")
    state, report, _ = start_state(cfg, manager, fresh, World(), tx, "fp")
    assert int(state["step"]) == 2 and report.world_sizes == (2, 1)
    assert list(report.skipped) == [4] and "step_00000004" in report.skipped[4]
    assert report.redo == (3, 4)
    text = "\n".join(report.lines())
    assert "world size changed: checkpoint written by 2 rank(s), resumed on 1" in text
    assert "step 4 was committed but is unreadable, skipped in favour of step 2" in text


def _armed(tmp_path, cache_dir, arm: dict) -> dict:
    import json

    from ftrain.faults import inject_dir

    path = tmp_path / "arm.json"
    path.write_text(json.dumps(arm))
    pythonpath = os.pathsep.join(filter(None, [str(inject_dir()), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONPATH=pythonpath)
    return env | {"FTRAIN_CHAOS_ARM": str(path)}


def test_a_failed_async_final_save_gets_an_emergency_retry(cache_dir, tmp_path):
    """A one-off full disk at the final (async) save: the run ends with exit 1 as before,
    but the retry commits the last step (the synchronous path already retried)."""
    from .conftest import TINY, records

    run = tmp_path / "run"
    env = _armed(tmp_path, cache_dir, {"id": "f", "phase": "begun", "count": 2,
                                       "action": "enospc"})  # fmt: skip
    args = [f"run.dir={run}", *TINY, "trainer.max_steps=6", "checkpoint.every_steps=4"]
    proc = subprocess.run(
        [sys.executable, "-m", "ftrain", *args, "checkpoint.async_save=true"],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "No space left on device (injected at begun)" in proc.stderr
    assert CheckpointManager(run / "checkpoints").all_steps() == [4, 6]
    (retry,) = records(run, "emergency_save")
    assert retry["step"] == 6 and retry["saved"] is True


NAN_AT_STEP_5 = """
import math, sys
import ftrain.loop as loop
from ftrain.cli.run import main

real = loop._nonfinite


def nonfinite(old, new, metrics, host):  # step 5's loss reads as NaN: a divergence there
    return {"loss": math.nan} if int(new["step"]) == 5 else real(old, new, metrics, host)


loop._nonfinite = nonfinite
sys.exit(main(sys.argv[1:]))
"""


def test_a_divergence_after_a_failed_async_save_is_one_message_not_a_traceback(cache_dir, tmp_path):
    """Step 4's background save hit a full disk; step 5 diverged: the run ends with exit 1
    and one message naming both and the newest committed step (it raised from inside the
    divergence handler before), and the failed save has its save_failed record."""
    from .conftest import TINY

    run, script = tmp_path / "run", tmp_path / "nan_launcher.py"
    script.write_text(NAN_AT_STEP_5)
    env = _armed(tmp_path, cache_dir, {"id": "d", "phase": "begun", "count": 1,
                                       "action": "enospc"})  # fmt: skip
    args = [f"run.dir={run}", *TINY, "trainer.max_steps=8", "checkpoint.every_steps=4"]
    proc = subprocess.run(
        [sys.executable, str(script), *args, "checkpoint.async_save=true"],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "No space left on device (injected at begun)" in proc.stderr
    assert "step 5" in proc.stderr and "newest committed checkpoint: none" in proc.stderr
    (failed,) = records(run, "save_failed")  # recorded, as at any other end of a run
    assert failed["step"] == 4 and "No space left on device" in failed["error"], failed


SIGTERM_DURING_START_UP = """
import os, signal, sys
import ftrain.cli.run as run
from ftrain.cli.run import main

real = run.build_manager


def build_manager(cfg):  # a preemption notice arrives while the run starts up
    os.kill(os.getpid(), signal.SIGTERM)
    return real(cfg)


run.build_manager = build_manager
sys.exit(main(sys.argv[1:]))
"""


def test_a_preemption_notice_during_start_up_stops_at_the_first_boundary_with_exit_3(
    cache_dir, tmp_path
):
    """SIGTERM during start-up (here: while the checkpoint manager is built) was the default
    action: killed, exit 143. Now the run starts, stops at its first step boundary, and
    exits 3 like any preemption; a re-run resumes."""
    from .conftest import TINY, records

    run, script = tmp_path / "run", tmp_path / "term_launcher.py"
    script.write_text(SIGTERM_DURING_START_UP)
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir)
    args = [f"run.dir={run}", *TINY, "trainer.max_steps=6"]
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=240
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "SIGTERM received" in proc.stderr
    (stop,) = records(run, "stop")
    assert stop["step"] == 0 and stop["reason"] == "SIGTERM"
    assert not records(run, "step"), "no step was trained"
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_a_token_id_beyond_the_model_vocabulary_is_one_message_and_a_fixable_start(
    cache_dir, forkserver, tmp_path
):
    """Token ids past model.vocab_size with nothing declaring the data's vocabulary (a
    nanoGPT token directory): an IndexError from F.embedding at step 1, after an emergency
    save of step 0 that then refused the corrected model. Now: the batch is refused naming
    the id and the fix, nothing is saved, and the corrected config starts."""
    import numpy as np

    data = tmp_path / "tokens"
    data.mkdir()
    for split in ("train", "val"):
        (np.arange(4096) % 300).astype(np.uint16).tofile(data / f"{split}.bin")
    run = tmp_path / "run"
    args = [f"run.dir={run}", *(a for a in TINY if not a.startswith("data"))]
    args += ["data=tokens", f"data.path={data}", "trainer.max_steps=2"]
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    bad = forkserver.run(args, env, 240)
    assert bad.returncode == 2, bad.stdout + bad.stderr  # the same batch fails again
    assert "Traceback" not in bad.stderr, bad.stderr
    assert "outside the model's vocabulary [0, 256)" in bad.stderr
    assert re.search(r"a model.vocab_size above 2[5-9]\d", bad.stderr), bad.stderr
    assert "train.bin" in bad.stderr
    assert _committed(run) == []
    fixed = forkserver.run([*args, "model.vocab_size=320"], env, 240)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert _committed(run) == [2]


SHORT_SOURCE = """
import torch
from ftrain.data import TensorSource


class Short(TensorSource):  # its targets one token short of its inputs
    def __init__(self, block_size, split="train"):
        super().__init__(torch.arange(4000) % 200, block_size=block_size)

    def get(self, indices):
        xy = super().get(indices)
        xy["y"] = xy["y"][:, :-1]
        return xy
"""


def test_a_source_of_the_wrong_window_shape_is_one_message_and_exit_2(cli, tmp_path, monkeypatch):
    """data._target_ = a source whose y is a token shorter than x: a shape error from
    deep inside the loss, or (a missing row) a shifted batch. Now refused at the first
    batch, exit 2 (the same command reads the same shape), no traceback, nothing
    committed."""
    (tmp_path / "shortsrc.py").write_text(SHORT_SOURCE)
    run = tmp_path / "run"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the fork server puts it on sys.path
    out = cli(run, "data._target_=shortsrc.Short", "trainer.max_steps=2", check=2)
    assert "Traceback" not in out.stderr, out.stderr
    assert "Short.get() returned x (4, 32), y (4, 31) for 4 samples" in out.stderr, out.stderr
    assert "= (4, T), T <= block_size = 32" in out.stderr
    assert _committed(run) == []


def test_val_fraction_zero_trains_on_everything_and_evaluates_nothing(cli, tmp_path):
    """data.val_fraction=0 passed validation, then failed at start on an empty val split
    (naming the tokenizer's cache file). Now the train split is every token and the run
    does not evaluate; a ranking by val_loss, which would keep nothing, is refused."""
    run = tmp_path / "run"
    out = cli(run, "data.val_fraction=0", "trainer.max_steps=4", "trainer.eval_every=2", check=0)
    assert "no evaluation: data.val_fraction=0" in out.stdout
    assert not records(run, "eval") and _committed(run) == [4]
    assert "val_loss" not in json.dumps(records(run, "step"))
    refused = cli(
        tmp_path / "best",
        "data.val_fraction=0",
        "checkpoint.keep_best=2",
        "checkpoint.best_metric=val_loss",
    )
    _one_clear_error(refused, "checkpoint.best_metric=val_loss", "data.val_fraction=0")


def test_a_fallback_past_a_corrupt_newest_step_keeps_the_recorded_lr_horizon(cli, tmp_path):
    """The horizon was read from the newest step's metadata: unreadable (corrupt), the
    resume from the older step took trainer.max_steps instead and trained on with another
    LR curve, recorded into every later checkpoint. Now the restored step's horizon is
    taken, as if the corrupt step had never been saved."""
    import shutil

    first = ["trainer.max_steps=6", "checkpoint.every_steps=2", "schedule.decay_steps=null"]
    first += ["checkpoint.async_save=false", "trainer.eval_every=null"]
    resume = [*first, "trainer.max_steps=10"]
    corrupt, clean = tmp_path / "corrupt", tmp_path / "clean"
    for run in (corrupt, clean):
        cli(run, *first, check=0)
    root = corrupt / "checkpoints" / "step_00000006" / "zarr.json"
    root.write_bytes(root.read_bytes().replace(b'"max_steps"', b'"mXx_steps"'))
    shutil.rmtree(clean / "checkpoints" / "step_00000006")  # as if never saved
    # (its records still show 6 committed: resuming from 4 there is a go-back on purpose)
    outs = [cli(corrupt, *resume, check=0), cli(clean, *resume, "resume=4", check=0)]
    assert "skipped in favour of step 4" in outs[0].stdout
    for out in outs:
        assert "lr schedule decays over 6 steps (as recorded" in out.stdout, out.stdout
    (got,), (want,) = (records(run, "resume") for run in (corrupt, clean))
    assert got["from_step"] == want["from_step"] == 4 and got["next_lr"] == want["next_lr"]
    meta = CheckpointManager(corrupt / "checkpoints", async_save=False).metadata(10)
    assert meta["schedule_horizon"] == 6


def test_a_start_that_finds_no_step_where_the_records_show_commits_is_refused(cli, tmp_path):
    """checkpoint.dir changed (or its volume not mounted, or the checkpoints deleted): the
    start found nothing and trained from step 0 as a fresh run, reporting the committed
    steps as never committed. Now refused, naming where they were saved and the ways on."""
    run, other = tmp_path / "run", tmp_path / "elsewhere"
    steps = ["trainer.max_steps=4", "checkpoint.every_steps=2", "trainer.eval_every=null"]
    cli(run, *steps, check=0)
    refused = cli(run, *steps, f"checkpoint.dir={other}")
    _one_clear_error(refused, "records committed steps up to 4", str(run / "checkpoints"))
    assert "resume=none run.overwrite=true" in refused.stderr
    assert not other.exists() or not any(other.iterdir())
    out = cli(run, *steps, f"checkpoint.dir={other}", "resume=none", "run.overwrite=true")
    assert out.returncode == 0, out.stdout + out.stderr
    assert _committed_at(other) == [2, 4] and _committed(run) == [2, 4]  # never deleted


def _committed_at(directory):
    return CheckpointManager(directory, async_save=False).all_steps()


def _two_steps(script: str, cache_dir, tmp_path, **env) -> subprocess.CompletedProcess:
    """``script`` (a ``python -c`` program running the CLI) on a two-step tiny run."""
    args = [f"run.dir={tmp_path / 'run'}", *TINY, "trainer.max_steps=2"]
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, **env),
        timeout=240,
    )


EARLY_SIGNAL = """
import os, signal, sys
sys.orig_argv[:] = [sys.executable, "-m", "ftrain"]  # as `python -m ftrain` starts
import ftrain  # the package records stop signals first thing, before torch
os.kill(os.getpid(), getattr(signal, os.environ["SIG"]))  # as if it came during the import
from ftrain.cli.run import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    "sig,code", [("SIGTERM", 3), ("SIGUSR1", 3), ("SIGHUP", 3), ("SIGINT", 130)]
)
def test_a_signal_while_torch_imports_is_handled_as_documented(cache_dir, tmp_path, sig, code):
    """Before the CLI's handlers existed (the first seconds: torch importing), SIGTERM and
    SIGUSR1 ended the process with 143/138 and a Ctrl-C printed a KeyboardInterrupt
    traceback from inside the torch import. SIGHUP (a lost ssh session; torchrun forwards
    it) killed a run at any moment, without a save."""
    proc = _two_steps(EARLY_SIGNAL, cache_dir, tmp_path, SIG=sig)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    if code == 3:
        assert f"stop reason={sig}" in proc.stdout and not _committed(tmp_path / "run")
    else:
        assert "interrupted (SIGINT) outside the training loop" in proc.stderr


LATE_SIGNALS = """
import atexit, os, signal, sys
import ftrain.cli.run as run

# the interpreter's own end (threads joined, atexit): most of a second after the last record
atexit.register(lambda: [os.kill(os.getpid(), s) for s in (signal.SIGTERM, signal.SIGHUP)])

real_shutdown = run.shutdown


def shutdown():  # the run has ended: its last commit is done, its lock released
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)
    real_shutdown()


run.shutdown = shutdown
run.console_main()  # what `python -m ftrain` runs
"""


def test_signals_while_a_finished_run_shuts_down_do_not_change_its_outcome(cache_dir, tmp_path):
    """A SIGTERM as the process group shut down after the last commit killed the run (143:
    a supervisor restarts a finished run), and a Ctrl-C there said "nothing was saved by
    this run" right after it committed its final step (130)."""
    proc = _two_steps(LATE_SIGNALS, cache_dir, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nothing was saved" not in proc.stderr and "Traceback" not in proc.stderr
    assert "SIGINT received: the run is already ending" in proc.stderr
    assert _committed(tmp_path / "run") == [2]


def test_a_console_that_goes_away_never_stops_training(cache_dir, tmp_path):
    """``python -m ftrain ... | tee log`` whose tee dies: the next progress line raised
    BrokenPipeError, the run made an emergency save, exited 1, and recorded that committed
    save as failed. The console is advisory: the run trains on to the end and says once,
    on stderr, that stdout is gone."""
    run = tmp_path / "run"
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    args = [f"run.dir={run}", *TINY, "trainer.max_steps=24", "checkpoint.every_steps=12"]
    args += ["trainer.eval_every=null"]  # the console matters here, not the evaluations
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftrain", *args, "trainer.log_every=1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    while not first_line(proc).startswith("[step=5]"):  # training, then the reader goes
        pass
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err
    assert "Traceback" not in err and err.count("stdout is gone") == 1, err
    assert CheckpointManager(run / "checkpoints", async_save=False).all_steps()[-1] == 24
    assert records(run, "end")[-1]["reason"] == "done"
    assert not records(run, "emergency_save")


def test_a_stop_signal_after_the_console_went_away_still_stops_with_exit_3(cache_dir, tmp_path):
    """``... 2>&1 | head`` (or a closed terminal) and then SIGTERM: the handler's notice
    raised EPIPE/EIO from the handler into the step, so the stop became an error, exit 1,
    with an emergency save recording ``BrokenPipeError``."""
    run = tmp_path / "run"
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    args = [f"run.dir={run}", *TINY, "trainer.max_steps=100000", "checkpoint.every_steps=1000"]
    args += ["trainer.eval_every=null", "trainer.log_every=1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftrain", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    while not first_line(proc).startswith("[step=5]"):
        pass
    proc.stdout.close()  # stdout and stderr: nobody reads them any more
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 3
    stop = records(run, "stop")[-1]
    assert stop["reason"] == "SIGTERM" and not records(run, "emergency_save"), stop
    step = CheckpointManager(run / "checkpoints", async_save=False).all_steps()[-1]
    assert step == stop["step"] > 5


@contextlib.contextmanager
def _read_only(path: Path):
    """``path`` remounted read-only (a bind mount onto itself): a real EROFS, which root's
    disregard of permission bits would not give."""
    mount = subprocess.run(["mount", "--bind", path, path], capture_output=True, text=True)
    if mount.returncode:
        pytest.skip(f"no bind mounts here: {mount.stderr.strip()}")
    try:
        ro = subprocess.run(["mount", "-o", "remount,ro,bind", path], capture_output=True)
        if ro.returncode:
            pytest.skip("no read-only remount here")
        yield
    finally:
        subprocess.run(["umount", path], check=True)


@pytest.mark.slow
def test_a_read_only_checkpoint_dir_with_a_fallback_resumes_and_saves_to_the_fallback(
    cli, tmp_path
):
    """checkpoint.dir remounted read-only (a disk error) is what checkpoint.fallback_dir is
    for, yet the restart refused: exit 2 on 'not a writable directory', the run stranded.
    Now it resumes from the primary's steps, saves to the fallback, and says so; with no
    writable fallback either, the refusal names both."""
    primary, fallback, run = tmp_path / "primary", tmp_path / "fallback", tmp_path / "run"
    base = [f"checkpoint.dir={primary}", f"checkpoint.fallback_dir={fallback}"]
    base += ["checkpoint.every_steps=2", "checkpoint.async_save=false", "trainer.eval_every=null"]
    cli(run, *base, "trainer.max_steps=4", check=0)
    assert sorted(p.name for p in primary.glob("step_*")) == ["step_00000002", "step_00000004"]
    with _read_only(primary):
        out = cli(run, *base, "trainer.max_steps=6", check=0)
        assert (
            f"checkpoint.dir={str(primary)!r} is not writable (Read-only file system); "
            f"saves go to checkpoint.fallback_dir={str(fallback)!r}" in out.stdout
        )
        (resumed,) = records(run, "resume")
        assert resumed["from_step"] == 4
        assert sorted(p.name for p in fallback.glob("step_*")) == ["step_00000006"]
        blocked = tmp_path / "blocked"
        blocked.write_text("a file where the fallback directory goes")
        refused = cli(run, *base[:1], f"checkpoint.fallback_dir={blocked}", check=2)
        assert "checkpoint.fallback_dir=" in refused.stderr and "Traceback" not in refused.stderr
        alone = cli(run, *base[:1], "checkpoint.fallback_dir=null", check=2)
        assert f"checkpoint.dir='{primary}' is not a writable directory" in alone.stderr
    assert (
        CheckpointManager(primary, async_save=False, fallback_directory=fallback).all_steps()[-1]
        == 6
    )


def test_a_restart_without_the_fallback_that_holds_the_newest_steps_is_refused(cli, tmp_path):
    """Steps 6 went to checkpoint.fallback_dir (the primary read-only); a restart that left
    the fallback out resumed from the primary's step 4, said steps 5..6 "were not committed"
    and trained them again. Now it is refused, naming the step and the way on; with the
    fallback it resumes from 6, and resume=4 goes back on purpose."""
    primary, fallback, run = tmp_path / "primary", tmp_path / "fallback", tmp_path / "run"
    base = [f"checkpoint.dir={primary}", f"checkpoint.fallback_dir={fallback}"]
    base += ["checkpoint.every_steps=2", "checkpoint.async_save=false", "trainer.eval_every=null"]
    cli(run, *base, "trainer.max_steps=4", check=0)
    with _read_only(primary):
        saved = cli(run, *base, "trainer.max_steps=6", check=0)
    assert sorted(p.name for p in fallback.glob("step_*")) == ["step_00000006"]
    # said once by the log, not again as a RuntimeWarning with a source line of ftrain's
    assert "saving to fallback" in saved.stderr and "RuntimeWarning" not in saved.stderr
    refused = cli(run, *base[:1], *base[2:], "trainer.max_steps=8", check=2)
    assert "records step 6 committed (the run saved to " in refused.stderr, refused.stderr
    assert "would train steps 5..6 again" in refused.stderr and "resume=4" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert [r["from_step"] for r in records(run, "resume")] == [4]  # nothing started
    cli(run, *base, "trainer.max_steps=8", check=0)
    assert [r["from_step"] for r in records(run, "resume")] == [4, 6]
    cli(run, *base[:1], *base[2:], "trainer.max_steps=8", "resume=6", check=2)  # not here
    back = cli(run, *base[:1], *base[2:], "trainer.max_steps=6", "resume=4", check=0)
    assert "resumed from step 4 (resume=4)" in back.stdout


def test_a_run_dir_on_a_full_disk_stops_in_one_line_with_exit_1(cli, tmpfs):
    """A full run.dir disk at a restart was a 30-line ENOSPC traceback from the run lock's
    write (bytes full) or "point run.dir at a directory this process can write", exit 2
    (inodes full): a supervisor that skips exit 2 never restarted the run once the disk
    was freed. Both are one line naming the fix, exit 1; the steps stay as they were."""
    from tests.conftest import fill

    disk = tmpfs("64M")
    run = disk / "run"
    base = ["checkpoint.every_steps=2", "checkpoint.async_save=false", "trainer.eval_every=null"]
    cli(run, *base, "trainer.max_steps=2", check=0)
    fill(disk)
    out = cli(run, *base, "trainer.max_steps=4", check=1)
    assert "ftrain: cannot start: run.dir=" in out.stderr and "df -h, df -i" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    (disk / "filler").unlink()
    cli(run, *base, "trainer.max_steps=4", check=0)
    assert [r["from_step"] for r in records(run, "resume")] == [2]


def test_an_io_error_reading_the_step_to_resume_is_one_line_and_exit_1(cli, cache_dir, tmp_path):
    """An OSError outside the chunks' own checks (EIO injected where restore begins to
    read) was a raw traceback on a single process; now one line, exit 1 (a supervisor
    retries), and the step is left as it was."""
    from ftrain.faults import inject_dir

    run = tmp_path / "run"
    base = ["checkpoint.every_steps=2", "checkpoint.async_save=false", "trainer.eval_every=null"]
    cli(run, *base, "trainer.max_steps=2", check=0)
    arm = tmp_path / "arm.json"
    arm.write_text(json.dumps({"id": "r", "phase": "restore_read", "rank": 0, "action": "eio"}))
    path = os.pathsep.join(filter(None, [str(inject_dir()), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONPATH=path, FTRAIN_CHAOS_ARM=str(arm))
    cmd = [sys.executable, "-m", "ftrain", f"run.dir={run}", *TINY, *base, "trainer.max_steps=4"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 1 and arm.with_name("arm.json.fired").exists(), out.stderr
    assert "ftrain: cannot start: cannot read the newest step: [Errno 5]" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    cli(run, *base, "trainer.max_steps=4", check=0)
    assert [r["from_step"] for r in records(run, "resume")] == [2]


def test_a_keep_policy_change_that_would_delete_kept_steps_needs_consent(cli, tmp_path):
    """A restart without checkpoint.keep_every (a requeue script that lost an override)
    said only "accepted change" and its next commit deleted every step keep_every kept.
    Now it is refused naming the steps; run.allow_config_change=true accepts it, said."""
    run = tmp_path / "run"
    base = ["checkpoint.every_steps=2", "checkpoint.async_save=false", "trainer.eval_every=null"]
    base += ["checkpoint.keep_last=1"]
    cli(run, *base, "checkpoint.keep_every=4", "trainer.max_steps=6", check=0)
    ckpts = run / "checkpoints"
    assert CheckpointManager(ckpts, async_save=False).all_steps() == [4, 6]
    refused = cli(run, *base, "trainer.max_steps=8", check=2)
    assert "(checkpoint.keep_every: 4 -> None) deletes committed step(s) 4 at the next" in (
        refused.stderr
    ), refused.stderr
    assert CheckpointManager(ckpts, async_save=False).all_steps() == [4, 6]
    cli(run, *base, "checkpoint.keep_last=2", "checkpoint.keep_every=4", "trainer.max_steps=8",
        check=0)  # fmt: skip
    assert CheckpointManager(ckpts, async_save=False).all_steps() == [4, 6, 8]  # more kept: fine
    out = cli(run, *base, "trainer.max_steps=10", "run.allow_config_change=true", check=0)
    assert "deletes committed step(s) 4, 8 at the next commit" in out.stdout, out.stdout
    assert CheckpointManager(ckpts, async_save=False).all_steps() == [10]
    gone = cli(run, *base, "trainer.max_steps=10", "resume=4", check=2)  # said why it is gone
    assert "step 4 is not committed any more (the run's records show it committed; the keep" in (
        gone.stderr
    ), gone.stderr


def test_a_bad_batch_just_after_an_async_save_waits_for_that_commit(cli, tmp_path):
    """Step 2's background save was still committing when step 3's batch held a token id
    past the vocabulary: the stop said "newest committed checkpoint: none (a re-run starts
    fresh)" while step 2 committed a moment later; a user may have deleted the run."""
    import numpy as np

    data = tmp_path / "tok"
    data.mkdir()
    train = (np.arange(20000) % 256).astype(np.uint16)
    train[261] = 300  # read by step 3 (no shuffle; 4 samples of 33 tokens per step)
    train.tofile(data / "train.bin")
    (np.arange(3000) % 256).astype(np.uint16).tofile(data / "val.bin")
    run = tmp_path / "run"
    out = cli(run, "data=tokens", f"data.path={data}", "data.shuffle=false",
              "trainer.eval_every=null", "trainer.max_steps=6", "checkpoint.every_steps=2",
              "checkpoint.async_save=true", check=2)  # fmt: skip
    assert "token id 300 is outside the model's vocabulary" in out.stderr, out.stderr
    assert "newest committed checkpoint: step 2;" in out.stderr, out.stderr
    assert [r["step"] for r in records(run, "committed")] == [2]  # its record, as at any end


def test_eval_every_zero_trains_without_evaluation(cli, tmp_path):
    """The config's own "0/null: no evaluation" (0 passed the start and then raised)."""
    run = tmp_path / "run"
    out = cli(run, "trainer.eval_every=0", "trainer.max_steps=2", check=0)
    assert "Traceback" not in out.stderr and not records(run, "eval")


def test_a_committed_step_whose_marker_was_deleted_is_reported_as_committed(cli, tmp_path):
    """A deleted COMMITTED marker: the report said "steps 5..6 ran before but were not
    committed", while the run's records show step 6 committed."""
    run = tmp_path / "run"
    args = ["trainer.max_steps=6", "checkpoint.every_steps=2", "trainer.eval_every=null"]
    cli(run, *args, check=0)
    (run / "checkpoints" / "step_00000006" / "COMMITTED").unlink()
    out = cli(run, *args, check=0)
    assert "resumed from step 4" in out.stdout, out.stdout
    assert "step(s) 6 were committed but are unreadable" in out.stdout, out.stdout
    assert "were not committed" not in out.stdout


def test_a_start_with_max_steps_0_does_not_block_the_next_start(cli, tmp_path):
    """max_steps=0 (build, restore, train nothing) committed step 0 with schedule_horizon
    0, which the resume check called corrupt: the next start said "no checkpoint verifies"
    and stopped. The next start now resumes it and takes its own max_steps as the horizon."""
    run, horizon = tmp_path / "run", "schedule.decay_steps=null"
    cli(run, "trainer.max_steps=0", horizon, check=0)
    assert CheckpointManager(run / "checkpoints").metadata(0).get("schedule_horizon") is None
    done = cli(run, "trainer.max_steps=2", horizon, check=0)
    assert "no checkpoint verifies" not in done.stderr
    assert CheckpointManager(run / "checkpoints").metadata(2)["schedule_horizon"] == 2


EMFILE_ON_CHUNKS = """
import errno, os, sys
from ftrain.ckpt import chunkio
from ftrain.cli.run import main

real_open = os.open

def emfile_on_chunks(path, flags, *a, **k):
    if "/c." in str(path):  # every chunk file of every step: too many open files
        raise OSError(errno.EMFILE, "Too many open files", str(path))
    return real_open(path, flags, *a, **k)

chunkio.os = type(os)("os_with_emfile")
chunkio.os.__dict__.update(os.__dict__, open=emfile_on_chunks)
sys.exit(main(sys.argv[1:]))
"""


def test_a_machine_limit_while_restoring_stops_the_start_and_judges_no_step(
    cli, cache_dir, tmp_path
):
    """Too many open files while a restart restored its newest step made every step
    "corrupt": the run went on from nothing (or an older step) and the next save set the
    intact steps aside. Now the start stops (exit 1, one line: a restart may do) and the
    steps are untouched; the next start resumes from the newest."""
    run = tmp_path / "run"
    cli(run, "trainer.max_steps=4", "checkpoint.every_steps=2", check=0)
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir)
    args = [f"run.dir={run}", *TINY, "trainer.max_steps=6", "checkpoint.every_steps=2"]
    proc = subprocess.run(
        [sys.executable, "-c", EMFILE_ON_CHUNKS, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "cannot start" in proc.stderr and "a limit of this machine" in proc.stderr
    assert "Traceback" not in proc.stderr and "corrupt" not in proc.stderr, proc.stderr
    assert _committed(run) == [2, 4]
    again = cli(run, "trainer.max_steps=6", "checkpoint.every_steps=2", check=0)
    assert "resumed from step 4" in again.stdout + again.stderr, again.stdout
    assert _committed(run)[-1] == 6


def test_a_resume_step_that_does_not_restore_says_what_else_there_is(cli, tmp_path):
    """resume=N on a damaged step said only "no checkpoint verifies" (as if nothing were
    left); on a step directory without its marker, "not committed" with no word of the
    directory. Both now name the steps there are and how to take one."""
    run = tmp_path / "run"
    cli(run, "trainer.max_steps=4", "checkpoint.every_steps=2", check=0)
    ckpt = run / "checkpoints"
    chunk = next((ckpt / "step_00000004" / "params").rglob("c.0*"))
    _flip_byte(chunk)
    damaged = cli(run, "trainer.max_steps=6", "resume=4", check=2)
    assert "resume=4: step 4 does not restore" in damaged.stderr, damaged.stderr
    assert "available steps: [2, 4]; resume=latest" in damaged.stderr
    (ckpt / "step_00000009").mkdir()
    unmarked = cli(run, "trainer.max_steps=6", "resume=9", check=2)
    assert "step_00000009 is there but does not count" in unmarked.stderr, unmarked.stderr
    assert "Traceback" not in damaged.stderr + unmarked.stderr


def _flip_byte(path: Path, offset: int = 10) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
