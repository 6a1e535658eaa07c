"""The sharded optimizer state (ZeRO-1) under real torchrun (gloo, 2 ranks)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("sharding_worker.py")


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.long)])
def test_sharded_state_matches_unsharded_and_splits_what_each_rank_holds(tmp_path, nproc):
    out = tmp_path / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--standalone",
    ]
    proc = subprocess.run(
        [*cmd, str(WORKER), str(out)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    for mode in ("optimizer", "full"):
        r = report[mode]
        assert r["params_rel"] <= 1e-5 and r["opt_rel"] <= 1e-5, (mode, r)  # 50 steps, clipped
        assert r["norm_rel"] <= 1e-9, (mode, r)  # the norm over shards is the whole norm
        assert r["params_identical_across_ranks"] and r["roundtrip_bit_exact"], (mode, r)
        # per-parameter moments are split N ways; only 0-d counters stay whole
        assert r["opt_bytes"] <= report["opt_bytes_plain"] / nproc + 64, (mode, r)
        store = r["store"]  # one store, every rank writing its own rows
        assert store["rows_ok"] and store["parts_disjoint"] and store["restore_whole"], store
        assert min(store["files_per_rank"]) > 0, store
        assert store["rank_buffer_is_rank0s"], store
    fused = report["optimizer_fused"]  # optim.adamw(fused=True) on the shards
    assert fused["params_rel"] <= 1e-5 and fused["opt_rel"] <= 1e-5, fused
    assert fused["params_identical_across_ranks"] and fused["store"]["restore_whole"], fused
    assert report["optimizer"]["param_bytes"] == report["param_bytes_plain"]
    assert report["wide_rows"], "a sharded row wider than chunk_bytes saves, one row a chunk"
    # rows are split with torch.chunk's rule: a 1-row-per-rank tail may round up
    assert report["full"]["param_bytes"] <= report["param_bytes_plain"] / nproc * 1.05


def _torchrun(run_dir, cache_dir, *overrides, nproc=2, rc=0, env=None):
    from .test_torchrun import _finish
    from .test_torchrun import _torchrun as launch

    got, out = _finish(launch(run_dir, cache_dir, *overrides, nproc=nproc, env=env))
    assert got == rc, out
    return out


def _common(mode):
    return [f"dist.shard={mode}", "checkpoint.every_steps=3", "model.dropout=0"]


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory):
    """``reference(mode)``: the run dir of an uninterrupted 2-rank sharded run of 6 steps
    (steps 3 and 6 committed), run once per mode for the tests of this module."""
    runs = {}

    def get(mode):
        if mode not in runs:
            run = tmp_path_factory.mktemp(f"reference-{mode}")
            common = [*_common(mode), "trainer.max_steps=6", "trainer.eval_every=3"]
            runs[mode] = (run, _torchrun(run, cache_dir, *common))
        return runs[mode]

    return get


def _state(run, step):
    from ftrain.ckpt import CheckpointManager

    return CheckpointManager(Path(run) / "checkpoints", async_save=False).restore(step)


# CI runs ZeRO-1 end to end; ZeRO-3 through the CLI is long mode (~40 s; the full mode's
# step, save and row restore are covered in CI by the worker tests above and below)
@pytest.mark.parametrize("mode", ["optimizer", pytest.param("full", marks=pytest.mark.long)])
def test_cli_sharded_run_resumes_bit_exact_and_on_another_world_size(
    cli, cache_dir, tmp_path, reference, mode
):
    from ftrain.state import first_difference

    from .conftest import records

    (whole, out), split, elastic = reference(mode), tmp_path / "split", tmp_path / "elastic"
    common = _common(mode)
    assert "val_loss" in out  # evaluation gathers whole params under shard=full
    _torchrun(split, cache_dir, *common, "trainer.max_steps=3")
    out = _torchrun(split, cache_dir, *common, "trainer.max_steps=6")
    assert "resumed from step 3" in out
    for rank in (0, 1):  # each rank read its rows of the sharded leaves, not the whole step
        assert f"[rank={rank}][step=3] read " in out, out

    # the same world size: bit for bit, as without sharding
    assert first_difference(_state(whole, 6), _state(split, 6)) is None
    # the checkpoint holds whole tensors (2 ranks wrote it): it resumes on one rank
    shutil.copytree(
        split / "checkpoints" / "step_00000003", elastic / "checkpoints" / "step_00000003"
    )
    out = cli(elastic, *common, "trainer.max_steps=6", "trainer.eval_every=null", check=0).stdout
    assert "world size changed: checkpoint written by 2 rank(s), resumed on 1" in out
    assert "resharded from 2 to 1 ranks" in out
    assert f"dist.shard={mode} on one rank: nothing to shard" in out
    assert records(elastic, "resume")[-1]["position"] == 12  # the global sample order goes on
    a, b = _state(whole, 6), _state(elastic, 6)
    assert torch.equal(a["data"]["position"], b["data"]["position"])


def test_a_one_rank_checkpoint_resumes_sharded_on_two_ranks_and_continues(
    cli, cache_dir, tmp_path, reference
):
    """1 -> 2 through the CLI: each rank reads its rows of a step one process wrote, and
    the global sample order continues: steps 4-6 see the reference's batches (their loss
    matches the uninterrupted 2-rank run's to reduction-order rounding) and the cursor
    ends where the reference's does."""
    from .conftest import records

    whole, _ = reference("optimizer")
    run, common = tmp_path / "grow", _common("optimizer")
    cli(run, *common, "trainer.max_steps=3", "trainer.eval_every=null", check=0)
    out = _torchrun(run, cache_dir, *common, "trainer.max_steps=6", "trainer.eval_every=3")
    assert "world size changed: checkpoint written by 1 rank(s), resumed on 2" in out, out
    assert "resharded from 1 to 2 ranks" in out
    for rank in (0, 1):
        assert f"[rank={rank}][step=3] read " in out, out
    assert records(run, "resume")[-1]["position"] == 12
    want = {r["step"]: r["loss"] for r in records(whole, "step")}
    got = {r["step"]: r["loss"] for r in records(run, "step") if r["step"] > 3}
    assert sorted(got) == [4, 5, 6]
    for step, loss in got.items():
        assert abs(loss - want[step]) <= 1e-3 * abs(want[step]), (step, loss, want[step])
    a, b = _state(whole, 6), _state(run, 6)
    assert torch.equal(a["data"]["position"], b["data"]["position"])


