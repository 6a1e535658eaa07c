"""Checkpoints on S3 (a real S3 API server on loopback, see conftest): the marker-last
commit protocol, bit-exact round trips, fall back, retention, errors, plain zarr readers."""

import json
import os
import time
import warnings

import ml_dtypes
import moto.settings
import numpy as np
import obstore.store
import pytest
import torch
import zarr
from tensordict import TensorDict
from zarr.storage import ObjectStore

from ftrain.ckpt import (
    CheckpointLocationError,
    CheckpointManager,
    CheckpointSaveError,
    CheckpointStoreError,
    LatestN,
)
from ftrain.ckpt import objstore as objstore_mod
from ftrain.ckpt.location import parse_location
from ftrain.ckpt.objio import upload_tree
from ftrain.ckpt.store import write_tree
from ftrain.state import first_difference

from .conftest import objects


def make_state(step: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed + step)
    return TensorDict(
        {
            "step": torch.tensor(step, dtype=torch.int64),
            "params": {
                "w": torch.randn(300, 17, generator=g),
                "h": torch.randn(64, 8, generator=g).to(torch.bfloat16),
                "f8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
                "half": torch.randn(5, 3, generator=g).half(),
                "empty": TensorDict({}, batch_size=[]),
            },
            "opt": {"count": torch.tensor(step, dtype=torch.int32), "z": torch.zeros(0, 4)},
            "mask": torch.rand(33, generator=g) > 0.5,
            "c": torch.randn(4, 2, generator=g, dtype=torch.complex64),
        },
        batch_size=[],
    )


@pytest.mark.parametrize("compression", [None, "zstd:1", "blosc-lz4"])
def test_round_trip_bit_exact(bucket, compression):
    """bf16, float8, 0-d, empty groups, zero-size arrays, bool, complex; async save; small
    chunks so arrays span several objects."""
    url = f"s3://{bucket}/run/ckpt"
    m = CheckpointManager(url, chunk_bytes=1024, compression=compression)
    for step in (1, 2):
        assert m.save(make_state(step))
    m.close()
    again = CheckpointManager(url)
    assert again.all_steps() == [1, 2]
    assert first_difference(again.restore(), make_state(2)) is None
    assert first_difference(again.restore(1), make_state(1)) is None
    part = again.restore(2, only="params")
    assert first_difference(part["params"], make_state(2)["params"]) is None
    assert again.metadata(2)["path"] == f"{url}/step_00000002"


def test_same_bytes_as_the_local_format(bucket, tmp_path):
    """One format whatever the backend: every object equals the local file of that name."""
    state, attrs = make_state(3), {"note": "same"}
    local = tmp_path / "step"
    local.mkdir()
    want_manifest = write_tree(local, state, attrs, chunk_bytes=2048, compression="zstd:1")
    root = parse_location(f"s3://{bucket}/x")
    got_manifest = upload_tree(root / "step", state, attrs, 2048, "zstd:1")
    assert got_manifest == want_manifest
    files = {
        p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()
    }
    objs = {k.removeprefix("x/step/"): v for k, v in objects(_s3(), bucket, "x/step/").items()}
    assert objs == files


def _s3():
    import boto3

    return boto3.client("s3")


def _chunk_keys(s3, bucket, prefix):
    return sorted(
        (k for k in objects(s3, bucket, prefix) if "/c." in k or k.endswith("/c")),
        key=lambda k: -len(objects(s3, bucket, k)[k]),
    )


def test_a_corrupted_object_falls_back(bucket, s3):
    url = f"s3://{bucket}/ck"
    m = CheckpointManager(url, async_save=False, chunk_bytes=1024)
    m.save(make_state(1))
    m.save(make_state(2))
    key = _chunk_keys(s3, bucket, "ck/step_00000002/params/w/")[0]
    raw = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    raw[10] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(raw))
    with pytest.warns(RuntimeWarning, match="crc32c mismatch"):
        got = CheckpointManager(url).restore()
    assert first_difference(got, make_state(1)) is None
    s3.delete_object(Bucket=bucket, Key=key)  # a missing object: the same
    with pytest.warns(RuntimeWarning, match="missing"):
        assert int(CheckpointManager(url).restore()["step"]) == 1


