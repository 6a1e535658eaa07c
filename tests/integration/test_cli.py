"""The real CLI on gpt2_tiny: checkpoints, resume, signals, bit-identical resume, refusals."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftrain.ckpt import CheckpointManager
from ftrain.state import first_difference

from .conftest import records


def _committed(run_dir):
    return CheckpointManager(Path(run_dir) / "checkpoints", async_save=False).all_steps()


def _final_state(run_dir, step):
    return CheckpointManager(Path(run_dir) / "checkpoints", async_save=False).restore(step)


def _wait_for_step(run_dir, proc, at_least, timeout=120, after: int = -1):
    """Until the heartbeat names ``at_least``; ``after``: a heartbeat rewritten since that
    ``st_mtime_ns`` (an earlier process's names a later step)."""
    beat = Path(run_dir) / "heartbeat.json"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early:\n{proc.stdout.read()}")
        try:
            fresh = beat.stat().st_mtime_ns > after
            if fresh and json.loads(beat.read_text())["step"] >= at_least:
                return
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.01)
    raise AssertionError("timed out waiting for the heartbeat")


def _signal_at_line(proc, marker: str, sig) -> str:
    """Send ``sig`` once ``marker`` appears in the run's output; return all its output."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            proc.send_signal(sig)
            break
    return "".join(seen) + proc.communicate(timeout=120)[0]


def _wait_for_commit(run_dir, proc, timeout=120):
    """Async saves commit behind training: on a busy machine step 4's checkpoint may still be
    writing at step 7, so a test that needs a committed step waits for one."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early:\n{proc.stdout.read()}")
        if (Path(run_dir) / "checkpoints").is_dir() and _committed(run_dir):
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting for a committed checkpoint")


def test_fresh_run_commits_configured_steps_then_resumes(cli, tmp_path):
    run = tmp_path / "run"
    cli(run, "trainer.max_steps=6", "checkpoint.every_steps=3", check=0)
    assert _committed(run) == [3, 6]
    assert [r["step"] for r in records(run, "step")] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "time"} <= set(records(run, "step")[0])
    beat = json.loads((run / "heartbeat.json").read_text())
    assert beat["step"] == 6 and "pid" in beat

    out = cli(run, "trainer.max_steps=9", "checkpoint.every_steps=3", check=0)
    resume = records(run, "resume")[-1]
    assert resume["from_step"] == 6 and resume["reason"] == "resume=latest"
    assert "resumed from step 6" in out.stdout
    assert _committed(run)[-1] == 9
    # a max_steps at or below the checkpoint trains nothing, and says so
    out = cli(run, "trainer.max_steps=6", "checkpoint.every_steps=3", check=0)
    assert "trainer.max_steps=6 is not past the restored step 9: nothing to train" in out.stdout
    assert _committed(run)[-1] == 9


def test_resume_at_explicit_step_and_missing_step(cli, tmp_path):
    run = tmp_path / "run"
    cli(run, "trainer.max_steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=5", check=0)
    out = cli(run, "trainer.max_steps=6", "resume=4", "checkpoint.every_steps=2", check=0)
    resume = records(run, "resume")[-1]
    assert resume["from_step"] == 4
    assert resume["redo"] == [5, 6], "steps 5..6 ran before and are redone"
    assert "steps 5..6 ran before" in out.stdout
    assert "step(s) 6 were committed in the history resume=4 leaves" in out.stdout
    assert "were not committed: they will be redone" not in out.stdout
    bad = cli(run, "resume=5", check=2)
    assert "step 5 is not committed; available steps: [2, 4, 6]" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_resume_none_refuses_existing_run_unless_overwrite(cli, tmp_path):
    run = tmp_path / "run"
    cli(run, "trainer.max_steps=2", "checkpoint.every_steps=2", check=0)
    refused = cli(run, "trainer.max_steps=2", "resume=none", check=2)
    assert "run.overwrite=true" in refused.stderr
    # a start refused for another reason (a typo'd data path) moves nothing aside
    typo = cli(run, "resume=none", "run.overwrite=true", "data.path=/nonexistent", check=2)
    assert "/nonexistent" in typo.stderr and "moved the old run" not in typo.stdout
    for bad, said in [  # the fine-tuning checks on the fresh state too (they ran after the move)
        ("optim.freeze=[nosuch.*]", "'nosuch.*' matches no parameter"),
        ("optim.freeze=[*]", "every parameter is frozen"),
        (f"init.from={tmp_path / 'nosuch'}", "init.from="),
    ]:
        typo = cli(run, "resume=none", "run.overwrite=true", bad, check=2)
        assert said in typo.stderr and "moved the old run" not in typo.stdout, typo.stderr
    assert not list(run.glob("overwritten-*")) and (run / "checkpoints" / "step_00000002").is_dir()
    # starting over from the old run's own weights: read before the run is moved aside
    out = cli(run, "trainer.max_steps=2", "resume=none", "run.overwrite=true", f"init.from={run}")
    assert f"initialised params from {run / 'checkpoints'} step 2" in out.stdout, out.stdout
    assert list(run.glob("overwritten-*/checkpoints/step_*")), (
        "old checkpoints are moved aside (with the old run's records), never deleted"
    )


