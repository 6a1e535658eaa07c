"""Incremental checkpoints on S3 (the moto server of conftest): unchanged leaves are
server-side copies of the previous step's objects, so every step owns all its objects and
deleting an older one never breaks a newer one."""

import obstore
import pytest

from ftrain.ckpt import CheckpointManager, LatestN, objio
from ftrain.ckpt import commit as protocol
from tests.unit.test_ckpt_incremental import CHUNK, frozen_base, same, state_at

from .conftest import objects

BASE_CHUNKS = 7  # chunk objects of frozen_base() at CHUNK bytes


@pytest.fixture
def requests(monkeypatch):
    """Counts of chunk objects uploaded (encoded here) and server-side copies."""
    seen = {"uploads": 0, "copies": 0}
    encode, copy = objio._chunk_object, obstore.copy_async

    def counted_encode(*a, **k):
        seen["uploads"] += 1
        return encode(*a, **k)

    async def counted_copy(*a, **k):
        seen["copies"] += 1
        return await copy(*a, **k)

    monkeypatch.setattr(objio, "_chunk_object", counted_encode)
    monkeypatch.setattr(obstore, "copy_async", counted_copy)
    return seen


def verify_ok(url: str, *steps: int) -> None:
    from ftrain.ckpt.__main__ import main

    assert main(["verify", url, *map(str, steps)]) == 0


@pytest.mark.parametrize("async_save", [False, True])
def test_second_save_copies_unchanged_chunks_server_side(bucket, s3, requests, async_save):
    url = f"s3://{bucket}/run/ckpt"
    base = frozen_base()
    s1, s2, s3_ = state_at(1, base), state_at(2, base), state_at(3, base)
    m = CheckpointManager(url, chunk_bytes=CHUNK, async_save=async_save, keep_policy=LatestN(1))
    m.save(s1)
    m.wait()
    first = dict(requests)
    old = objects(s3, bucket, "run/ckpt/step_00000001/params/base/")
    m.save(s2)
    m.wait()
    assert requests["copies"] - first["copies"] == BASE_CHUNKS
    assert requests["uploads"] - first["uploads"] == first["uploads"] - BASE_CHUNKS
    new = objects(s3, bucket, "run/ckpt/step_00000002/params/base/")
    assert len(old) == len(new) and all(
        new[k.replace("step_00000001", "step_00000002")] == v for k, v in old.items()
    )
    save = m.metadata(2)["save"]
    assert save["linked_bytes"] == sum(len(v) for k, v in new.items() if "/c." in k)
    assert save["written_bytes"] == save["bytes"] - save["linked_bytes"]
    # LatestN(1) deleted step 1: step 2 owns every object it lists
    assert m.all_steps() == [2] and not objects(s3, bucket, "run/ckpt/step_00000001/")
    assert same(CheckpointManager(url).restore(2), s2)
    verify_ok(url)
    m.save(s3_)  # copies from step 2, which retention then deletes
    m.close()
    assert CheckpointManager(url).all_steps() == [3]
    assert same(CheckpointManager(url).restore(3), s3_)
    verify_ok(url)


def test_a_copy_that_fails_is_uploaded_instead(bucket, s3, requests):
    url = f"s3://{bucket}/run/ckpt"
    base = frozen_base()
    s2 = state_at(2, base)
    m = CheckpointManager(url, chunk_bytes=CHUNK, async_save=False)
    m.save(state_at(1, base))
    gone = [k for k in objects(s3, bucket, "run/ckpt/step_00000001/params/base/wte/") if "/c." in k]
    for key in gone:  # the source objects vanish (a lifecycle rule, another tool)
        s3.delete_object(Bucket=bucket, Key=key)
    m.save(s2)
    assert same(m.restore(2), s2)
    verify_ok(url, 2)
    wte = sum(
        len(v)
        for k, v in objects(s3, bucket, "run/ckpt/step_00000002/params/base/wte/").items()
        if "/c." in k
    )
    save = m.metadata(2)["save"]
    assert save["linked_bytes"] > 0 and save["written_bytes"] >= wte


