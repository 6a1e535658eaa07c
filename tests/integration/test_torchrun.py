"""Data-parallel runs under real torchrun (gloo, 2 ranks): training, elastic resume, restarts."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ftrain.ckpt import CheckpointManager

from .conftest import TINY, records

pytestmark = pytest.mark.slow


def _torchrun(run_dir, cache_dir, *overrides, nproc=2, extra=(), env=None, entry=("-m", "ftrain")):
    env = dict(
        os.environ,
        FTRAIN_CACHE_DIR=cache_dir,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        **(env or {}),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--standalone",
        *extra,
        *entry,
        f"run.dir={run_dir}",
        *TINY,
        "trainer.eval_every=null",
        *overrides,
    ]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def _finish(proc, timeout=300):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: the agent tears its workers down (they run in sessions of their
        # own, so a SIGKILLed agent would leave them running into the next tests)
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        raise AssertionError(f"torchrun timed out:\n{out}") from None
    return proc.returncode, out


def _state(run_dir, step):
    return CheckpointManager(Path(run_dir) / "checkpoints", async_save=False).restore(step)


def test_two_ranks_train_and_resume_on_one_rank_with_the_same_global_order(
    cli, cache_dir, tmp_path
):
    two, elastic = tmp_path / "two", tmp_path / "elastic"
    # dropout=0: dropout streams are per rank by design, so only with it off may the
    # 2-rank and 1-rank runs agree (up to all-reduce rounding).
    rc, out = _finish(
        _torchrun(
            two, cache_dir, "trainer.max_steps=6", "checkpoint.every_steps=3", "model.dropout=0"
        )
    )
    assert rc == 0, out
    assert "[rank=1]" in out and "[rank=0]" in out
    assert CheckpointManager(two / "checkpoints", async_save=False).all_steps() == [3, 6]
    meta = CheckpointManager(two / "checkpoints", async_save=False).metadata(6)
    assert meta["world_size"] == 2
    # every rank's host RNG states are recorded (seeded per rank from trainer.seed)
    assert sorted(meta["host_rng"]) == ["0", "1"]
    assert meta["host_rng"]["0"]["torch_cpu"] != meta["host_rng"]["1"]["torch_cpu"]

    rc, out = _finish(
        _torchrun(
            elastic, cache_dir, "trainer.max_steps=3", "checkpoint.every_steps=3", "model.dropout=0"
        )
    )
    assert rc == 0, out
    cli(
        elastic,
        "trainer.max_steps=6",
        "checkpoint.every_steps=3",
        "trainer.eval_every=null",
        "model.dropout=0",
        check=0,
    )
    resume = records(elastic, "resume")[-1]
    assert resume["from_step"] == 3 and resume["position"] == 12
    a, b = _state(two, 6), _state(elastic, 6)
    assert torch.equal(a["data"]["position"], b["data"]["position"])
    # Same samples in the same global order: only the all-reduce rounding differs.
    torch.testing.assert_close(a["params"], b["params"], rtol=1e-4, atol=1e-4)
    # the metrics a checkpoint records (and keep_best ranks) are the run's, as on one rank:
    # rank 0's own half-batch loss and counts were stored
    ma, mb = (CheckpointManager(r / "checkpoints").metadata(6)["metrics"] for r in (two, elastic))
    assert ma["samples"] == mb["samples"] and ma["tokens"] == mb["tokens"], (ma, mb)
    assert abs(ma["loss"] - mb["loss"]) < 1e-4, (ma, mb)
    sa, sb = (records(r, "step")[-1] for r in (two, elastic))
    assert sa["samples"] == sb["samples"] and sa["step"] == sb["step"] == 6, (sa, sb)


def _resume_with_rank_1_armed(run, cache_dir, arm: dict) -> tuple[int, str]:
    """Two steps committed, then a resume to 4 whose rank 1 meets ``arm`` (the injector's
    action, SIGKILL by default) as it reads the step; it must fail."""
    from ftrain.faults import inject_dir

    rc, out = _finish(_torchrun(run, cache_dir, "trainer.max_steps=2", "checkpoint.every_steps=2"))
    assert rc == 0, out
    armed = run.parent / "arm.json"
    armed.write_text(json.dumps({"phase": "restore_read", "rank": 1} | arm))
    path = os.pathsep.join(filter(None, [str(inject_dir()), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "FTRAIN_CHAOS_ARM": str(armed)}
    rc, out = _finish(_torchrun(run, cache_dir, "trainer.max_steps=4", env=env))
    assert rc != 0 and armed.with_name("arm.json.fired").exists(), out
    return rc, out


def test_a_rank_that_cannot_read_the_chosen_step_stops_every_rank_with_its_reason(
    cache_dir, tmp_path
):
    """Rank 1's read of the step the coordinator restored fails (an injected EIO: a failing
    disk, or a file system it sees differently): every rank stops before training, and the
    coordinator says which rank failed and why, instead of training into a collective that
    the failed rank never joins."""

    run = tmp_path / "run"
    rc, out = _resume_with_rank_1_armed(run, cache_dir, {"id": "r", "action": "eio"})
    assert "cannot resume step 2 on every rank: rank 1:" in out, out
    assert "I/O error (injected at restore_read)" in out, out
    # every rank exits with the message: the failed rank's OSError was a traceback; an I/O
    # error is the disk's state of the moment, exit 1 (it was exit 2, which a supervisor
    # configured not to restart a config error never retried)
    assert out.count("ftrain: cannot start: cannot resume step 2 on every rank") == 2, out
    assert re.search(r"exitcode\s*:\s*1\b", out) and not re.search(r"exitcode\s*:\s*2\b", out)
    assert "ftrain/cli/" not in out, out  # torchrun's agent prints its own traceback only
    assert CheckpointManager(run / "checkpoints", async_save=False).all_steps() == [2], out
    assert not [r for r in records(run, "step") if r.get("step", 0) > 2], out


def test_a_rank_killed_while_the_others_resume_is_one_line_on_them(cache_dir, tmp_path):
    """Rank 1 SIGKILLed while it reads the step to resume: rank 0's start-up collective
    failed with a 40-line traceback of gloo's internals (only the loop's collectives were
    said in one line); the restart resumed all the same."""

    run = tmp_path / "run"
    rc, out = _resume_with_rank_1_armed(run, cache_dir, {"id": "k"})  # killed there
    assert "ftrain: cannot start: rank 0: another rank is gone" in out, out
    assert "the newest committed checkpoint is intact" in out, out
    assert "ftrain/cli/" not in out, out  # no traceback of ftrain's
    rc, out = _finish(_torchrun(run, cache_dir, "trainer.max_steps=4"))
    assert rc == 0 and "resum" in out, out
    assert CheckpointManager(run / "checkpoints", async_save=False).all_steps()[-1] == 4


@pytest.mark.long  # the check itself is unit-tested in CI (tests/unit/test_config.py)
def test_a_global_batch_the_ranks_cannot_split_is_refused_at_start(cache_dir, tmp_path):
    """trainer.batch_size=3 on 2 ranks passed start-up and failed with a traceback on every
    rank when the loader was built; now it is a config error (exit 2) naming the fix, and
    nothing is written."""
    run = tmp_path / "run"
    rc, out = _finish(_torchrun(run, cache_dir, "trainer.batch_size=3", "trainer.max_steps=2"))
    assert rc != 0, out
    assert "trainer.batch_size=3 (the global batch) does not split over 2 ranks" in out, out
    # trainer.compile=true on 2 ranks: make_step's ValueError at step 1 before, a traceback
    rc, out = _finish(_torchrun(run, cache_dir, "trainer.compile=true", "trainer.max_steps=2"))
    assert rc != 0 and "trainer.compile=true compiles a one-rank step" in out, out
    # torchrun's agent prints its own traceback for a failed child; none from the ranks
    assert "ValueError" not in out and "ftrain/data/" not in out, out
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())


def test_a_logger_rank_0_cannot_build_stops_every_rank_at_start(cache_dir, tmp_path):
    """Rank 0 said "cannot start" (exit 2); rank 1 had restored and entered the loop, and
    died there in a collective with a 30-frame traceback and an emergency save."""
    pytest.importorskip("tensorboard")
    (tmp_path / "blocker").write_text("x")
    bad_log = f"logger.tensorboard.log_dir={tmp_path / 'blocker' / 'tb'}"
    run = tmp_path / "run"
    proc = _torchrun(run, cache_dir, "trainer.max_steps=2", "logger=[jsonl,tensorboard]", bad_log)
    rc, out = _finish(proc)
    assert rc != 0 and "logger.tensorboard could not start" in out, out
    assert "the loggers could not start on rank 0" in out, out  # rank 1's own line
    assert "emergency_save" not in out and "all_reduce" not in out, out


def test_a_rank_waiting_for_a_peer_that_failed_its_config_ends_at_torchruns_sigterm(
    cache_dir, tmp_path
):
    """Rank 0 refused its config (exit 2) before joining; rank 1, waiting in the rendezvous,
    held torchrun's SIGTERM for a step boundary that never came and was SIGKILLed 30 s
    later (on every restart attempt)."""
    t0 = time.monotonic()
    proc = _torchrun(tmp_path / "run", cache_dir, "trainer.max_steps=2",
                     "trainer.grad_accum=${oc.env:RANK}")  # fmt: skip
    rc, out = _finish(proc)
    assert rc != 0 and "trainer.grad_accum must be >= 1, got 0" in out, out
    assert "Unable to shutdown process" not in out, out  # SIGKILLed after 30 s before
    assert time.monotonic() - t0 < 28, out


def test_ranks_started_with_different_configs_are_refused_before_anything_is_written(
    cache_dir, tmp_path
):
    """A value that differs per rank (here an ${oc.env:LOCAL_RANK} interpolation) trained
    each rank with its own config while the checkpoints recorded rank 0's: now every rank
    stops at start (exit 2) with the keys and each rank's value, before claiming the run
    directory."""
    run = tmp_path / "run"
    proc = _torchrun(run, cache_dir, "trainer.max_steps=2", "trainer.seed=${oc.env:LOCAL_RANK}")
    rc, out = _finish(proc)
    assert rc != 0, out
    assert "the 2 ranks were started with different configs (trainer.seed: 0 on rank 0, " in out
    assert "1 on rank 1)" in out, out
    assert "Start every rank with the same overrides" in out, out
    assert "ftrain/cli/" not in out, out  # torchrun's agent prints its own traceback only
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())


def test_ranks_whose_nodes_hold_different_data_are_refused_at_start(cache_dir, tmp_path):
    """One ``data.path`` read on two "nodes" (each rank starts in its own directory, as
    two hosts would each read their own copy) whose corpora differ: each rank trained on
    its own data under rank 0's fingerprint, and the next resume stopped rank 1 with a
    fingerprint error and rank 0 with a raw gloo traceback. Now every rank stops at start
    (exit 2) naming each rank's fingerprint; a rank that cannot read its data is named."""
    import shutil

    for rank in (0, 1):
        shutil.copytree(TINY[4].split("=", 1)[1], tmp_path / f"node{rank}" / "corpus")
    (tmp_path / "node1" / "corpus" / "extra.txt").write_text("a newer file on node 1\n" * 50)
    wrapper = tmp_path / "node.sh"  # torchrun --no-python: cd to this rank's "node"
    wrapper.write_text(
        f'#!/bin/sh\ncd {tmp_path}/node$LOCAL_RANK && exec {sys.executable} -m ftrain "$@"\n'
    )
    wrapper.chmod(0o755)
    run = tmp_path / "run"
    launch = {"extra": ("--no-python",), "entry": (str(wrapper),)}
    rc, out = _finish(
        _torchrun(run, cache_dir, "trainer.max_steps=2", "data.path=corpus", **launch)
    )
    assert rc != 0, out
    assert "the 2 ranks read different data under one data.path (rank 0: fingerprint " in out
    assert out.count("make them identical") == 2, out  # every rank says why
    assert "Connection closed" not in out and "ftrain/cli/" not in out, out
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())
    shutil.rmtree(tmp_path / "node1" / "corpus")  # rank 1 cannot read it at all
    rc, out = _finish(
        _torchrun(run, cache_dir, "trainer.max_steps=2", "data.path=corpus", **launch)
    )
    assert rc != 0 and "rank 1 could not read its data: " in out, out
    assert "Connection closed" not in out, out