@pytest.mark.slow
def test_overwrite_with_checkpoints_in_run_dir_itself_keeps_the_lock(cli, popen_cli, tmp_path):
    """checkpoint.dir=run.dir: run.overwrite moves the old run's entries aside, not the
    directory (it took the run lock with it, so a second trainer started beside the
    overwriting one); a checkpoint.dir that contains run.dir is refused."""
    run = tmp_path / "run"
    here = [f"checkpoint.dir={run}", "checkpoint.every_steps=2"]
    cli(run, "trainer.max_steps=2", *here, check=0)
    proc = popen_cli(run, "trainer.max_steps=400", "resume=none", "run.overwrite=true", *here)
    try:
        (run / "heartbeat.json").unlink(
            missing_ok=True
        )  # the first run's: wait for the overwriting one's
        _wait_for_step(run, proc, 1)
        second = cli(run, "trainer.max_steps=4", *here, check=2)
        assert "Traceback" not in second.stderr, second.stderr
        (aside,) = run.glob("overwritten-*")
        assert (aside / "step_00000002").is_dir() and (run / ".lock").exists()
        assert not list(tmp_path.glob("run.overwritten-*")), "the run directory stayed"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    out = cli(run, "trainer.max_steps=2", f"checkpoint.dir={tmp_path}", "resume=none",
              "run.overwrite=true", check=2)  # fmt: skip
    assert f"contains run.dir={run}" in out.stderr and "Traceback" not in out.stderr
    assert (run / "metrics.jsonl").exists(), "a refused overwrite moves nothing"


def test_incompatible_config_is_refused_with_diff_and_override(cli, tmp_path):
    run = tmp_path / "run"
    cli(run, "trainer.max_steps=2", "checkpoint.every_steps=2", check=0)
    refused = cli(run, "trainer.max_steps=4", "optim.lr=0.1", "model.n_layer=2", check=2)
    assert "optim.lr: 0.0006 -> 0.1" in refused.stderr
    assert "model.n_layer: 4 -> 2" in refused.stderr
    # a change of the state's shapes: allow_config_change was advised and then refused it
    # with 126 array differences; now the shapes are said and no setting is advised
    assert "the state this config makes has other keys or shapes than the checkpoint's" in (
        refused.stderr
    )
    assert "params/transformer/h/2/attn/c_attn/weight: only in the checkpoint" in refused.stderr
    assert "allow_config_change" not in refused.stderr
    assert f"init.from={run}:2 starts one from its params" in refused.stderr  # RUN:STEP
    # a structural change (a model swapped, a block of keys added) listed every key: the
    # refusal and the accepted-change report show ten, then count the rest
    many = "+extra={" + ", ".join(f"k{i:02d}: {i}" for i in range(14)) + "}"
    refused = cli(run, "trainer.max_steps=4", "optim.lr=0.1", many, check=2)
    assert "run.allow_config_change=true" in refused.stderr  # values only: it can be accepted
    assert "extra.k09: '<absent>' -> 9" in refused.stderr and "extra.k10" not in refused.stderr
    show = f"python -m ftrain.ckpt show {run / 'checkpoints'} 2 prints the checkpoint's config"
    assert f"... and 5 more differences ({show})" in refused.stderr
    out = cli(run, "trainer.max_steps=4", "optim.lr=0.1", many, "run.allow_config_change=true",
              check=0)  # fmt: skip
    accepted = [line for line in out.stdout.splitlines() if "accepted change: " in line]
    assert len(accepted) == 10 and "... and 8 more accepted changes (all in" in out.stdout
    (resumed,) = records(run, "resume")
    assert len(resumed["changes"]) == 18, "the record holds every change"