def test_marker_last_and_uncommitted_steps_do_not_count(bucket, s3):
    url = f"s3://{bucket}/ck"
    m = CheckpointManager(url, async_save=False)
    m.save(make_state(1))
    m.save(make_state(2))
    s3.delete_object(Bucket=bucket, Key="ck/step_00000002/COMMITTED")  # a kill before it
    fresh = CheckpointManager(url)
    assert fresh.all_steps() == [1]
    assert "no such" in " ".join(fresh.invalid_steps().values()).lower() or fresh.invalid_steps()
    # redoing step 2 replaces the partial upload (no marker: nothing committed is lost)
    fresh.save(make_state(2))
    fresh.wait()
    assert CheckpointManager(url).all_steps() == [1, 2]
    assert not CheckpointManager(url).set_aside_steps()


def test_redoing_a_committed_step_keeps_the_old_one_aside(bucket, s3):
    url = f"s3://{bucket}/ck"
    CheckpointManager(url, async_save=False).save(make_state(2, seed=1))
    m = CheckpointManager(url, async_save=False)
    m.save(make_state(2, seed=2))  # not written nor restored by this manager: redone
    (aside,) = m.set_aside_steps()[2]
    assert ".replaced-" in aside.name
    assert first_difference(m.restore(2), make_state(2, seed=2)) is None
    assert objects(s3, bucket, f"ck/{aside.key}/COMMITTED")  # the old commit, intact


def test_two_writers_cannot_both_commit_a_step(bucket):
    root = parse_location(f"s3://{bucket}/ck")
    root.put_new("step_00000005/COMMITTED", b'{"time": 1}')
    with pytest.raises(FileExistsError, match="another writer"):
        root.put_new("step_00000005/COMMITTED", b'{"time": 2}')
    # a put retried after its reply was lost finds its own bytes there: it committed
    root.put_new("step_00000005/COMMITTED", b'{"time": 1}')
    assert root.get("step_00000005/COMMITTED") == b'{"time": 1}'


def test_a_second_writer_of_a_step_cannot_unseal_the_first_ones_commit(bucket, monkeypatch):
    """Writer A uploads step 3's chunks; meanwhile B (a restarted trainer) commits step 3
    and its retention deletes step 2. A's manifest put came after B's commit and replaced
    B's manifest: B's marker sealed it no more, and no step was left to restore. Now A's
    save fails and B's step 3 stays committed."""
    from ftrain.ckpt import commit as protocol

    url = f"s3://{bucket}/ck"
    a = CheckpointManager(url, async_save=False, keep_policy=LatestN(1))
    a.save(make_state(1))
    a.save(make_state(2))
    fired = []

    def other_writer_commits(phase):
        if phase == "data_written" and not fired:
            fired.append(phase)
            b = CheckpointManager(url, async_save=False, keep_policy=LatestN(1))
            b.restore()
            assert b.save(make_state(3, seed=100)) and b.all_steps() == [3]

    monkeypatch.setattr(protocol, "fault_hook", other_writer_commits)
    with pytest.raises(Exception, match="manifest.json already exists: another writer"):
        a.save(make_state(3))
    monkeypatch.setattr(protocol, "fault_hook", None)
    fresh = CheckpointManager(url, async_save=False)
    assert fresh.all_steps() == [3] and not fresh.invalid_steps()
    assert first_difference(fresh.restore(3), make_state(3, seed=100)) is None


def test_the_loser_of_a_commit_race_deletes_nothing_and_skips_its_fallback(
    bucket, monkeypatch, tmp_path
):
    """B has put step 3's manifest and not yet its marker when A's create-only manifest
    put loses. A's abort deleted every object under the prefix (B's chunks and manifest):
    B's marker then sealed a step with nothing in it. And A's lost put (an OSError) sent
    A's save to its fallback, whose commit set B's step aside. Now A deletes nothing, does
    not try the fallback, and says why; B's step 3 restores."""
    import threading

    from ftrain.ckpt import CheckpointSaveError
    from ftrain.ckpt import commit as protocol

    url = f"s3://{bucket}/ck"
    CheckpointManager(url, async_save=False).save(make_state(2))
    a = CheckpointManager(url, async_save=False, fallback_directory=tmp_path / "fallback")
    b = CheckpointManager(url, async_save=False)
    a.restore()
    b.restore()
    a_ready, b_manifest_in, a_result = threading.Event(), threading.Event(), {}

    def interleave(phase):
        if threading.current_thread().name == "A" and phase == "data_written":
            a_ready.set()
            assert b_manifest_in.wait(60)
        elif threading.current_thread().name != "A" and phase == "manifest_written":
            b_manifest_in.set()
            thread.join(60)  # A loses its put and gives up before B's marker goes in

    def save_a():
        try:
            a_result["saved"] = a.save(make_state(3))
        except Exception as e:  # noqa: BLE001 - the test checks it
            a_result["error"] = e

    monkeypatch.setattr(protocol, "fault_hook", interleave)
    thread = threading.Thread(target=save_a, name="A")
    thread.start()
    assert a_ready.wait(60)
    assert b.save(make_state(3, seed=100))
    monkeypatch.setattr(protocol, "fault_hook", None)
    error = a_result.get("error")
    assert isinstance(error, CheckpointSaveError), a_result
    assert "lost to another writer" in str(error) and "nothing was moved aside" in str(error)
    assert not (tmp_path / "fallback").exists() or not list((tmp_path / "fallback").iterdir())
    fresh = CheckpointManager(url, async_save=False)
    assert fresh.all_steps() == [2, 3] and not fresh.invalid_steps()
    assert first_difference(fresh.restore(3), make_state(3, seed=100)) is None