def _heartbeat_at(run, rank: int, step: int, proc, timeout: float = 180) -> dict:
    """Rank ``rank``'s heartbeat once it has reached ``step`` (its pid inside)."""
    beat = run / (f"heartbeat.rank{rank}.json" if rank else "heartbeat.json")
    deadline, info = time.time() + timeout, {"step": -1}
    while time.time() < deadline:
        try:
            info = json.loads(beat.read_text())
            if info["step"] >= step:
                return info
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.02)
    raise AssertionError(f"rank {rank} never reached step {step} (last heartbeat {info})")


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_torchrun_restarts_after_a_rank_is_killed_and_resumes(cache_dir, tmp_path):
    run = tmp_path / "run"
    proc = _torchrun(
        run,
        cache_dir,
        "trainer.max_steps=40",
        "checkpoint.every_steps=4",
        "checkpoint.async_save=false",
        extra=("--max-restarts=1",),
    )
    os.kill(_heartbeat_at(run, 1, 6, proc)["pid"], signal.SIGKILL)
    rc, out = _finish(proc)
    assert rc == 0, out
    # the survivor (if the collective failed before torchrun's SIGTERM reached it): one
    # line, not torch's 30-line traceback of the collective's internals
    assert "[rank0]: Traceback" not in out, out
    resumes = records(run, "resume")
    assert resumes and resumes[-1]["from_step"] >= 4
    assert "rank 0 restored" in resumes[-1]["host_rng"]
    assert CheckpointManager(run / "checkpoints", async_save=False).latest_step() == 40