def test_a_seed_change_on_resume_is_said_to_have_no_effect_and_not_recorded(cli, tmp_path):
    """trainer.seed=7 on a resume: refused as changing "what a step computes", and with
    allow_config_change accepted and recorded, though the run went on with seed 0's
    streams (bit for bit). A block size change asked for a second flag a refusal later."""
    run = tmp_path / "run"
    cli(run, "trainer.max_steps=2", "checkpoint.every_steps=2", check=0)
    refused = cli(run, "trainer.max_steps=4", "data.block_size=16", check=2)
    assert "with run.allow_config_change=true and data.allow_changed=true" in refused.stderr
    out = cli(run, "trainer.max_steps=4", "checkpoint.every_steps=2", "trainer.seed=7", check=0)
    assert "accepted change: trainer.seed: 0 -> 7 (no effect on a resume: the random" in (
        out.stdout
    ), out.stdout
    assert CheckpointManager(run / "checkpoints").metadata(4)["config"]["trainer"]["seed"] == 0


def test_changed_data_is_refused_unless_allowed_and_then_recorded(cli, tmp_path):
    import sysconfig

    run = tmp_path / "run"
    other = str(Path(sysconfig.get_paths()["stdlib"]) / "urllib")
    cli(run, "trainer.max_steps=2", "checkpoint.every_steps=2", check=0)
    refused = cli(run, "trainer.max_steps=4", f"data.path={other}", check=2)
    assert "data.allow_changed=true" in refused.stderr and "Traceback" not in refused.stderr
    cli(run, "trainer.max_steps=4", f"data.path={other}", "data.allow_changed=true", check=0)
    changes = records(run, "resume")[-1]["changes"]
    assert any("data fingerprint" in c for c in changes)


def test_missing_data_path_is_a_clear_error(cli, tmp_path):
    out = cli(tmp_path / "run", "data.path=/nonexistent/corpus", check=2)
    assert "/nonexistent/corpus" in out.stderr and "Traceback" not in out.stderr


def test_bad_override_is_a_clear_error(cli, tmp_path):
    out = cli(tmp_path / "run", "trainer.max_step=3", check=2)
    assert "trainer.max_step" in out.stderr and "Traceback" not in out.stderr
    out = cli(tmp_path / "run", "trainer.max_steps=abc", check=2)
    assert "could not be converted to Integer" in out.stderr
    # a model vocabulary smaller than the data's (an IndexError in F.embedding before)
    out = cli(tmp_path / "run", "model.vocab_size=10", check=2)
    assert "model.vocab_size=10 is smaller than the data's vocabulary (256" in out.stderr
    assert "Traceback" not in out.stderr
    out = cli(tmp_path / "run", "trainer.batch_size=100000", check=2)  # the OOM killer's before
    assert "trainer.batch_size=100000 is larger than the training split (" in out.stderr
    project = tmp_path / "project"  # data.path=. with the run inside: its own files as data
    project.mkdir()
    (project / "notes.txt").write_text("words and more words\n" * 400)
    out = cli(project / "runs" / "x", f"data.path={project}", check=2)
    assert f"data.path={project} takes in run.dir" in out.stderr, out.stderr
    out = cli(tmp_path / "run", "data.block_size=64", check=2)  # model.block_size=32: a step-1
    assert "data.block_size=64 is invalid: the model reads 1..32 tokens" in out.stderr  # crash
    assert "Traceback" not in out.stderr and not list(tmp_path.glob("run/checkpoints/step_*"))


