"""The real CLI (``python -m ftrain``) with ``checkpoint.dir=s3://...`` on a loopback S3
server: train, SIGKILL mid-upload, resume from the newest committed step in the bucket,
end bit-identical to a local run; start-up errors exit 2 with the reason."""

import json
import os
from pathlib import Path

import pytest

from ftrain.ckpt import CheckpointManager
from ftrain.state import first_difference

from ..integration.conftest import cache_dir, cli, forkserver  # noqa: F401 - fixtures

INJECT = str(Path(__file__).parent / "inject")
SAVES = ("checkpoint.every_steps=2", "checkpoint.keep_last=3")


@pytest.mark.slow  # three CLI runs: ~40 s on 2 shared cores
def test_kill_mid_upload_then_resume_is_bit_identical_to_a_local_run(
    cli,  # noqa: F811
    bucket,
    tmp_path,
    monkeypatch,
):
    cli(tmp_path / "local", "trainer.max_steps=6", *SAVES, check=0)
    want = CheckpointManager(tmp_path / "local" / "checkpoints").restore(6)

    url = f"s3://{bucket}/runs/tiny"
    run = tmp_path / "s3run"
    with monkeypatch.context() as m:
        m.setenv("PYTHONPATH", os.pathsep.join([INJECT, os.environ.get("PYTHONPATH", "")]))
        m.setenv("FTRAIN_S3_KILL", "1:3")  # after step 2 commits, 3 chunks into step 4
        killed = cli(run, "trainer.max_steps=6", *SAVES, f"checkpoint.dir={url}")
    assert killed.returncode == -9, killed.stdout + killed.stderr
    mgr = CheckpointManager(url)
    assert mgr.all_steps() == [2]
    assert any("step_00000004" in str(p) for p in mgr.invalid_steps())  # partial upload

    out = cli(run, "trainer.max_steps=6", *SAVES, f"checkpoint.dir={url}", check=0)
    assert "resumed from step 2" in out.stdout, out.stdout
    mgr = CheckpointManager(url)
    assert mgr.all_steps() == [2, 4, 6]
    assert not mgr.invalid_steps() and not mgr.set_aside_steps()
    assert first_difference(mgr.restore(6), want) is None
    assert not (run / "s3:").exists() and not Path("s3:").exists()  # no local look-alike


def test_a_missing_bucket_exits_2_with_the_reason(
    cli,  # noqa: F811
    s3_server,
    tmp_path,
):
    out = cli(tmp_path / "r1", "trainer.max_steps=2", "checkpoint.dir=s3://no-such-bkt/ck", check=2)
    assert "no-such-bkt" in out.stderr + out.stdout and "NoSuchBucket" in out.stderr + out.stdout
    # URL-like local paths and unknown schemes: the same exit 2 path (CheckpointLocationError),
    # tested at the library level in test_s3_ckpt.py


def test_an_endpoint_that_does_not_answer_is_said_in_seconds(
    cli,  # noqa: F811
    s3_server,
    tmp_path,
    monkeypatch,
):
    """Nothing listening at AWS_ENDPOINT_URL: the start claimed the location first, its
    read and write of .owner.json each retrying for about three minutes (379 s, exit 2).
    The quick listing probe comes first now."""
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    out = cli(tmp_path / "r1", "trainer.max_steps=2", "checkpoint.dir=s3://bkt/ck", check=2)
    assert time.monotonic() - t0 < 60, "minutes of retries before the start said why"
    assert "cannot use checkpoint location s3://bkt/ck" in out.stderr, out.stderr


@pytest.mark.parametrize("value", ["s3:bkt/ck", "s3:/bkt/ck", "gopher://h/ck", "s3://bkt/x/../ck"])
def test_a_url_like_path_or_unknown_scheme_exits_2_before_anything_is_made(
    value, tmp_path, monkeypatch, capsys
):
    from ftrain.cli.run import main

    monkeypatch.chdir(tmp_path)
    assert main([f"run.dir={tmp_path / 'run'}", f"checkpoint.dir={value}"]) == 2
    err = capsys.readouterr().err
    assert "BUCKET/PREFIX" in err or "unknown scheme" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no ./s3: directory


def test_overwrite_refuses_an_object_store_location_with_steps(bucket, tmp_path, capsys):
    """run.overwrite=true cannot rename steps aside on an object store: it stops (exit 2)
    rather than start a fresh run over, or resume, the committed steps there."""
    import torch
    from tensordict import TensorDict

    from ftrain.cli.run import main

    url = f"s3://{bucket}/ck"
    state = TensorDict({"step": torch.tensor(1)}, batch_size=[])
    CheckpointManager(url, async_save=False).save(state)
    argv = [f"run.dir={tmp_path / 'run'}", f"checkpoint.dir={url}", "resume=none"]
    assert main([*argv, "run.overwrite=true"]) == 2
    assert "cannot move them aside" in capsys.readouterr().err
    assert CheckpointManager(url).all_steps() == [1]


def _config_instead_of_env(s3_server, monkeypatch) -> list[str]:
    """Unset the S3 environment; return the same settings as ``checkpoint.storage``."""
    env = s3_server["env"]
    for name in env:
        monkeypatch.delenv(name, raising=False)
    return [
        f"+checkpoint.storage.endpoint={env['AWS_ENDPOINT_URL']}",
        "+checkpoint.storage.allow_http=true",
        "+checkpoint.storage.region=us-east-1",
        "+checkpoint.storage.access_key_id=testing",
        "+checkpoint.storage.secret_access_key=${oc.env:FTRAIN_TEST_SECRET}",
    ]