def test_an_archived_step_is_invalid_and_the_others_still_restore(bucket, s3):
    """A lifecycle rule moved the oldest step to GLACIER (its GETs answer InvalidObjectState):
    every restart failed listing the location, naming no step. Now that step is listed as
    invalid with the reason; archived all, the store's error is raised (never a fresh start
    over steps that could not be read)."""
    url = f"s3://{bucket}/ck"
    m = CheckpointManager(url, async_save=False)
    for step in (1, 2, 3):
        m.save(make_state(step))

    def archive(step):
        for k in objects(s3, bucket, f"ck/step_{step:08d}/"):
            src = {"Bucket": bucket, "Key": k}
            s3.copy_object(Bucket=bucket, Key=k, CopySource=src, StorageClass="GLACIER")

    archive(1)
    fresh = CheckpointManager(url, async_save=False)
    assert fresh.all_steps() == [2, 3]
    (why,) = [v for k, v in fresh.invalid_steps().items() if str(k).endswith("step_00000001")]
    assert "InvalidObjectState" in why and "lifecycle rule" in why
    assert first_difference(fresh.restore(), make_state(3)) is None
    archive(2)
    archive(3)
    with pytest.raises(CheckpointStoreError, match="InvalidObjectState"):
        CheckpointManager(url, async_save=False)


def test_retention_on_the_bucket(bucket, s3):
    url = f"s3://{bucket}/ck"
    with CheckpointManager(url, keep_policy=LatestN(2)) as m:
        for step in range(1, 6):
            m.save(make_state(step))
    assert CheckpointManager(url).all_steps() == [4, 5]
    steps = {k.split("/")[1] for k in objects(s3, bucket, "ck/") if k.count("/") > 1}
    assert steps == {"step_00000004", "step_00000005"}  # nothing left of deleted steps
    index = json.loads(objects(s3, bucket, "ck/checkpoints.json")["ck/checkpoints.json"])
    assert [e["step"] for e in index["entries"]] == [4, 5]


def test_sweep_removes_dead_uploads_older_than_the_newest_commit(bucket, s3, monkeypatch):
    url = f"s3://{bucket}/ck"
    s3.put_object(Bucket=bucket, Key="ck/step_00000001/params/w/c.0.0", Body=b"dead")
    s3.put_object(Bucket=bucket, Key="ck/step_00000009/params/w/c.0.0", Body=b"maybe live")
    time.sleep(1.1)  # S3 times have one-second resolution
    CheckpointManager(url, async_save=False).save(make_state(2))
    monkeypatch.setattr(objstore_mod, "SWEEP_MIN_AGE_S", 0.0)
    CheckpointManager(url)
    keys = objects(s3, bucket, "ck/")
    assert not any(k.startswith("ck/step_00000001/") for k in keys)  # older: swept
    assert "ck/step_00000009/params/w/c.0.0" in keys  # newer than the commit: kept


def test_missing_bucket_and_bad_credentials_are_clear_errors(s3_server, bucket, monkeypatch):
    with pytest.raises(CheckpointStoreError, match="no-such-bucket-here.*NoSuchBucket"):
        CheckpointManager("s3://no-such-bucket-here/ck")
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto checks keys
    with pytest.raises(CheckpointStoreError, match=f"{bucket}.*InvalidAccessKeyId"):
        CheckpointManager(f"s3://{bucket}/ck")


