"""Sharded state on S3 (a real S3 API server on loopback, see conftest): every rank
uploads its own chunk objects of one step, the coordinator commits once all confirmed, a
rank's failure commits nothing, and a restore on each rank downloads only its own rows."""

import json
import os

import pytest

from ftrain.ckpt import CheckpointManager

from ..integration.conftest import cache_dir  # noqa: F401 - fixture
from ..integration.test_sharding import _common, _torchrun, check_empty_leaves, check_row_restore
from .conftest import objects


@pytest.mark.long  # ~70 s; the CLI test below covers the same-size path in CI
def test_ranks_upload_their_own_rows_and_restore_downloads_only_theirs(bucket, tmp_path):
    """1 rank and 2 ranks save GPT-2 tiny sharded into the bucket; 2 ranks restore both,
    each downloading only the chunk objects of its rows, bit-exact (as on a local disk)."""
    url = f"s3://{bucket}"
    check_row_restore(f"{url}/one", f"{url}/two", tmp_path / "out.json", 2)
    for mode in ("optimizer", "full"):
        mgr = CheckpointManager(f"{url}/two/{mode}")
        assert mgr.all_steps() == [2] and not mgr.invalid_steps()


@pytest.mark.slow  # one 2-rank run, ~10 s
def test_sharded_leaves_with_no_elements_upload_and_download(bucket, tmp_path):
    """A (4*world, 0) leaf's chunk plan and a 0-row leaf's rows download (ZeroDivisionError)."""
    check_empty_leaves(f"s3://{bucket}/empty", tmp_path / "out.json")


@pytest.mark.slow  # three 2-rank CLI runs: ~60 s on 2 shared cores
def test_a_sharded_cli_run_on_s3_survives_a_failed_part_and_resumes_bit_identical(
    cache_dir,  # noqa: F811
    bucket,
    s3,
    tmp_path,
):
    """``dist.shard=optimizer`` with ``checkpoint.dir=s3://``: rank 1's upload of step 6
    fails (an injected error after its objects are up), so step 6 is not committed and its
    objects are removed; the next start resumes from step 3, every rank reading its rows
    from the bucket, and ends bit-identical to a run on a local disk."""
    from ftrain.faults import inject_dir
    from ftrain.state import first_difference

    common = [*_common("optimizer"), "trainer.max_steps=6"]
    local = tmp_path / "local"
    _torchrun(local, cache_dir, *common)
    url = f"s3://{bucket}/ck"
    arm = tmp_path / "arm.json"
    arm.write_text(
        json.dumps({"id": "p", "phase": "part_written", "count": 2, "rank": 1, "action": "enospc"})
    )
    path = os.pathsep.join(filter(None, [str(inject_dir()), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "FTRAIN_CHAOS_ARM": str(arm)}
    run = tmp_path / "run"
    out = _torchrun(run, cache_dir, *common, f"checkpoint.dir={url}", rc=1, env=env)
    assert "rank 1: [Errno 28] No space left on device (injected at part_written)" in out, out
    assert CheckpointManager(url).all_steps() == [3]
    assert not [k for k in objects(s3, bucket, "ck/step_00000006")]  # the failed upload is gone

    out = _torchrun(run, cache_dir, *common, f"checkpoint.dir={url}")
    assert "resumed from step 3" in out, out
    assert "[rank=1]" in out and "read " in out  # each rank reports what it downloaded
    mgr = CheckpointManager(url)
    assert mgr.all_steps() == [3, 6] and not mgr.invalid_steps()
    want = CheckpointManager(local / "checkpoints").restore(6)
    assert first_difference(mgr.restore(6), want) is None