def test_keep_best_by_a_metric_the_run_does_not_report_is_warned_about(cli, tmp_path):
    base = ["trainer.max_steps=2", "checkpoint.every_steps=1", "checkpoint.keep_best=1"]
    out = cli(tmp_path / "typo", *base, "checkpoint.best_metric=los", check=0)
    assert "warning: checkpoint.best_metric='los' is not among this run's step metrics (" in (
        out.stdout
    ), out.stdout
    out = cli(tmp_path / "ok", *base, "checkpoint.best_metric=loss", check=0)
    assert "warning: checkpoint.best_metric" not in out.stdout
    # a val_* typo passed unchecked (val_* come with evaluations): now the first save
    # with an evaluation's metrics checks it; a step before any evaluation does not
    evals = ["trainer.max_steps=4", "checkpoint.every_steps=1", "trainer.eval_every=2"]
    out = cli(
        tmp_path / "vtypo", *evals, "checkpoint.keep_best=1", "checkpoint.best_metric=val_los"
    )
    assert "[step=2] warning: checkpoint.best_metric='val_los' is not among this run's " in (
        out.stdout
    ), out.stdout
    assert "evaluation metrics (val_loss" in out.stdout and out.stdout.count("val_los'") == 1
    out = cli(tmp_path / "vok", *evals, "checkpoint.keep_best=1", "checkpoint.best_metric=val_loss")
    assert "warning: checkpoint.best_metric" not in out.stdout


def test_interrupted_and_resumed_run_is_bit_identical_and_may_switch_kernels(cli, tmp_path):
    # optim=adamw runs torch's fused kernel (optim.fused: true): this is also its resume test
    whole, split = tmp_path / "whole", tmp_path / "split"
    cli(whole, "trainer.max_steps=10", "checkpoint.every_steps=5", check=0)
    cli(split, "trainer.max_steps=5", "checkpoint.every_steps=5", check=0)
    cli(split, "trainer.max_steps=10", "checkpoint.every_steps=5", check=0)
    a, b = _final_state(whole, 10), _final_state(split, 10)
    assert first_difference(a, b) is None
    losses_a = {r["step"]: r["loss"] for r in records(whole, "step")}
    losses_b = {r["step"]: r["loss"] for r in records(split, "step")}
    assert losses_a == losses_b
    # the same formula and state: switching the kernel at a resume is not a config change
    cli(split, "trainer.max_steps=11", "optim.fused=false", "checkpoint.every_steps=5", check=0)
    out = cli(tmp_path / "sgd", "optim=sgd", "optim.fused=true", check=2)
    assert "optim.fused=true" in out.stderr and "optim=adamw" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