def test_a_fallback_naming_the_primary_or_an_endpoint_without_scheme_is_refused(
    bucket, monkeypatch
):
    """s3a://B/ck as the fallback of s3://B/ck: every commit set its "other copy" (itself)
    aside, so save() returned True and nothing stayed listed. An endpoint written host:port
    made obstore's client panic (a Rust backtrace, exit 1)."""
    with pytest.raises(CheckpointLocationError, match="under another spelling"):
        CheckpointManager(f"s3://{bucket}/ck", fallback_directory=f"s3a://{bucket}/ck/")
    CheckpointManager(f"s3://{bucket}/ck", fallback_directory=f"s3://{bucket}/ck2")  # fine
    port = os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"127.0.0.1:{port}")
    with pytest.raises(CheckpointLocationError, match=f"AWS_ENDPOINT_URL='127.0.0.1:{port}'"):
        CheckpointManager(f"s3://{bucket}/ck")
    with pytest.raises(CheckpointLocationError, match="checkpoint.storage.endpoint='localhost"):
        parse_location(f"s3://{bucket}/ck", {"endpoint": "localhost:9000"})
    # a valid option wins over the bad variable
    parse_location(f"s3://{bucket}/ck", {"endpoint": f"http://127.0.0.1:{port}"}).probe()


@pytest.mark.parametrize(
    "value", ["s3:/bucket/ck", "s3:bucket", "ftp://host/ck", "http://host/ck", "s3:///ck"]
)
def test_unknown_schemes_and_url_like_paths_are_refused(value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointLocationError, match="s3://|scheme|bucket"):
        CheckpointManager(value)
    assert not any(tmp_path.iterdir()), "no local directory may be created"


