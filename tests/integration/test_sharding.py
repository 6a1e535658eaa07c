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
    assert report["optimizer"]["param_bytes"] == report["param_bytes_plain"]
    # rows are split with torch.chunk's rule: a 1-row-per-rank tail may round up
    assert report["full"]["param_bytes"] <= report["param_bytes_plain"] / nproc * 1.05


def _torchrun(run_dir, cache_dir, *overrides, nproc=2):
    from .test_torchrun import _finish
    from .test_torchrun import _torchrun as launch

    rc, out = _finish(launch(run_dir, cache_dir, *overrides, nproc=nproc))
    assert rc == 0, out
    return out


@pytest.mark.parametrize("mode", ["optimizer", "full"])
def test_cli_sharded_run_resumes_bit_exact_and_on_another_world_size(
    cli, cache_dir, tmp_path, mode
):
    from ftrain.ckpt import CheckpointManager
    from ftrain.state import first_difference

    from .conftest import records

    whole, split, elastic = tmp_path / "whole", tmp_path / "split", tmp_path / "elastic"
    common = [f"dist.shard={mode}", "checkpoint.every_steps=3", "model.dropout=0"]
    out = _torchrun(whole, cache_dir, *common, "trainer.max_steps=6", "trainer.eval_every=3")
    assert "val_loss" in out  # evaluation gathers whole params under shard=full
    _torchrun(split, cache_dir, *common, "trainer.max_steps=3")
    out = _torchrun(split, cache_dir, *common, "trainer.max_steps=6")
    assert "resumed from step 3" in out

    def state(run, step):
        return CheckpointManager(Path(run) / "checkpoints", async_save=False).restore(step)

    # the same world size: bit for bit, as without sharding
    assert first_difference(state(whole, 6), state(split, 6)) is None
    # the checkpoint holds whole tensors (2 ranks wrote it): it resumes on one rank
    shutil.copytree(
        split / "checkpoints" / "step_00000003", elastic / "checkpoints" / "step_00000003"
    )
    out = cli(elastic, *common, "trainer.max_steps=6", "trainer.eval_every=null", check=0).stdout
    assert "world size changed: checkpoint written by 2 rank(s), resumed on 1" in out
    assert f"dist.shard={mode} on one rank: nothing to shard" in out
    assert records(elastic, "resume")[-1]["position"] == 12  # the global sample order goes on
    a, b = state(whole, 6), state(elastic, 6)
    assert torch.equal(a["data"]["position"], b["data"]["position"])


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