# donated: the stronger check (every page of the mapped state written in place); pure: long
@pytest.mark.parametrize("donate", [pytest.param(False, marks=pytest.mark.long), True])
def test_a_mapped_resume_is_bit_identical_and_leaves_the_step_intact(cli, tmp_path, donate):
    """checkpoint.mmap_restore=true: the state maps the step's chunk files copy-on-write;
    the run ends bit-identical to an uninterrupted one, and writing the state (in place,
    with donation) never changes the restored step's files."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    # n_embd=256: the MLP weights (1 MiB) and their moments are large enough to be mapped
    args = ["checkpoint.every_steps=3", f"trainer.donate={str(donate).lower()}", "model.n_embd=256"]
    cli(whole, "trainer.max_steps=6", *args, check=0)
    cli(split, "trainer.max_steps=3", *args, check=0)
    out = cli(split, "trainer.max_steps=6", "checkpoint.mmap_restore=true", *args, check=0)
    mapped = records(split, "resume")[-1]["mapped_bytes"]
    assert mapped >= 24 * 2**20, mapped  # 4 layers x 2 MLP weights x (param, mu, nu)
    assert f"{mapped:,} bytes of it mapped (checkpoint.mmap_restore)" in out.stdout, out.stdout
    assert first_difference(_final_state(whole, 6), _final_state(split, 6)) is None
    verify = [sys.executable, "-m", "ftrain.ckpt", "verify", str(split / "checkpoints")]
    verified = subprocess.run(verify, capture_output=True, text=True, timeout=120)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert first_difference(_final_state(whole, 3), _final_state(split, 3)) is None


def test_a_schedule_changed_on_resume_is_the_one_reported_from_the_first_step(cli, tmp_path):
    """schedule.decay_steps changed on a resume (a safe change): the report's next rate and
    the first resumed step's lr are the new schedule's (they showed the old one's; the
    update itself always used the new one), as in a run with that schedule from the start."""
    args = ["checkpoint.every_steps=3", "trainer.eval_every=null"]
    run, ref = tmp_path / "run", tmp_path / "ref"
    cli(run, "trainer.max_steps=6", *args, check=0)
    out = cli(run, "trainer.max_steps=9", "schedule.decay_steps=24", *args, check=0)
    cli(ref, "trainer.max_steps=9", "schedule.decay_steps=24", *args, check=0)
    lrs = {r["step"]: r["lr"] for r in records(run, "step")}
    want = {r["step"]: r["lr"] for r in records(ref, "step")}
    assert [lrs[s] for s in (7, 8, 9)] == [want[s] for s in (7, 8, 9)], (lrs, want)
    assert records(run, "resume")[-1]["next_lr"] == pytest.approx(want[7], rel=1e-6)
    assert f"next step 7: lr={want[7]:.6g}" in out.stdout, out.stdout


def test_extending_max_steps_keeps_the_recorded_lr_schedule(cli, tmp_path):
    run = tmp_path / "run"
    cli(
        run, "trainer.max_steps=6", "schedule.decay_steps=null", "checkpoint.every_steps=6", check=0
    )
    out = cli(run, "trainer.max_steps=9", "schedule.decay_steps=null", check=0)
    assert "lr schedule decays over 6 steps" in out.stdout
    lrs = {r["step"]: r["lr"] for r in records(run, "step")}
    end = 6e-4 * 0.1  # the schedule had ended at step 6: it stays at its final value
    assert lrs[7] == pytest.approx(end) and lrs[9] == pytest.approx(end)


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(cli, popen_cli, tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    cli(whole, "trainer.max_steps=12", "checkpoint.every_steps=4", check=0)
    proc = popen_cli(
        killed, "trainer.max_steps=400", "checkpoint.every_steps=4", "checkpoint.async_save=false"
    )
    _wait_for_step(killed, proc, 6)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _committed(killed) and max(_committed(killed)) < 12
    cli(killed, "trainer.max_steps=12", "checkpoint.every_steps=4", check=0)
    assert first_difference(_final_state(whole, 12), _final_state(killed, 12)) is None


@pytest.mark.slow
def test_the_redo_report_counts_steps_that_were_not_logged(cli, popen_cli, tmp_path):
    """trainer.log_every=5 writes a step record every 5th step only: the steps a killed run
    reached are read from its heartbeat too, so the resume says exactly which it redoes;
    a run killed before its first commit is told its steps are redone as well."""
    run, quiet = tmp_path / "run", ["trainer.log_every=5", "trainer.eval_every=null"]
    proc = popen_cli(run, "trainer.max_steps=400", "checkpoint.every_steps=4", *quiet)
    _wait_for_step(run, proc, 7)
    _wait_for_commit(run, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    reached = json.loads((run / "heartbeat.json").read_text())["step"]
    committed = max(_committed(run))
    out = cli(run, f"trainer.max_steps={reached + 2}", "checkpoint.every_steps=4", *quiet, check=0)
    redo = records(run, "resume")[-1]["redo"]
    if reached > committed:  # killed between a commit and the next one
        assert redo == [committed + 1, reached], (redo, committed, reached)
        span = (
            f"step {reached} ran before but was"
            if reached == committed + 1
            else (f"steps {committed + 1}..{reached} ran before but were")
        )
        assert f"{span} not committed" in out.stdout
    else:
        assert redo is None, (redo, committed, reached)

    fresh = tmp_path / "fresh"
    proc = popen_cli(fresh, "trainer.max_steps=400", "checkpoint.every_steps=1000", *quiet)
    _wait_for_step(fresh, proc, 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    reached = json.loads((fresh / "heartbeat.json").read_text())["step"]
    out = cli(fresh, "trainer.max_steps=2", *quiet, check=0)
    assert "starting fresh (no checkpoint yet)" in out.stdout, out.stdout
    # capped at trainer.max_steps: only steps 1..2 run again
    assert "steps 1..2 ran before but were not committed: they will be redone" in out.stdout
    assert records(fresh, "start")[-1]["redo"] == [1, 2] and reached >= 3


@pytest.mark.slow
def test_sigterm_saves_at_the_step_reached_and_resume_continues(cli, popen_cli, tmp_path):
    run = tmp_path / "run"
    # started with resume=none: "run the same command again" would refuse the step the
    # stop commits (exit 2, "never restart": a requeued job stopped for good)
    proc = popen_cli(run, "trainer.max_steps=400", "checkpoint.every_steps=1000", "resume=none")
    _wait_for_step(run, proc, 3)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, out
    reached = records(run, "stop")[-1]["step"]
    assert _committed(run) == [reached]
    assert "SIGTERM received" in out
    assert (
        f"newest committed step: {reached}. Run it again with resume=latest to resume from it "
        "(this command's resume=none would refuse the committed steps" in out
    ), out
    cli(run, f"trainer.max_steps={reached + 2}", check=0)
    assert records(run, "resume")[-1]["from_step"] == reached
    assert _committed(run)[-1] == reached + 2


def test_sigterm_during_a_long_evaluation_saves_without_finishing_it(cli, popen_cli, tmp_path):
    """The stop save waited for the whole evaluation: one longer than the grace period
    (torchrun's 30 s before SIGKILL) lost every step since the last commit."""
    run = tmp_path / "run"
    # an evaluation after every step, thousands of batches long: the heartbeat of a step
    # is written just before its evaluation starts
    proc = popen_cli(
        run, "trainer.max_steps=400", "trainer.eval_every=1", "trainer.eval_batches=3000"
    )
    _wait_for_step(run, proc, 1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, out
    stopped = records(run, "stop")[-1]["step"]
    assert (
        f"ftrain: stopped by SIGTERM at step {stopped}; newest committed step: {stopped}. Run "
        "the same command again to resume from it\n" in out
    ), out
    (skipped,) = records(run, "eval_skipped")
    assert skipped["step"] == stopped and _committed(run) == [stopped]
    assert skipped["reason"] == "stop requested during the evaluation"
    # the resume makes the skipped evaluation up before its first step: the val curve
    # has no gap (it kept one for good)
    more = ["trainer.eval_every=1", "trainer.eval_batches=2"]
    out = cli(run, f"trainer.max_steps={stopped + 1}", *more, check=0)
    assert f"evaluating step {stopped} first" in out.stdout, out.stdout
    assert [r["step"] for r in records(run, "eval")] == [stopped, stopped + 1]
    again = cli(run, f"trainer.max_steps={stopped + 1}", *more, check=0)  # owed no more
    assert "first: the stop" not in again.stdout


def test_corrupt_newest_checkpoint_is_reported_and_the_previous_one_resumed(cli, tmp_path):
    run = tmp_path / "run"
    cli(run, "trainer.max_steps=6", "checkpoint.every_steps=3", check=0)
    (run / "checkpoints" / "step_00000006" / "zarr.json").write_text("{not json")
    out = cli(run, "trainer.max_steps=6", "checkpoint.every_steps=3", check=0)
    assert records(run, "resume")[-1]["from_step"] == 3
    assert "step_00000006" in out.stderr + out.stdout


@pytest.mark.slow
def test_second_sigint_exits_at_once_and_leaves_only_valid_checkpoints(cli, popen_cli, tmp_path):
    run = tmp_path / "run"
    # a long eval after every step keeps the run busy between the two signals
    proc = popen_cli(
        run,
        "trainer.max_steps=400",
        "checkpoint.every_steps=2",
        "trainer.eval_every=1",
        "trainer.eval_batches=100",
    )
    _wait_for_step(run, proc, 3)
    proc.send_signal(signal.SIGINT)
    # the first SIGINT is acknowledged before the second is sent
    out = _signal_at_line(proc, "SIGINT received", signal.SIGINT)
    assert proc.returncode == 130, out
    assert "second SIGINT" in out
    committed = _committed(run)
    for step in committed:  # everything that counts as committed verifies
        _final_state(run, step)
    cli(run, f"trainer.max_steps={(committed or [0])[-1] + 1}", check=0)


FAILING_RUN = """
import os
import sys
from ftrain.cli.build import _gpt2, register_model
from ftrain.cli.run import main

calls = {"n": 0}

@register_model("gpt2_failing")
def build(cfg, generator):
    model, loss = _gpt2(cfg, generator)

    def failing_loss(m, batch):
        calls["n"] += 1
        if calls["n"] == int(os.environ.get("FAIL_AT", "5")):
            raise RuntimeError(f"simulated failure in step {calls['n']}")
        return loss(m, batch)

    return model, failing_loss

sys.exit(main(sys.argv[1:]))
"""


def test_exception_in_the_loop_makes_an_emergency_save_then_exits_1(cache_dir, tmp_path):
    import os
    import subprocess
    import sys

    from .conftest import TINY

    run = tmp_path / "run"
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir)
    args = [
        f"run.dir={run}",
        *TINY,
        "model.name=gpt2_failing",
        "trainer.eval_every=null",
        "checkpoint.every_steps=100",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", FAILING_RUN, *args, "trainer.max_steps=10"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "simulated failure in step 5" in proc.stderr
    event = records(run, "emergency_save")[-1]
    assert event["saved"] is True and event["step"] == 4
    assert _committed(run) == [4], "the last completed step, committed"


def test_a_failure_at_the_first_step_saves_nothing_so_a_corrected_config_starts(
    cache_dir, tmp_path
):
    """An emergency save of the fresh step 0 tied the run directory to the config that
    failed (an OOM at step 1, a bug in the loss): the corrected run was refused as a
    changed model. The start state is made again from the config, so nothing is saved."""
    import os
    import subprocess
    import sys

    from .conftest import TINY

    run = tmp_path / "run"
    args = [f"run.dir={run}", *TINY, "trainer.eval_every=null", "trainer.max_steps=3"]

    def start(*extra, fail_at="1"):
        env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, FAIL_AT=fail_at)
        cmd = [sys.executable, "-c", FAILING_RUN, *args, *extra]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)

    failed = start("model.name=gpt2_failing")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "simulated failure in step 1" in failed.stderr
    assert "emergency save skipped: nothing was trained" in failed.stdout
    (event,) = records(run, "emergency_save")
    assert event["step"] == 0 and event["saved"] is False
    assert _committed(run) == []
    # a different model: not refused (the model that fails never fails in this run)
    fixed = start("model.name=gpt2_failing", "model.n_embd=32", fail_at="0")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert _committed(run) == [3]
    again = start("model.name=gpt2_failing", "model.n_embd=32", "trainer.max_steps=5")
    assert again.returncode == 1, again.stdout + again.stderr
    assert "nothing was trained since this run started at step 3" in again.stdout
    assert _committed(run) == [3], "the resumed start step stays as committed"