def test_plain_zarr_reads_a_committed_step(bucket):
    url = f"s3://{bucket}/ck"
    state = make_state(4)
    CheckpointManager(url, async_save=False, chunk_bytes=1024).save(state)
    store = ObjectStore(obstore.store.from_url(url), read_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warning-free: the root consolidates the hierarchy
        group = zarr.open_group(store=store, path="step_00000004", mode="r")
        assert "params/f8" in dict(group.members(max_depth=None))
        w = group["params/w"][...]
        h = group["params/h"][...]  # the bfloat16 data type (registered by importing ftrain)
    assert (w == state["params", "w"].numpy()).all()
    assert h.dtype == ml_dtypes.bfloat16
    assert (h.view(np.uint16) == state["params", "h"].view(torch.uint16).numpy()).all()
    assert group["params/h"].attrs["ftrain"]["dtype"] == "bfloat16"
    assert group.attrs["step"] == 4


def test_tensorstore_reads_a_committed_step_through_its_s3_kvstore(bucket, s3_server):
    ts = pytest.importorskip("tensorstore")
    url = f"s3://{bucket}/ck"
    state = make_state(4)
    CheckpointManager(url, async_save=False, chunk_bytes=1024).save(state)  # 5 chunks of w
    for key in ("params/w", "params/half", "params/h", "params/f8", "mask", "opt/count"):
        kvstore = {
            "driver": "s3",
            "bucket": bucket,
            "path": f"ck/step_00000004/{key}/",
            "endpoint": s3_server["endpoint"],
            "aws_region": "us-east-1",
            "aws_credentials": {"type": "environment"},
        }
        got = ts.open({"driver": "zarr3", "kvstore": kvstore}, read=True).result().read().result()
        want = state[tuple(key.split("/"))]
        if want.dtype in (torch.bfloat16, torch.float8_e4m3fn):  # tensorstore's own bf16/f8
            assert got.dtype.name == str(want.dtype).removeprefix("torch."), key
            got, want = got.astype("float32"), want.float()
        assert (got == want.numpy()).all(), key


def test_the_ckpt_tool_on_a_bucket(bucket, s3, capsys):
    from ftrain.ckpt.__main__ import main

    url = f"s3://{bucket}/ck"
    m = CheckpointManager(url, async_save=False, chunk_bytes=1024)
    m.save(make_state(1))
    m.save(make_state(2))
    assert main(["list", url]) == 0
    assert main(["verify", url]) == 0
    assert "bytes verified" in capsys.readouterr().out
    doc = "ck/step_00000002/params/w/zarr.json"
    s3.put_object(Bucket=bucket, Key=doc, Body=b'{"shape": [1]}')  # restore trusts the manifest
    assert main(["verify", url, "2"]) == 1
    assert "BAD  step 2" in capsys.readouterr().out
    assert main(["diff", url, "1", "2"]) == 1
    assert main(["list", "s3://no-such-bucket-x/ck"]) == 2
    assert "NoSuchBucket" in capsys.readouterr().err
    # a retention delete that removed the marker but not the rest (a store failing
    # mid-delete): verify said BAD ("metadata is missing") and exited 1 for 10 minutes,
    # though nothing committed was damaged; a marker-less prefix on a store is "left"
    m.save(make_state(3))
    s3.delete_object(Bucket=bucket, Key="ck/step_00000001/COMMITTED")
    assert main(["verify", url, "3"]) == 0  # a named step: only it
    capsys.readouterr()
    s3.put_object(Bucket=bucket, Key=doc, Body=objects(s3, bucket, "ck/step_00000003/")[
        "ck/step_00000003/params/w/zarr.json"])  # fmt: skip
    rc, out = main(["verify", url]), capsys.readouterr().out
    assert "left step_00000001: s3://" in out and "no COMMITTED marker: a save or a" in out, out
    assert "metadata is missing" not in out and rc == 0, out
    assert main(["list", url]) == 0


def test_verify_beside_retention_on_a_bucket_calls_a_step_deleted_under_it_gone(
    bucket, s3, monkeypatch, capsys
):
    """Retention on a store deletes a step's marker first, then its other objects: a
    verify reading it meanwhile listed it again marker-less and said BAD (exit 1 on every
    retention cycle of a live run's bucket)."""
    from ftrain.ckpt import __main__ as cli

    url = f"s3://{bucket}/ck"
    m = CheckpointManager(url, async_save=False, chunk_bytes=1024)
    for step in (1, 2):
        m.save(make_state(step))
    real = cli.verify_tree

    def retention_under_way(path, manifest):
        if path.name == "step_00000001":  # the marker gone, then the first document
            s3.delete_object(Bucket=bucket, Key="ck/step_00000001/COMMITTED")
            s3.delete_object(Bucket=bucket, Key="ck/step_00000001/params/w/zarr.json")
        return real(path, manifest)

    monkeypatch.setattr(cli, "verify_tree", retention_under_way)
    rc, out = cli.main(["verify", url]), capsys.readouterr().out
    assert rc == 0 and "gone step 1: deleted while verifying" in out, out


def test_a_key_past_the_stores_1024_bytes_is_refused_before_any_upload(bucket, s3):
    """S3, GCS and Azure take keys of at most 1,024 bytes (moto takes longer ones): a
    960-character prefix trained, and on a real store every save would have failed at its
    first upload."""
    from ftrain.ckpt.store import check_key_lengths

    url = f"s3://{bucket}/" + "p" * 960
    m = CheckpointManager(url, async_save=False)
    with pytest.raises(ValueError, match=r"needs an object key of about \d+ bytes.*at most 1024"):
        m.save(make_state(1))
    assert not objects(s3, bucket), "nothing uploaded"
    check_key_lengths(f"s3://{bucket}/" + "p" * 900, {"params/w": make_state(1)["params", "w"]})


def test_a_failed_uploads_cleanup_uses_the_quick_retries(bucket, s3, monkeypatch):
    """In an outage the cleanup of a failed upload retried for minutes itself before the
    save could go to the fallback location."""
    from ftrain.ckpt.objstore import ObjectRoot

    root = ObjectRoot.open(f"s3://{bucket}/ck")
    s3.put_object(Bucket=bucket, Key="ck/step_00000001/params/w/c.0", Body=b"part")
    stores, real = [], ObjectRoot.list
    monkeypatch.setattr(
        ObjectRoot, "list", lambda self, p: stores.append(self.store) or real(self, p)
    )
    root.abort_step(root / "step_00000001")
    assert stores == [root.probe_store] and root.probe_store is not root.store
    assert not objects(s3, bucket, "ck/step_00000001/"), "the partial upload is gone"


def test_an_s3_fallback_takes_saves_when_the_local_primary_fails(bucket, tmp_path, monkeypatch):
    from ftrain.ckpt import manager

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(manager, "write_tree", full)
    url = f"s3://{bucket}/fallback"
    m = CheckpointManager(tmp_path / "primary", fallback_directory=url, async_save=False)
    with pytest.warns(RuntimeWarning, match="fallback"):
        m.save(make_state(1))
    monkeypatch.undo()
    m.save(make_state(2))  # the primary works again
    assert m.all_steps() == [1, 2]
    assert str(m.metadata(1)["path"]).startswith(url)
    assert (
        first_difference(
            CheckpointManager(tmp_path / "primary", fallback_directory=url).restore(1),
            make_state(1),
        )
        is None
    )


def test_large_chunks_go_up_in_multipart_uploads(bucket):
    """A 12 MiB chunk (obstore switches to multipart above 5 MiB) round-trips."""
    url = f"s3://{bucket}/big"
    state = TensorDict({"step": torch.tensor(7), "w": torch.randn(3 << 20)}, batch_size=[])
    CheckpointManager(url, async_save=False).save(state)
    assert first_difference(CheckpointManager(url).restore(), state) is None


def _one_step_kept_of(bucket) -> tuple[str, CheckpointManager]:
    """A manager keeping one step, step 1 saved: the next save's retention deletes it."""
    url = f"s3://{bucket}/ck"
    m = CheckpointManager(url, async_save=False, keep_policy=LatestN(1))
    m.save(make_state(1))
    time.sleep(1.1)  # S3 times have one-second resolution: step 1 is older than step 2
    return url, m


def test_retention_deletes_the_marker_first(bucket, s3, monkeypatch):
    """A retention delete interrupted right after the marker went: the step is no longer
    listed (never half a checkpoint), and its leftovers are swept at a later start."""
    from ftrain.ckpt import commit as protocol

    url, m = _one_step_kept_of(bucket)

    def crash(phase):
        if phase == "delete_marker_removed":
            raise KeyboardInterrupt("killed mid-delete")

    monkeypatch.setattr(protocol, "fault_hook", crash)
    with pytest.raises(KeyboardInterrupt):
        m.save(make_state(2))
    monkeypatch.setattr(protocol, "fault_hook", None)
    keys = objects(s3, bucket, "ck/step_00000001/")
    assert keys and "ck/step_00000001/COMMITTED" not in keys  # data left, marker gone
    monkeypatch.setattr(objstore_mod, "SWEEP_MIN_AGE_S", 0.0)
    fresh = CheckpointManager(url)
    assert fresh.all_steps() == [2]
    assert not objects(s3, bucket, "ck/step_00000001/")  # swept: older than the commit


def test_a_retention_delete_failing_after_the_marker_is_a_delete_not_a_kept_step(
    bucket, s3, monkeypatch, caplog
):
    """The store failing once the marker was gone: the log said "could not be deleted by
    keep policy; kept" and the index went on listing a step that was no longer committed."""
    from ftrain.ckpt import commit as protocol
    from ftrain.ckpt.location import CheckpointStoreError

    url, m = _one_step_kept_of(bucket)

    def store_fails(phase):
        if phase == "delete_marker_removed":
            monkeypatch.setattr(objstore_mod.ObjectRoot, "delete", failing)

    def failing(self, keys):
        raise CheckpointStoreError(f"{url}: simulated: connection reset")

    monkeypatch.setattr(protocol, "fault_hook", store_fails)
    with caplog.at_level("INFO", logger="ftrain.ckpt"):
        m.save(make_state(2))  # the save commits; retention's leftovers are a warning
    monkeypatch.undo()
    said = " ".join(r.getMessage() for r in caplog.records if r.name == "ftrain.ckpt")
    assert "deleted (its marker is gone), but some of its objects were not" in said, said
    assert "kept" not in said
    assert m.all_steps() == [2] and CheckpointManager(url).all_steps() == [2]
    assert "ck/step_00000001/COMMITTED" not in objects(s3, bucket, "ck/step_00000001/")
    monkeypatch.setattr(objstore_mod, "SWEEP_MIN_AGE_S", 0.0)
    CheckpointManager(url).all_steps()  # a later start sweeps the leftovers
    assert not objects(s3, bucket, "ck/step_00000001/")


def test_throttled_and_failing_requests_are_retried(bucket, flaky_endpoint):
    """503 SlowDown on some uploads and downloads: obstore retries with backoff, the save
    commits and the restore is bit-exact."""
    url = f"s3://{bucket}/ck"
    m = CheckpointManager(url, async_save=False, chunk_bytes=1024)
    flaky_endpoint["fail"] |= {flaky_endpoint["seen"] + n for n in (3, 4, 9, 20, 40)}
    m.save(make_state(1))
    flaky_endpoint["fail"] |= {flaky_endpoint["seen"] + n for n in (2, 5, 11)}
    assert first_difference(CheckpointManager(url).restore(), make_state(1)) is None
    assert len(flaky_endpoint["refused"]) == 8, flaky_endpoint["refused"]


def test_a_failed_rewrite_of_a_committed_step_puts_it_back(bucket, monkeypatch):
    """On an object store a committed step is moved aside before its rewrite is uploaded
    (no staging directory): a rewrite that failed left the step unlisted, and restore
    went back to an older one. The step is put back in place."""
    from ftrain.ckpt import CheckpointSaveError, objio

    url = f"s3://{bucket}/ck"
    with CheckpointManager(url, async_save=False, chunk_bytes=1024) as m:
        m.save(make_state(1), force=True)
        m.save(make_state(2), force=True)

    def refused(*a, **k):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(objio, "_chunk_object", refused)
    redo = CheckpointManager(url, async_save=False, chunk_bytes=1024)
    with pytest.raises(CheckpointSaveError):
        redo.save(make_state(2, seed=1), force=True)
    monkeypatch.undo()
    again = CheckpointManager(url)
    assert again.all_steps() == [1, 2] and not again.set_aside_steps()
    assert first_difference(again.restore(), make_state(2)) is None


def test_a_rewrite_interrupted_after_its_marker_is_not_put_back_over(bucket, monkeypatch):
    """An interrupt after the new marker landed: the new step did commit, and putting the
    old one back would copy its objects over a listed step."""
    from ftrain.ckpt import commit as protocol

    url = f"s3://{bucket}/ck"
    with CheckpointManager(url, async_save=False, chunk_bytes=1024) as m:
        m.save(make_state(2), force=True)

    def interrupted(phase):
        if phase == "marker_written":
            raise KeyboardInterrupt

    monkeypatch.setattr(protocol, "fault_hook", interrupted)
    redo = CheckpointManager(url, async_save=False, chunk_bytes=1024)
    with pytest.raises(KeyboardInterrupt):
        redo.save(make_state(2, seed=1), force=True)
    monkeypatch.undo()
    again = CheckpointManager(url)
    assert again.all_steps() == [2] and list(again.set_aside_steps()) == [2]
    assert first_difference(again.restore(), make_state(2, seed=1)) is None


def test_a_short_download_is_fetched_again_and_never_taken_for_corruption(bucket, flaky_endpoint):
    """A GET whose body came short (a proxy, a cut connection) made an intact step
    "corrupt": restore fell back to an older one and the next save set the intact step
    aside. Fetched again; short twice, the restore stops with CheckpointStoreError, every
    step as it was."""
    url = f"s3://{bucket}/ck"
    m = CheckpointManager(url, async_save=False, chunk_bytes=1024)
    m.save(make_state(1), force=True)
    m.save(make_state(2), force=True)
    flaky_endpoint["truncate"]["step_00000002/params/w/c.1.0"] = 1
    assert first_difference(CheckpointManager(url).restore(), make_state(2)) is None
    flaky_endpoint["truncate"]["step_00000002/params/w/c.1.0"] = 2
    with pytest.raises(CheckpointStoreError, match="a transfer fault, not the checkpoint's"):
        CheckpointManager(url).restore()
    again = CheckpointManager(url)
    assert again.all_steps() == [1, 2]
    assert first_difference(again.restore(), make_state(2)) is None


def test_a_save_rides_out_a_store_outage_and_a_wrong_setting_is_said_in_seconds(
    bucket, flaky_endpoint
):
    """Every request refused for 12 s (an outage): the retries gave up after 1.5-7 s
    (object_store's jittered waits hardly grew at base 2) and the save failed, though the
    docs promised minutes. Now the save waits it out and commits. The start's listing of a
    store that stays down still fails within seconds (its own quick retries)."""
    url = f"s3://{bucket}/ck"
    m = CheckpointManager(url, async_save=False, chunk_bytes=1024)
    t0 = time.monotonic()
    flaky_endpoint["down_until"] = t0 + 12
    assert m.save(make_state(1))
    assert time.monotonic() - t0 >= 12 and m.all_steps() == [1]
    flaky_endpoint["down_until"] = time.monotonic() + 600
    t0 = time.monotonic()
    with pytest.raises(CheckpointStoreError, match="SlowDown|503"):
        CheckpointManager(f"s3://{bucket}/other", async_save=False)
    assert time.monotonic() - t0 < 30
    flaky_endpoint["down_until"] = 0.0


def test_damaged_objects_restore_exactly_or_raise_ftrains_error(bucket, s3):
    """Any one object of a step flipped, truncated, extended or deleted: restore returns
    the exact state (the damage was outside what restore trusts, e.g. an array's zarr.json)
    or ftrain's own error, never wrong data or a foreign exception."""
    import random

    from ftrain.ckpt import CheckpointNotFoundError

    url = f"s3://{bucket}/ck"
    CheckpointManager(url, async_save=False, chunk_bytes=1024, compression="zstd:1").save(
        make_state(1)
    )
    pristine = objects(s3, bucket, "ck/step_00000001/")
    rng = random.Random(12)
    keys = sorted(pristine)
    for trial in range(24):
        key = keys[trial] if trial < 6 else rng.choice(keys)  # root documents first
        raw = bytearray(pristine[key])
        how = ("flip", "truncate", "extend", "delete")[trial % 4]
        if how == "flip":
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        elif how == "truncate":
            del raw[rng.randrange(len(raw)) :]
        elif how == "extend":
            raw += b"\x00"
        if how == "delete":
            s3.delete_object(Bucket=bucket, Key=key)
        else:
            s3.put_object(Bucket=bucket, Key=key, Body=bytes(raw))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                got = CheckpointManager(url).restore()
                assert first_difference(got, make_state(1)) is None, (key, how)
            except CheckpointNotFoundError:
                pass
        s3.put_object(Bucket=bucket, Key=key, Body=pristine[key])


def test_ranks_upload_their_own_chunks_and_the_coordinator_commits(bucket):
    """The multi-rank seam on object storage: rank k uploads chunks i % 2 == k (rank 0 the
    documents too), the coordinator merges the manifests and puts manifest, then marker."""
    from ftrain.ckpt import commit as protocol
    from ftrain.ckpt.format import json_bytes
    from ftrain.ckpt.store import merge_manifests

    state, attrs = make_state(8), {"format_version": 1, "step": 8, "time": 0.0}
    root = parse_location(f"s3://{bucket}/ck")
    step = root / "step_00000008"
    parts = [upload_tree(step, state, attrs, 512, None, rank=r, world=2) for r in (1, 0)]
    manifest = dict(merge_manifests([parts[1], parts[0]]), step=8)
    raw = json_bytes(manifest)
    root.put(f"{step.key}/manifest.json", raw)
    root.put_new(f"{step.key}/COMMITTED", json_bytes(protocol.marker_document(8, raw)))
    assert first_difference(CheckpointManager(root.url).restore(), state) is None


def test_a_mapped_restore_from_an_object_store_is_refused_naming_the_fix(bucket):
    url = f"s3://{bucket}/run/mapped"
    m = CheckpointManager(url)
    assert m.save(make_state(1))
    m.close()
    with pytest.raises(ValueError, match="object store: leave mmap at False"):
        CheckpointManager(url).restore(mmap=True)


def test_a_kill_during_a_go_backs_set_aside_on_s3_leaves_none_of_the_old_history_listed(
    bucket, monkeypatch
):
    """resume to 2 over 2, 4, 6, then the first save sets 6 and 4 aside, a copy and a
    delete per object each: a kill after the first left the old 4 listed and a plain
    restart resumed the abandoned history. The journal object names them first."""
    from ftrain.ckpt import aside
    from ftrain.ckpt import commit as protocol

    url = f"s3://{bucket}/ck"
    with CheckpointManager(url, async_save=False, chunk_bytes=1024) as m:
        for s in (2, 4, 6):
            m.save(make_state(s), force=True)
    back = CheckpointManager(url, async_save=False, chunk_bytes=1024)
    back.restore(2)
    calls = []

    def killed_after_one(phase):
        if phase == "delete_marker_removed":  # 6's marker deleted, 4 not touched yet
            calls.append(phase)
            raise KeyboardInterrupt("SIGKILL stand-in")

    monkeypatch.setattr(protocol, "fault_hook", killed_after_one)
    with pytest.raises((KeyboardInterrupt, CheckpointSaveError)):
        back.save(make_state(3), force=True)
    monkeypatch.undo()
    again = CheckpointManager(url, async_save=False, chunk_bytes=1024)
    assert again.all_steps() == [2], "no step of the old history is listed"
    assert any("its move aside was cut short" in why for why in again.invalid_steps().values())
    assert first_difference(again.restore(), make_state(2)) is None
    assert again.save(make_state(3), force=True)
    assert again.all_steps() == [2, 3] and aside.pending(again.directory) == {}
    assert sorted(again.set_aside_steps()) == [4, 6]
