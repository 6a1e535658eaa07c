"""``restore(mmap=True)``: single-chunk arrays mapped copy-on-write, every chunk verified,
bit-exact, writable without touching the files, alive after the step is deleted, and a
state that trains exactly like a plainly restored one."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import ftrain
from ftrain.ckpt import CheckpointManager, CheckpointNotFoundError
from ftrain.ckpt.commit import read_committed
from ftrain.ckpt.mapped import mappable
from ftrain.ckpt.store import specs_of
from ftrain.state import first_difference


def make_state(step: int) -> TensorDict:
    g = torch.Generator().manual_seed(step)
    return TensorDict(
        {
            "step": torch.tensor(step),
            "params": {
                "big": torch.randn(512, 256, generator=g),  # 512 KiB, one chunk: mapped
                "wide": torch.randn(4096, 96, generator=g),  # 1.5 MiB > chunk_bytes: read
                "half": torch.randn(512, 512, generator=g).bfloat16(),  # mapped, bf16
                "small": torch.randn(7, generator=g),  # read
            },
            "mask": torch.rand(1024, 512, generator=g) > 0.5,  # bool, mapped
        },
        batch_size=[],
    )


def save_steps(directory: Path, *steps: int) -> CheckpointManager:
    m = CheckpointManager(directory, async_save=False, chunk_bytes=1 << 20)
    for s in steps:
        m.save(make_state(s))
    return m


def mapped_files() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if len(line.split()) == 6}


def test_mapped_restore_is_bit_exact_and_maps_only_single_chunk_arrays(tmp_path):
    m = save_steps(tmp_path, 1)
    restored = m.restore(mmap=True)
    assert first_difference(restored, make_state(1)) is None
    _, manifest = read_committed(tmp_path / "step_00000001")
    specs = specs_of(manifest)
    expect = {k for k, s in specs.items() if mappable(s)}
    assert expect == {"params/big", "params/half", "mask"}
    files = mapped_files()
    for key, spec in specs.items():
        chunk = tmp_path / "step_00000001" / key / spec.chunk_key(0).replace("/", os.sep)
        assert (str(chunk) in files) == (key in expect), key


def test_a_mapped_tensor_is_writable_without_changing_the_file(tmp_path):
    m = save_steps(tmp_path, 1)
    restored = m.restore(mmap=True)
    restored["params", "big"].add_(1.0)  # copy-on-write: this process's page only
    again = CheckpointManager(tmp_path).restore()  # verifies every crc: file unchanged
    assert torch.equal(again["params", "big"], make_state(1)["params", "big"])
    assert torch.equal(restored["params", "big"], make_state(1)["params", "big"] + 1.0)


def test_mapped_tensors_outlive_the_deleted_step(tmp_path):
    m = save_steps(tmp_path, 1)
    restored = m.restore(mmap=True)
    shutil.rmtree(tmp_path / "step_00000001")  # what retention does: unlink
    assert first_difference(restored, make_state(1)) is None


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_mapped_chunk_is_corruption_and_restore_falls_back(tmp_path, damage):
    save_steps(tmp_path, 1, 2)
    _, manifest = read_committed(tmp_path / "step_00000002")
    spec = specs_of(manifest)["params/big"]
    chunk = tmp_path / "step_00000002" / "params" / "big" / spec.chunk_key(0)
    os.chmod(chunk, 0o644)
    if damage == "flip":
        data = bytearray(chunk.read_bytes())
        data[len(data) // 3] ^= 0x10
        chunk.write_bytes(bytes(data))
    else:
        os.truncate(chunk, chunk.stat().st_size - 4096)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        restored = CheckpointManager(tmp_path).restore(mmap=True)
    assert int(restored["step"]) == 1 and first_difference(restored, make_state(1)) is None
    assert any("step_00000002" in str(w.message) for w in seen)
    with warnings.catch_warnings(), pytest.raises(CheckpointNotFoundError, match="big"):
        warnings.simplefilter("ignore")
        CheckpointManager(tmp_path).restore(2, mmap=True)


def test_a_mapped_state_trains_exactly_like_a_read_one(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 1))
    tx = ftrain.optim.adamw(1e-2, fused=True)

    def loss_fn(m, b):
        return ((m(b["x"]) - b["y"]) ** 2).mean()

    g = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(8, 256, generator=g), "y": torch.randn(8, 1, generator=g)}]
    batches *= 3
    CheckpointManager(tmp_path, async_save=False).save(ftrain.init_state(model, tx, seed=0))
    ends = []
    for donate, mapped in [(False, False), (False, True), (True, True)]:
        step = ftrain.make_step(model, loss_fn, tx, donate=donate)
        state = CheckpointManager(tmp_path).restore(mmap=mapped)
        for b in batches:
            state, _ = step(state, b)
        ends.append(state)
    assert first_difference(ends[0], ends[1]) is None
    assert first_difference(ends[0], ends[2]) is None  # donated: in place on the COW pages
    plain = CheckpointManager(tmp_path).restore()  # and the files were never written
    assert first_difference(plain, ftrain.init_state(model, tx, seed=0)) is None


def test_mmap_with_rows_is_refused_naming_the_fix(tmp_path):
    m = save_steps(tmp_path, 1)
    with pytest.raises(ValueError, match="leave mmap at False"):
        m.restore(mmap=True, rows=object())


def test_a_file_system_that_cannot_map_files_gets_a_verified_read(tmp_path, monkeypatch):
    import mmap as mmap_module

    save_steps(tmp_path, 1)

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")  # ENODEV: what mmap says on such a file system

    monkeypatch.setattr(mmap_module, "mmap", refuse)
    restored = CheckpointManager(tmp_path).restore(mmap=True)
    assert first_difference(restored, make_state(1)) is None
    assert not any("step_00000001" in f for f in mapped_files())