def test_a_resume_says_when_the_val_split_changed(cli, tmp_path):
    """Only the train split was fingerprinted: val.bin replaced between runs went unnoticed
    while keep_best went on ranking steps by val_loss measured on other data."""
    import numpy as np

    data, run = tmp_path / "tokens", tmp_path / "run"
    data.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, 256, 4_000, dtype=np.uint16).tofile(data / "train.bin")
    rng.integers(0, 256, 1_000, dtype=np.uint16).tofile(data / "val.bin")
    args = ["data=tokens", f"data.path={data}", "checkpoint.every_steps=2"]
    cli(run, *args, "trainer.max_steps=2", check=0)
    out = cli(run, *args, "trainer.max_steps=3", check=0)
    assert "the val split changed" not in out.stdout
    np.full(1_000, 7, dtype=np.uint16).tofile(data / "val.bin")
    out = cli(run, *args, "trainer.max_steps=4", check=0)
    assert "the val split changed since the checkpoint (fingerprint" in out.stdout, out.stdout


def test_a_resume_says_when_evaluation_reads_other_val_samples(cli, tmp_path):
    """trainer.eval_batches (or batch_size) changed at a resume: val_loss before and after
    measured other samples while keep_best ranked across both, unsaid."""
    run = tmp_path / "run"
    args = ["checkpoint.every_steps=2", "trainer.eval_every=2"]
    cli(run, *args, "trainer.max_steps=2", "trainer.eval_batches=2", check=0)
    out = cli(run, *args, "trainer.max_steps=3", "trainer.eval_batches=2", check=0)
    assert "evaluation now reads" not in out.stdout
    out = cli(run, *args, "trainer.max_steps=4", "trainer.eval_batches=3", check=0)
    assert "evaluation now reads" in out.stdout and "= 3 x" in out.stdout, out.stdout
    assert "checkpoint.keep_best ranks across both" in out.stdout


def test_a_signal_after_the_final_commit_is_said_to_change_nothing(popen_cli, tmp_path):
    """SIGTERM while the finished run draws its plot said "finishing this step, saving,
    then exiting", though nothing is saved and the exit is 0: the loop's flag was still
    installed with its meaning. Now it says the run is already ending."""
    run = tmp_path / "run"
    proc = popen_cli(run, "trainer.max_steps=2", "checkpoint.every_steps=2", "run.plot=true")
    # the plot comes after this line (matplotlib: about a second)
    out = _signal_at_line(proc, "end reason=done", signal.SIGTERM)
    assert proc.returncode == 0, out
    assert "SIGTERM received: the run is already ending" in out, out
    assert "finishing this step, saving" not in out and _committed(run) == [2]