def _flip_rank1_rows(step_dir: Path) -> Path:
    """Flip a byte in a chunk of optimizer rows that only rank 1 (of 2) reads: with one chunk
    per shard, chunk 1 of a moment is rank 1's rows."""
    chunk = sorted((step_dir / "opt").rglob("c.1.0"))[0]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    return chunk


@pytest.mark.parametrize("mode", ["optimizer", pytest.param("full", marks=pytest.mark.long)])
def test_corrupt_rows_of_one_rank_make_every_rank_fall_back(cache_dir, tmp_path, reference, mode):
    from ftrain.state import first_difference

    whole, _ = reference(mode)
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    _flip_rank1_rows(run / "checkpoints" / "step_00000006")
    out = _torchrun(run, cache_dir, *_common(mode), "trainer.max_steps=6")
    for rank in (0, 1):  # rank 0 read no bad byte, yet it falls back with rank 1
        assert f"[rank={rank}][step=3] resumed from step 3" in out, out
    assert "step 6 was committed but is unreadable, skipped in favour of step 3: rank 1:" in out
    assert "crc32c mismatch" in out and "rank 0:" not in out
    # steps 4..6 redone from step 3 (the bad step 6 set aside when the new one commits)
    assert first_difference(_state(whole, 6), _state(run, 6)) is None