@pytest.mark.long  # ~60 s; CI checks the timeout's classification in test_cli_app.py
def test_a_rank_that_stops_answering_is_one_line_after_dist_timeout_and_the_run_resumes(
    cache_dir, tmp_path
):
    """Rank 1 SIGSTOPped (hung, swapped out): rank 0's all-reduce gave up after
    dist.timeout_s with a 30-line traceback of gloo's "Timed out waiting 5000ms for recv
    operation" and no word of the newest commit. Now one line naming the hung peer and
    where a restart resumes; the restart resumes."""
    run = tmp_path / "run"
    common = ("checkpoint.every_steps=4", "checkpoint.async_save=false", "dist.timeout_s=5")
    proc = _torchrun(run, cache_dir, "trainer.max_steps=400", *common)
    stopped = _heartbeat_at(run, 1, 6, proc)["pid"]
    survivor = _heartbeat_at(run, 0, 0, proc)["pid"]
    os.kill(stopped, signal.SIGSTOP)
    try:
        assert _gone(survivor, 120), "rank 0 still waits on the stopped rank"
    finally:
        os.kill(stopped, signal.SIGKILL)
    rc, out = _finish(proc)
    assert rc != 0 and "[rank0]: Traceback" not in out, out
    assert "rank 0: another rank stopped answering for dist.timeout_s" in out, out
    assert "Timed out waiting 5000ms" in out and "newest committed checkpoint: step" in out
    last = CheckpointManager(run / "checkpoints", async_save=False).latest_step()
    assert last is not None and last >= 4
    rc, out = _finish(_torchrun(run, cache_dir, f"trainer.max_steps={last + 2}", *common))
    assert rc == 0, out
    assert records(run, "resume")[-1]["from_step"] == last