def test_a_source_object_of_another_size_is_uploaded_not_copied(bucket, s3, requests):
    """A source chunk replaced after its commit (truncated, overwritten by another tool):
    the server-side copy took it as it was and the save reported success, then retention
    deleted the source's step and the newest step could not be restored. The local link
    checks the size first; so does the copy now, uploading from memory instead."""
    url = f"s3://{bucket}/run/ckpt"
    base = frozen_base()
    s2 = state_at(2, base)
    m = CheckpointManager(url, chunk_bytes=CHUNK, async_save=False, keep_policy=LatestN(1))
    m.save(state_at(1, base))
    chunks = objects(s3, bucket, "run/ckpt/step_00000001/params/base/wte/")
    key = next(k for k in chunks if "/c." in k)
    s3.put_object(Bucket=bucket, Key=key, Body=b"short")
    m.save(s2)
    m.close()
    assert CheckpointManager(url).all_steps() == [2]  # step 1 deleted by retention
    assert same(CheckpointManager(url).restore(2), s2)
    verify_ok(url, 2)


def test_a_damaged_source_object_of_the_same_size_is_not_copied_forward(bucket, s3):
    """One flipped byte in a chunk object every step shares (the frozen base): each later
    save copied it server-side under its old crc32c and said it succeeded, retention
    deleted the older steps, and no step restored. The audited chunks (every chunk within
    an audit cycle) are read whole before their copy; a damaged one is uploaded from
    memory and said."""
    url = f"s3://{bucket}/run/ckpt"
    base = frozen_base()
    m = CheckpointManager(url, chunk_bytes=CHUNK, async_save=False, keep_policy=LatestN(2))
    m.save(state_at(1, base))
    chunks = objects(s3, bucket, "run/ckpt/step_00000001/params/base/wte/")
    key, body = next((k, v) for k, v in chunks.items() if "/c." in k)
    s3.put_object(Bucket=bucket, Key=key, Body=body[:100] + bytes([body[100] ^ 1]) + body[101:])
    for step in range(2, 2 + 3 * BASE_CHUNKS):  # past one audit cycle of the base's chunks
        m.save(state_at(step, base))
    m.close()
    newest = 1 + 3 * BASE_CHUNKS
    again = CheckpointManager(url)
    assert again.all_steps() == [newest - 1, newest]
    assert same(again.restore(), state_at(newest, base))
    verify_ok(url, newest)


def test_a_local_previous_step_is_not_copied_to_the_bucket(bucket, tmp_path, monkeypatch):
    """The previous step on local disk, this save going to an S3 fallback: uploaded."""
    url = f"s3://{bucket}/fb"
    base = frozen_base()
    primary = tmp_path / "ckpt"
    m = CheckpointManager(primary, fallback_directory=url, chunk_bytes=CHUNK, async_save=False)
    m.save(state_at(1, base))
    real = protocol.begin

    def begin(root, step):
        if root == primary:
            raise OSError(28, "No space left on device", str(root))
        return real(root, step)

    monkeypatch.setattr(protocol, "begin", begin)
    with pytest.warns(RuntimeWarning, match="saving to fallback"):
        m.save(state_at(2, base))
    assert m.metadata(2)["save"]["linked_bytes"] == 0
    assert same(CheckpointManager(url).restore(2), state_at(2, base))


def test_a_source_step_another_writer_replaced_is_uploaded_not_copied(bucket, s3, requests):
    """Another manager redid step 1 on the prefix (same object sizes, other bytes): the
    server-side copy took its objects under this manager's crc32c and committed a corrupt
    step 2. The source's sealed manifest is read first now."""
    url = f"s3://{bucket}/run/ckpt"
    base = frozen_base()
    a = CheckpointManager(url, chunk_bytes=CHUNK, async_save=False)
    a.save(state_at(1, base))
    other = state_at(1, frozen_base(seed=5))
    CheckpointManager(url, chunk_bytes=CHUNK, async_save=False).save(other, force=True)
    s2 = state_at(2, base)
    copies = requests["copies"]
    a.save(s2)
    a.close()
    assert requests["copies"] == copies  # nothing copied from the replaced step
    m = CheckpointManager(url)
    assert same(m.restore(2), s2) and same(m.restore(1), other)
    verify_ok(url, 1, 2)