def test_a_failed_part_on_rank_1_commits_nothing_and_the_next_start_resumes(
    cache_dir, tmp_path, reference
):
    """A write failure of a non-coordinator rank's part (an injected ENOSPC on rank 1 while
    it writes step 6): nothing is committed, every rank fails (no hang), and the next start
    resumes from step 3 and ends bit-identical to the uninterrupted run."""
    from ftrain.ckpt import CheckpointManager
    from ftrain.faults import inject_dir
    from ftrain.state import first_difference

    whole, _ = reference("optimizer")
    run, arm = tmp_path / "run", tmp_path / "arm.json"
    arm.write_text(
        json.dumps({"id": "p", "phase": "part_written", "count": 2, "rank": 1, "action": "enospc"})
    )
    path = os.pathsep.join(filter(None, [str(inject_dir()), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "FTRAIN_CHAOS_ARM": str(arm)}
    common = [*_common("optimizer"), "trainer.max_steps=6"]
    out = _torchrun(run, cache_dir, *common, rc=1, env=env)
    assert arm.with_name("arm.json.fired").exists(), out
    injected = "rank 1: [Errno 28] No space left on device (injected at part_written)"
    for rank in (0, 1):  # every rank reports the failure of rank 1's part, and stops
        lines = [ln for ln in out.splitlines() if ln.startswith(f"[rank={rank}][step=6]")]
        assert any("checkpoint of step 6 did not commit" in ln and injected in ln for ln in lines)
    assert "newest committed checkpoint: step 3" in out, out
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out  # ftrain's
    ckpt = run / "checkpoints"
    assert CheckpointManager(ckpt, async_save=False).all_steps() == [3]
    out = _torchrun(run, cache_dir, *common)
    assert "resumed from step 3" in out
    assert not list(ckpt.glob("*.tmp-*"))  # the staging of step 6 is gone
    assert first_difference(_state(whole, 6), _state(run, 6)) is None


@pytest.mark.long  # ~20 s; the unsharded fallback is tested in CI (test_cli_trust.py)
def test_a_sharded_save_the_primary_refuses_goes_to_the_fallback(cache_dir, tmp_path, reference):
    """checkpoint.fallback_dir was silently unused by sharded saves: ENOSPC in the primary
    stopped the run (exit 1) and the steps since the last commit were lost. Every rank
    learns the failure, so every rank writes its rows to the fallback; the run goes on,
    bit-identical, and the next start resumes from the fallback's step."""
    from ftrain.ckpt import CheckpointManager
    from ftrain.faults import inject_dir
    from ftrain.state import first_difference

    whole, _ = reference("optimizer")
    run, fallback, arm = tmp_path / "run", tmp_path / "fallback", tmp_path / "arm.json"
    arm.write_text(  # rank 0 cannot stage step 6 in the primary (a full disk)
        json.dumps({"id": "f", "phase": "begun", "count": 2, "rank": 0, "action": "enospc"})
    )
    path = os.pathsep.join(filter(None, [str(inject_dir()), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "FTRAIN_CHAOS_ARM": str(arm)}
    common = [*_common("optimizer"), "trainer.max_steps=6", f"checkpoint.fallback_dir={fallback}"]
    out = _torchrun(run, cache_dir, *common, env=env)
    assert arm.with_name("arm.json.fired").exists(), out
    assert "saving to fallback" in out, out
    assert CheckpointManager(run / "checkpoints", async_save=False).all_steps() == [3]
    saved = CheckpointManager(fallback, async_save=False)
    assert saved.all_steps() == [6]
    assert first_difference(_state(whole, 6), saved.restore(6)) is None
    out = _torchrun(run, cache_dir, *common[:-2], "trainer.max_steps=9", common[-1])
    assert "resumed from step 6" in out, out


@pytest.mark.long
def test_a_kill_at_the_first_sharded_commit_after_going_back_resumes_the_new_history(
    cache_dir, tmp_path, reference
):
    """resume=3 over the sharded 3 and 6 with a new learning rate, rank 0 SIGKILLed the
    moment the new 6 is committed: the old 6 was set aside before that commit (by the
    coordinator), so the restart goes on from the new history's 6."""
    from ftrain.ckpt import CheckpointManager
    from ftrain.faults import inject_dir

    whole, _ = reference("optimizer")
    run, arm = tmp_path / "run", tmp_path / "arm.json"
    shutil.copytree(whole / "checkpoints", run / "checkpoints")
    arm.write_text(json.dumps({"id": "b", "phase": "renamed", "count": 1, "rank": 0}))
    path = os.pathsep.join(filter(None, [str(inject_dir()), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "FTRAIN_CHAOS_ARM": str(arm)}
    common = [*_common("optimizer"), "trainer.max_steps=6", "run.allow_config_change=true"]
    common += ["optim.lr=1e-3"]
    out = _torchrun(run, cache_dir, *common, "resume=3", rc=1, env=env)
    assert arm.with_name("arm.json.fired").exists(), out
    mgr = CheckpointManager(run / "checkpoints", async_save=False)
    assert mgr.all_steps() == [3, 6] and sorted(mgr.set_aside_steps()) == [6]
    assert mgr.metadata(6)["config"]["optim"]["lr"] == 1e-3  # the listed 6 is the new one
    out = _torchrun(run, cache_dir, *common)
    assert "resumed from step 6" in out, out


RESHARD = Path(__file__).with_name("reshard_worker.py")


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.long)])
def test_restore_reads_only_the_rows_each_rank_owns(tmp_path, nproc):
    """Steps written by 1 rank (whole) and by 2 ranks (rows) restored on ``nproc`` ranks with
    ``restore(rows=sharder)``: bit-exact rows, and each rank reads about its share."""
    check_row_restore(str(tmp_path / "one"), str(tmp_path / "two"), tmp_path / "out.json", nproc)


def test_an_async_sharded_save_runs_beside_the_training_on_every_rank(tmp_path):
    """``save_sharded`` with ``async_save`` returns at once on every rank; training steps
    (collectives on the default group) run while the parts are written (the save's
    collectives on a group of its own); the step then commits and restores bit-exact."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(RESHARD), "overlap", str(tmp_path / "ck"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(out.read_text())
    assert got["steps"] == [1]
    assert all(not r["differ"] for r in got["ranks"]), got


def check_empty_leaves(where: str, out: Path) -> None:
    """Sharded leaves with no elements save, keep and restore (whole and by rows) on 2
    ranks at ``where``, after states no reader could read were refused on every rank (also
    run by tests/s3 with an ``s3://`` location)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*run, str(RESHARD), "empty", where, str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = {"refused": True, "steps": [2], "whole": True, "rows": True}
    assert json.loads(out.read_text()) == [expected] * 2


def test_sharded_leaves_with_no_elements_save_and_restore(tmp_path):
    check_empty_leaves(str(tmp_path / "ck"), tmp_path / "out.json")


def check_row_restore(one: str, two: str, out: Path, nproc: int) -> None:
    """Save at ``one`` (in this process) and ``two`` (2 ranks), restore both on ``nproc``
    ranks reading rows only, and check what every rank got and read (also run by
    tests/s3 with ``s3://`` locations)."""
    from .reshard_worker import save

    save(one)  # in this process: world size 1, a replicated step
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    for n, args in ((2, ["save", two]), (nproc, ["load", str(out), one, two])):
        cmd = [*run, f"--nproc-per-node={n}", str(RESHARD), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = json.loads(out.read_text())["ranks"]
    for case in ranks[0]:
        got = [r[case] for r in ranks]
        assert all(g["bit_exact"] and g["step"] == 2 for g in got), (case, got)
        total, whole = got[0]["sharded_total"], got[0]["whole_read"]
        assert sum(g["own_rows"] for g in got) == total, (case, got)
        for g in got:
            rows = g["read"] - g["replicated"]  # what it read of the sharded arrays
            assert rows >= g["own_rows"] and g["read"] < whole, (case, g)
            if case.startswith("two/") and nproc == 2:  # chunks follow these very shards
                assert rows == g["own_rows"], (case, g)
            assert rows / total <= 1 / nproc + 0.05, (case, g)  # resharded: edge chunks


@pytest.mark.long
def test_two_nodes_on_one_machine_train_like_one_node_of_two(cli, cache_dir, tmp_path):
    """Multi-node launch with torchrun's c10d rendezvous: two torchrun processes
    (``--nnodes=2``, one rank each) on 127.0.0.1 against one ``--standalone`` of two ranks."""
    from ftrain.ckpt import CheckpointManager
    from ftrain.state import first_difference

    from .conftest import TINY

    nodes, single = tmp_path / "nodes", tmp_path / "single"
    common = ["trainer.max_steps=4", "checkpoint.every_steps=4", "model.dropout=0"]
    _torchrun(single, cache_dir, *common)
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    rdzv = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-id=ftrain-2nodes"]
    rdzv += ["--rdzv-endpoint=127.0.0.1:29577"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, "-m", "ftrain", f"run.dir={nodes}"]
    cmd += [*TINY, "trainer.eval_every=null", *common]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    meta = CheckpointManager(nodes / "checkpoints", async_save=False).metadata(4)
    assert meta["world_size"] == 2

    def state(run):
        return CheckpointManager(run / "checkpoints", async_save=False).restore(4)

    assert first_difference(state(nodes), state(single)) is None
