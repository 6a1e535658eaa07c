"""``restore(mmap=True)``: page-aligned arrays mapped copy-on-write (one chunk file, or many
side by side in one range), every chunk verified,
bit-exact, writable without touching the files, alive after the step is deleted, and a
state that trains exactly like a plainly restored one."""

from __future__ import annotations

import gc
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
from ftrain.ckpt.mapped import mappable, mapped_bytes
from ftrain.ckpt.reader import specs_of
from ftrain.state import first_difference


def make_state(step: int) -> TensorDict:
    g = torch.Generator().manual_seed(step)
    return TensorDict(
        {
            "step": torch.tensor(step),
            "params": {
                "big": torch.randn(512, 256, generator=g),  # 512 KiB, one chunk: mapped
                "wide": torch.randn(4000, 96, generator=g),  # 2 chunks of 189 pages: mapped
                "odd": torch.randn(600, 1025, generator=g),  # 3 chunks, not whole pages: read
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


def chunk_files(root: Path, spec) -> list[str]:
    return [str(root / spec.key / spec.chunk_key(i)) for i in range(spec.n_chunks)]


def test_mapped_restore_is_bit_exact_and_maps_only_page_aligned_arrays(tmp_path):
    m = save_steps(tmp_path, 1)
    restored = m.restore(mmap=True)
    assert first_difference(restored, make_state(1)) is None
    _, manifest = read_committed(tmp_path / "step_00000001")
    specs = specs_of(manifest)
    expect = {k for k, s in specs.items() if mappable(s)}
    assert expect == {"params/big", "params/wide", "params/half", "mask"}
    assert specs["params/wide"].n_chunks == 2 and specs["params/odd"].n_chunks == 3
    files = mapped_files()
    for key, spec in specs.items():
        for chunk in chunk_files(tmp_path / "step_00000001", spec):
            assert (chunk in files) == (key in expect), chunk
    leaves = {k if isinstance(k, str) else "/".join(k): t for k, t in restored.items(True, True)}
    assert mapped_bytes(leaves.values()) == sum(leaves[k].nbytes for k in expect)
    assert mapped_bytes(m.restore().values(True, True)) == 0  # the plain restore's


def test_chunk_files_sit_side_by_side_in_one_address_range_freed_with_the_tensor(tmp_path):
    save_steps(tmp_path, 1)
    wide = CheckpointManager(tmp_path).restore(mmap=True)["params", "wide"]
    _, manifest = read_committed(tmp_path / "step_00000001")
    spec = specs_of(manifest)["params/wide"]
    assert spec.chunk_nbytes * 2 > wide.nbytes  # the last chunk is padded: only its rows map
    with open("/proc/self/maps") as f:
        ranges = {line.split()[-1]: line.split()[0] for line in f if str(tmp_path) in line}
    starts = [
        int(ranges[c].split("-")[0], 16) for c in chunk_files(tmp_path / "step_00000001", spec)
    ]
    assert starts == [wide.data_ptr() + spec.chunk_span(i)[0] for i in range(2)]
    del wide
    gc.collect()
    assert not any(str(tmp_path) in f for f in mapped_files())  # unmapped with the tensor


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


@pytest.mark.parametrize(
    ("key", "damage"),
    [("big", "flip"), ("big", "truncate"), ("wide", "flip"), ("wide", "pad"), ("wide", "crc")],
)
def test_a_damaged_mapped_chunk_is_corruption_and_restore_falls_back(tmp_path, key, damage):
    save_steps(tmp_path, 1, 2)
    _, manifest = read_committed(tmp_path / "step_00000002")
    spec = specs_of(manifest)[f"params/{key}"]
    chunk = Path(chunk_files(tmp_path / "step_00000002", spec)[-1])
    os.chmod(chunk, 0o644)
    data = bytearray(chunk.read_bytes())
    if damage == "truncate":
        os.truncate(chunk, len(data) - 4096)
    else:  # a payload byte, a byte of the edge chunk's zero padding, the stored crc
        data[{"flip": len(data) // 3, "pad": -5, "crc": -1}[damage]] ^= 0x10
        chunk.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        restored = CheckpointManager(tmp_path).restore(mmap=True)
    assert int(restored["step"]) == 1 and first_difference(restored, make_state(1)) is None
    assert any("step_00000002" in str(w.message) for w in seen)
    with warnings.catch_warnings(), pytest.raises(CheckpointNotFoundError, match=f"{key}/c"):
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


@pytest.mark.parametrize("damage", [None, "flip"])
def test_a_file_system_that_cannot_map_files_gets_a_verified_read(tmp_path, monkeypatch, damage):
    from ftrain.ckpt import mapped

    save_steps(tmp_path, 1, 2)
    if damage:  # the read that replaces a refused mapping verifies like any other
        chunk = tmp_path / "step_00000002" / "params" / "wide" / "c.1.0"
        os.chmod(chunk, 0o644)
        data = bytearray(chunk.read_bytes())
        data[100] ^= 1
        chunk.write_bytes(bytes(data))
    real = mapped._mmap

    def refuse_files(addr, length, prot, flags, fd):
        if fd >= 0:  # ENODEV: what mmap(2) says on a file system that cannot map files
            raise OSError(19, "No such device")
        return real(addr, length, prot, flags, fd)

    monkeypatch.setattr(mapped, "_mmap", refuse_files)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        restored = CheckpointManager(tmp_path).restore(mmap=True)
    assert int(restored["step"]) == (1 if damage else 2)
    assert first_difference(restored, make_state(int(restored["step"]))) is None
    assert not any(str(tmp_path) in f for f in mapped_files())


@pytest.mark.parametrize("mapped", [False, True])
def test_read_bytes_counts_the_payload_restored(tmp_path, mapped):
    m = save_steps(tmp_path, 1)
    params = make_state(1)["params"]
    m.restore(mmap=mapped, only="params")
    assert m.read_bytes == sum(t.nbytes for t in params.values(True, True))


@pytest.mark.parametrize("mapped", [False, True])
def test_a_fifo_in_place_of_a_chunk_is_corruption_not_a_hang(tmp_path, mapped):
    save_steps(tmp_path, 1, 2)
    for key in ("big", "wide"):  # the prefetch pass opens every chunk file: none may block
        chunk = tmp_path / "step_00000002" / "params" / key / "c.0.0"
        chunk.unlink()
        os.mkfifo(chunk)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        restored = CheckpointManager(tmp_path).restore(mmap=mapped)
    assert int(restored["step"]) == 1 and first_difference(restored, make_state(1)) is None
    assert any("c.0.0: chunk is 0 bytes" in str(w.message) for w in seen)


def test_prefetch_hints_stop_at_half_the_available_memory_and_never_raise(tmp_path, monkeypatch):
    from ftrain.ckpt import reader

    files = [(tmp_path / f"c.{i}", 100) for i in range(5)]
    files[0][0].write_bytes(b"x" * 100)
    os.mkfifo(files[1][0])
    monkeypatch.setattr(reader, "_available_memory", lambda: 500)
    assert reader._within_half_memory(files) == files[:2]
    for f in files:  # a file, a FIFO, missing ones: hints only, the verified read reports
        reader._prefetch_file(f)
    monkeypatch.setattr(reader, "_available_memory", lambda: 10_000)
    with reader.prefetching(files):  # the hint thread never raises into the block
        pass


def test_past_the_mapping_budget_the_smaller_arrays_are_read(tmp_path, monkeypatch):
    from ftrain.ckpt import mapped

    save_steps(tmp_path, 1)
    # half of 13 left: 2 mappings per chunk of the largest mappable arrays, ties by key:
    # wide (2 chunks), then mask (1 of the three 512 KiB arrays), not a third
    monkeypatch.setattr(mapped, "_map_count", lambda: 0)
    monkeypatch.setattr(mapped, "_max_map_count", lambda: 13)
    restored = CheckpointManager(tmp_path).restore(mmap=True)
    assert first_difference(restored, make_state(1)) is None
    files = {f for f in mapped_files() if str(tmp_path) in f}
    assert {Path(f).parent.name for f in files} == {"mask", "wide"}


def test_an_async_save_of_a_mapped_state_finishes_at_interpreter_exit(tmp_path):
    import subprocess
    import sys

    save_steps(tmp_path / "a", 1)
    script = (
        "import sys\n"
        "from ftrain.ckpt import CheckpointManager\n"
        "state = CheckpointManager(sys.argv[1]).restore(mmap=True)\n"
        "CheckpointManager(sys.argv[2], async_save=True).save(state)\n"  # exits mid-save
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "a"), str(tmp_path / "b")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    again = CheckpointManager(tmp_path / "b").restore()  # every chunk verified
    assert first_difference(again, make_state(1)) is None


def test_a_mapped_restore_needs_memory_only_for_the_arrays_it_reads(tmp_path, monkeypatch):
    """The memory check counted every array, the mapped ones too (file-backed, the page
    cache's): a mapped resume of a state larger than the memory free at the moment
    stopped (exit 1). Only the arrays read into memory count; a plain restore still
    needs them all."""
    from ftrain.ckpt import CheckpointReadError, reader

    save_steps(tmp_path, 1)
    specs = specs_of(read_committed(tmp_path / "step_00000001")[1])
    read = sum(s.nbytes for k, s in specs.items() if not mappable(s))
    monkeypatch.setattr(reader, "_available_memory", lambda: read + 4096)
    m = CheckpointManager(tmp_path, async_save=False)
    assert first_difference(m.restore(mmap=True), make_state(1)) is None
    with pytest.raises(CheckpointReadError, match="bytes of memory"):
        m.restore()