def test_storage_options_from_config_replace_the_environment_and_secrets_are_not_recorded(
    s3_server, bucket, tmp_path, monkeypatch, capsys
):
    from ftrain.cli.run import main

    storage = _config_instead_of_env(s3_server, monkeypatch)
    monkeypatch.setenv("FTRAIN_TEST_SECRET", "testing")
    url = f"s3://{bucket}/ck"
    argv = [f"run.dir={tmp_path / 'run'}", f"checkpoint.dir={url}", "trainer.max_steps=2"]
    assert main([*argv, "checkpoint.every_steps=2", *storage]) == 0, capsys.readouterr().err
    # without the options (and no environment) the same bucket is unreachable: they were used
    assert main([*argv, "trainer.max_steps=3"]) == 2
    assert bucket in capsys.readouterr().err

    mgr = CheckpointManager(url, storage_options=_options(s3_server))
    assert mgr.all_steps() == [2]
    recorded = mgr.metadata(2)["config"]["checkpoint"]["storage"]
    assert recorded["secret_access_key"] == recorded["access_key_id"] == "<redacted>"
    assert recorded["endpoint"] == s3_server["endpoint"]
    records = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "FTRAIN_TEST_SECRET" not in records and '"testing"' not in records


def _options(s3_server) -> dict:
    return {
        "endpoint": s3_server["endpoint"],
        "allow_http": True,
        "region": "us-east-1",
        "access_key_id": "testing",
        "secret_access_key": "testing",
    }


def test_an_unknown_storage_option_exits_2_naming_it(s3_server, tmp_path, monkeypatch, capsys):
    from ftrain.cli.run import main

    argv = [f"run.dir={tmp_path / 'run'}", "checkpoint.dir=s3://b/ck", "trainer.max_steps=1"]
    assert main([*argv, "+checkpoint.storage.endpiont=http://x"]) == 2
    err = capsys.readouterr().err
    assert "'endpiont'" in err and "storage option" in err, err


def test_a_bucket_prefix_claimed_by_another_run_dir_refuses_a_second_run(
    cli,  # noqa: F811
    s3,
    bucket,
    tmp_path,
):
    """Two runs with their own run.dir and one s3:// checkpoint.dir (e.g. a sweep): the
    second is refused (exit 2, the owner named, the way out given) and writes nothing;
    with checkpoint.take_over=true it runs; a run that ends with steps committed keeps its
    record, marked ended, so the next job of a sweep does not continue its history."""
    from ftrain.ckpt.location import parse_location
    from ftrain.ckpt.owner import OWNER, claim

    from .conftest import objects

    url = f"s3://{bucket}/shared"
    claim(parse_location(url), tmp_path / "other")  # a run that was killed: never released
    before = objects(s3, bucket)
    out = cli(tmp_path / "mine", "trainer.max_steps=2", *SAVES, f"checkpoint.dir={url}", check=2)
    assert "belongs to another run" in out.stderr and "checkpoint.take_over=true" in out.stderr
    assert str((tmp_path / "other").resolve()) in out.stderr and "Traceback" not in out.stderr
    assert objects(s3, bucket) == before  # nothing written, the record untouched

    cli(tmp_path / "mine", "trainer.max_steps=2", *SAVES, f"checkpoint.dir={url}",
        "checkpoint.take_over=true", check=0)  # fmt: skip
    assert CheckpointManager(url).all_steps() == [2]
    kept = json.loads(s3.get_object(Bucket=bucket, Key=f"shared/{OWNER}")["Body"].read())
    assert kept["run_dir"] == str((tmp_path / "mine").resolve()) and "ended" in kept
    out = cli(tmp_path / "next", "trainer.max_steps=2", *SAVES, f"checkpoint.dir={url}", check=2)
    assert "holds the checkpoints of another run" in out.stderr  # the next job of a sweep


def test_claims_on_an_object_store_race_and_release_like_local_ones(bucket, tmp_path):
    from ftrain.ckpt.location import parse_location
    from ftrain.ckpt.owner import CheckpointOwnerError, claim

    root = parse_location(f"s3://{bucket}/p")
    a = claim(root, tmp_path / "a")
    with pytest.raises(CheckpointOwnerError, match="belongs to another run"):
        claim(parse_location(f"s3://{bucket}/p"), tmp_path / "b")
    again = claim(root, tmp_path / "a")  # a restart of the same run
    a.release()  # the old process's token: not released
    with pytest.raises(CheckpointOwnerError):
        claim(root, tmp_path / "b")
    again.release()
    claim(root, tmp_path / "b")


def test_a_store_without_conditional_puts_still_refuses_a_second_run_dir(
    bucket, tmp_path, monkeypatch
):
    """A store that cannot put "if none exists" (the put falls back to a plain one): the
    record is read before the create, so another run's is never overwritten."""
    from ftrain.ckpt.location import parse_location
    from ftrain.ckpt.objstore import ObjectRoot
    from ftrain.ckpt.owner import CheckpointOwnerError, claim

    monkeypatch.setattr(ObjectRoot, "put_new", ObjectRoot.put)  # as on NotSupportedError
    root = parse_location(f"s3://{bucket}/p")
    claim(root, tmp_path / "a")
    with pytest.raises(CheckpointOwnerError, match="belongs to another run"):
        claim(root, tmp_path / "b")


def test_the_read_only_tools_say_an_endpoint_that_does_not_answer_in_seconds(
    s3_server, monkeypatch, capsys
):
    """`python -m ftrain.ckpt list s3://...` with the endpoint down printed an obstore error
    after 2 min 54 s of retries; it probes first now."""
    import socket
    import time

    from ftrain.ckpt.__main__ import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    assert main(["list", "s3://bkt/ck"]) == 2
    assert time.monotonic() - t0 < 60
    assert "cannot use checkpoint location s3://bkt/ck" in capsys.readouterr().err