def _run_with_a_failing_save(tmp_path, cache_dir, every: int, steps: int) -> str:
    """A 2-rank run with async saves every ``every`` steps whose first save fails: the
    chaos injector (``ftrain.faults``, one shot) raises ENOSPC as rank 0 begins it. The
    output, once the run has failed."""
    from ftrain.faults import inject_dir

    arm = tmp_path / "arm.json"
    arm.write_text(json.dumps({"id": "save", "phase": "begun", "rank": 0, "action": "enospc"}))
    path = os.pathsep.join(filter(None, [str(inject_dir()), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "FTRAIN_CHAOS_ARM": str(arm)}
    common = ["checkpoint.async_save=true", f"checkpoint.every_steps={every}"]
    proc = _torchrun(tmp_path / "run", cache_dir, *common, f"trainer.max_steps={steps}", env=env)
    got, out = _finish(proc)
    assert got != 0 and arm.with_name("arm.json.fired").exists(), out
    assert "No space left on device (injected at begun)" in out, out
    return out


def _stop_step(out: str, rank: int) -> int | None:
    for ln in out.splitlines():
        if ln.startswith(f"[rank={rank}][step=") and "stopping: the coordinator's" in ln:
            return int(ln.split("[step=")[1].split("]")[0])
    return None


def test_a_failed_background_save_stops_every_rank_at_the_next_step_not_the_next_save(
    cache_dir, tmp_path
):
    """An injected ENOSPC as rank 0's async save of step 10 begins: every rank learns of it
    at a following step's save verdict (the coordinator broadcasts it), not at step 20's
    save a whole interval later, and they stop together."""
    out = _run_with_a_failing_save(tmp_path, cache_dir, every=10, steps=40)
    assert "checkpoint of step 10 did not commit" in out, out
    stopped = _stop_step(out, 1)
    assert stopped is not None and 10 < stopped < 20, out


def test_a_failed_final_save_is_shared_at_the_end_barrier(cache_dir, tmp_path):
    """The only save is the final one (async) and it fails on the coordinator: the other
    rank learns so at the end-of-run barrier and stops with it, instead of waiting there
    for a coordinator that is gone."""
    out = _run_with_a_failing_save(tmp_path, cache_dir, every=1000, steps=4)
    assert "checkpoint of step 4 did not commit" in out, out
    assert "[rank=1][step=4] stopping: the coordinator's last checkpoint save failed" in out, out


@pytest.mark.long  # ~36 s; CI restarts under torchrun in test_torchrun_restarts_after_a_rank_...
def test_a_torchrun_restart_continues_the_history_resume_n_began(cache_dir, tmp_path):
    """``torchrun --max-restarts=1 ... resume=3``: the restart took resume=3 again, went
    back to step 3 and set aside steps 6 and 9 that the job had just committed (every
    restart lost them). Now the restart resumes from the job's latest commit and says why;
    the old history's steps are set aside once, by the first attempt."""
    from ftrain.faults import inject_dir

    run, common = tmp_path / "run", ("checkpoint.every_steps=3", "checkpoint.async_save=false")
    rc, out = _finish(_torchrun(run, cache_dir, *common, "trainer.max_steps=9"))
    assert rc == 0, out
    arm = tmp_path / "arm.json"  # rank 0 dies as it begins its 3rd save (step 12)
    arm.write_text(json.dumps({"id": "restart", "phase": "begun", "count": 3, "rank": 0}))
    path = os.pathsep.join(filter(None, [str(inject_dir()), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "FTRAIN_CHAOS_ARM": str(arm)}
    restarts = ("--max-restarts=1",)
    proc = _torchrun(
        run, cache_dir, *common, "trainer.max_steps=15", "resume=3", extra=restarts, env=env
    )
    rc, out = _finish(proc)
    assert rc == 0 and arm.with_name("arm.json.fired").exists(), out
    resumes = [(r["from_step"], r["reason"]) for r in records(run, "resume")]
    assert resumes[-2:] == [(3, "resume=3"), (9, "resume=latest")], resumes
    assert "restart 1 continues the history it began (step(s) 6, 9 committed since)" in out, out
    names = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")]
    aside = sorted(n.split(".")[0] for n in names if "." in n)
    assert aside == ["step_00000006", "step_00000009"], aside  # the old history's, once
    assert CheckpointManager(run / "checkpoints", async_save=False).latest_step() == 15
    # resume=none run.overwrite=true: each restart moved the job's own steps aside and
    # trained from step 0 again; now the old run is moved aside once, and the restart
    # resumes the job's commit
    arm = tmp_path / "arm2.json"  # rank 0 dies as it begins its 2nd save (step 6)
    arm.write_text(json.dumps({"id": "over", "phase": "begun", "count": 2, "rank": 0}))
    env["FTRAIN_CHAOS_ARM"] = str(arm)
    over = ("trainer.max_steps=9", "resume=none", "run.overwrite=true")
    rc, out = _finish(_torchrun(run, cache_dir, *common, *over, extra=restarts, env=env))
    assert rc == 0 and arm.with_name("arm2.json.fired").exists(), out
    assert "resume=none run.overwrite=true was this torchrun job's first attempt's: " in out
    assert len(list(run.glob("overwritten-*"))) == 1, out
    assert [r["from_step"] for r in records(run, "resume")] == [3], out
    assert CheckpointManager(run / "checkpoints", async_save=False).latest_step() == 9


def test_every_rank_fine_tunes_from_the_base_step_the_coordinator_read(cli, cache_dir, tmp_path):
    """init.from=RUN (its newest step) was read by each rank on its own: a base still
    training, or nodes holding different copies, gave the ranks different frozen weights,
    exit 0. Each "node" here holds its own copy of the base, node 1's with a newer step:
    every rank now reads the coordinator's step, or every rank stops naming the one that
    cannot."""
    import shutil

    base = tmp_path / "base"
    cli(base, "trainer.max_steps=4", "checkpoint.every_steps=2", check=0)
    for rank in (0, 1):
        shutil.copytree(base, tmp_path / f"node{rank}" / "base")
    shutil.rmtree(tmp_path / "node0" / "base" / "checkpoints" / "step_00000004")
    wrapper = tmp_path / "node.sh"  # torchrun --no-python: cd to this rank's "node"
    wrapper.write_text(
        f'#!/bin/sh\ncd {tmp_path}/node$LOCAL_RANK && exec {sys.executable} -m ftrain "$@"\n'
    )
    wrapper.chmod(0o755)
    launch = {"extra": ("--no-python",), "entry": (str(wrapper),)}
    lora = ["model.lora.rank=4", "init.from=base", "trainer.max_steps=2"]
    rc, out = _finish(_torchrun(tmp_path / "tuned", cache_dir, *lora, **launch))
    assert rc == 0, out
    read = re.findall(r"\[rank=(\d)\].*initialised params from \S+ step (\d+)", out)
    assert sorted(read) == [("0", "2"), ("1", "2")], out
    shutil.rmtree(tmp_path / "node1" / "base" / "checkpoints" / "step_00000002")
    rc, out = _finish(_torchrun(tmp_path / "tuned2", cache_dir, *lora, **launch))
    assert rc != 0 and "exitcode: 2" in out, out  # the ranks' config exit, through torchrun
    assert out.count("step 2 (the coordinator's) could not be read on every rank: rank 1:") == 2
