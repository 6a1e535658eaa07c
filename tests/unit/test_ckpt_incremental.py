"""Incremental checkpoints: unchanged leaves (the same tensor objects) are hard-linked from
the step last committed, every step stays complete; what is checked, what falls back."""

from __future__ import annotations

import errno
import gc
import json
import os
import time
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from ftrain.ckpt import CheckpointManager, CheckpointSaveError, LatestN, reader, store
from ftrain.ckpt import commit as protocol
from ftrain.ckpt import incremental as incr
from ftrain.ckpt.format import plan_array
from ftrain.ckpt.incremental import LeafChangedError

CHUNK = 16 << 10  # small chunks: the frozen leaves span several files


def frozen_base(seed: int = 0) -> TensorDict:
    """A 'pretrained' subtree, carried into every state as the same objects."""
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "wte": torch.randn(256, 64, generator=g),  # 64 KiB: 4 chunks
            "h": {"0": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}},
            "ln": torch.randn(64, generator=g).bfloat16(),
        },
        [],
    )


def state_at(step: int, base: TensorDict) -> TensorDict:
    """A fine-tuning state: ``base`` carried as is, a small adapter and its moments new."""
    g = torch.Generator().manual_seed(1000 + step)
    adapter = {"A": torch.randn(8, 64, generator=g), "B": torch.randn(64, 8, generator=g)}
    return TensorDict(
        {
            "step": torch.tensor(step),
            "params": {"base": base, "lora": adapter},
            "opt": {"mu": {k: v * 0.1 for k, v in adapter.items()}, "count": torch.tensor(step)},
            "rng": torch.tensor([7, 1]),
        },
        [],
    )


def chunk_files(step_dir: Path, prefix: str) -> dict[str, Path]:
    """``{relative path: file}`` of every chunk file under ``step_dir/prefix``."""
    root = step_dir / prefix
    return {str(p.relative_to(step_dir)): p for p in root.rglob("c*") if p.is_file()}


def inode(p: Path) -> int:
    return os.stat(p).st_ino


def same(a: TensorDict, b: TensorDict) -> bool:
    fa, fb = a.flatten_keys("/"), b.flatten_keys("/")
    return set(fa.keys()) == set(fb.keys()) and all(
        fa[k].dtype == fb[k].dtype
        and torch.equal(fa[k].reshape(-1).view(torch.uint8), fb[k].reshape(-1).view(torch.uint8))
        for k in fa.keys()
    )


def verify_ok(directory: Path, *steps: int) -> None:
    from ftrain.ckpt.__main__ import main

    assert main(["verify", str(directory), *map(str, steps)]) == 0


def manager(tmp_path: Path, **kw) -> CheckpointManager:
    return CheckpointManager(tmp_path / "ckpt", chunk_bytes=CHUNK, **kw)


@pytest.mark.parametrize("async_save", [False, True])
def test_unchanged_leaves_are_hard_linked_and_changed_ones_written(tmp_path, async_save):
    base = frozen_base()
    s1, s2 = state_at(1, base), state_at(2, base)
    with manager(tmp_path, async_save=async_save) as m:
        m.save(s1)
        m.save(s2)
    d1, d2 = tmp_path / "ckpt" / "step_00000001", tmp_path / "ckpt" / "step_00000002"
    frozen1, frozen2 = chunk_files(d1, "params/base"), chunk_files(d2, "params/base")
    assert len(frozen1) == 7 and frozen1.keys() == frozen2.keys()
    assert all(inode(frozen1[k]) == inode(frozen2[k]) for k in frozen1)  # linked
    for prefix in ("params/lora", "opt/mu", "step"):
        new1, new2 = chunk_files(d1, prefix), chunk_files(d2, prefix)
        assert new2 and all(inode(new1[k]) != inode(new2[k]) for k in new2)  # written
    assert inode(d1 / "rng" / "c.0") != inode(d2 / "rng" / "c.0")  # a new (equal) tensor
    # documents of the frozen subtree (arrays and groups) are linked; the rest written
    for doc in ("params/base/wte", "params/base/h/0/b", "params/base/h", "params/base"):
        assert inode(d1 / doc / "zarr.json") == inode(d2 / doc / "zarr.json")
    for doc in ("params/lora/A", "params/lora", "params", "."):
        assert inode(d1 / doc / "zarr.json") != inode(d2 / doc / "zarr.json")
    m = manager(tmp_path)
    save1, save2 = m.metadata(1)["save"], m.metadata(2)["save"]
    linked = sum(p.stat().st_size for p in frozen2.values())
    assert save1["linked_bytes"] == 0 and save1["written_bytes"] == save1["bytes"]
    assert save2["linked_bytes"] == linked and save2["bytes"] == save1["bytes"]
    assert save2["written_bytes"] == save2["bytes"] - linked
    assert same(m.restore(1), s1) and same(m.restore(2), s2)
    verify_ok(tmp_path / "ckpt")


def test_a_constant_leaf_carried_across_states_is_linked(tmp_path):
    """Identity, not a flag: any leaf carried as the same object (a base key) is linked."""
    key = torch.tensor([7, 1])
    with manager(tmp_path, async_save=False) as m:
        for step in (1, 2):
            m.save(TensorDict({"step": torch.tensor(step), "rng": key}, []))
    d = tmp_path / "ckpt"
    assert inode(d / "step_00000001/rng/c.0") == inode(d / "step_00000002/rng/c.0")


def test_retention_deleting_the_older_step_leaves_the_newer_one_complete(tmp_path):
    base = frozen_base()
    s2 = state_at(2, base)
    with manager(tmp_path, keep_policy=LatestN(1), async_save=False) as m:
        m.save(state_at(1, base))
        m.save(s2)
        assert m.all_steps() == [2]
        d2 = tmp_path / "ckpt" / "step_00000002"
        assert all(p.stat().st_nlink == 1 for p in chunk_files(d2, "params/base").values())
        verify_ok(tmp_path / "ckpt")
        assert same(m.restore(2), s2)
        s3 = state_at(3, base)
        m.save(s3)  # links from step 2 now
    d3 = tmp_path / "ckpt" / "step_00000003"
    assert not d2.exists() and manager(tmp_path).metadata(3)["save"]["linked_bytes"] > 0
    assert same(manager(tmp_path).restore(3), s3)
    verify_ok(tmp_path / "ckpt")
    assert all(p.stat().st_nlink == 1 for p in chunk_files(d3, "params/base").values())


def test_in_place_update_with_a_version_bump_is_rewritten(tmp_path):
    base = frozen_base()
    with manager(tmp_path, async_save=False) as m:
        m.save(state_at(1, base))
        base["wte"].add_(1.0)  # a tracked in-place op: _version moves
        s2 = state_at(2, base)
        m.save(s2)
    d = tmp_path / "ckpt"
    one, two = (
        chunk_files(d / "step_00000001", "params/base"),
        chunk_files(d / "step_00000002", "params/base"),
    )
    wte = [k for k in one if "/wte/" in k]
    assert wte and all(inode(one[k]) != inode(two[k]) for k in wte)
    assert all(inode(one[k]) == inode(two[k]) for k in one if k not in wte)
    assert same(manager(tmp_path).restore(2), s2)
    verify_ok(d)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9, fused=True), id="sgd"),
        pytest.param(lambda ps: torch.optim.AdamW(ps, lr=0.5, fused=True), id="adamw"),
    ],
)
def test_a_fused_torch_optimizers_step_is_saved_not_linked(tmp_path, make):
    """torch.optim's fused kernels write params and moments without bumping _version: a
    loop saving after each step had a sparse update (two embedding rows) linked from the
    step before, a stale step that verified; the audit caught it saves later."""
    emb = torch.nn.Embedding(2048, 64)  # 512 KiB: rows 1500+ lie outside the windows
    with manager(tmp_path, async_save=False) as m:
        opt = make(list(emb.parameters()))
        saved = []
        for step in range(3):
            if step:
                emb(torch.tensor([1500 + step, 1900])).sum().backward()
                opt.step()
                opt.zero_grad()
            moments = {k: v for k, v in opt.state[emb.weight].items() if k != "step"}
            state = TensorDict({"step": torch.tensor(step), "w": emb.weight, "opt": moments}, [])
            m.save(state)
            saved.append(state.clone())
    for step in (1, 2):
        assert same(manager(tmp_path).restore(step), saved[step]), step
    verify_ok(tmp_path / "ckpt")


class _RawPointerSGD(torch.optim.Optimizer):
    """A third party's optimizer: writes through .data (uncounted), keeps a list as state."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.5})
        self.state = []  # not the dict torch's optimizers keep: the hook must not fail on it

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.data.sub_(group["lr"] * p.grad)


def test_a_third_party_step_is_counted_and_an_unreadable_state_never_fails_it(tmp_path):
    from ftrain.ckpt import untracked

    untracked.count_optimizer_writes()
    w = torch.nn.Parameter(torch.zeros(4096))
    opt = _RawPointerSGD([w])
    before = w._version
    w.grad = torch.ones(4096)
    opt.step()  # the list state: skipped, the params still counted
    assert w._version > before and float(w[0].detach()) == -0.5


def test_a_compiled_fused_step_is_counted(tmp_path):
    """Under torch.compile the hook was skipped, and the compiled fused kernels count
    nothing either: versions stayed put."""
    from ftrain.ckpt import untracked

    untracked.count_optimizer_writes()
    w = torch.nn.Parameter(torch.randn(8, 8))
    w.grad = torch.ones(8, 8)
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    opt.step()
    before = (w._version, opt.state[w]["exp_avg"]._version)
    torch.compile(opt.step)()
    assert w._version > before[0] and opt.state[w]["exp_avg"]._version > before[1]


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda b: b["wte"].data.mul_(2), id="data-whole-leaf"),
        pytest.param(lambda b: b["wte"].numpy().__setitem__((0, 0), 5.0), id="numpy-first-byte"),
        pytest.param(lambda b: b["h", "0", "b"].data.__setitem__(10, 0.5), id="data-small-leaf"),
        pytest.param(lambda b: b["ln"].data.zero_(), id="data-bf16"),
    ],
)
@pytest.mark.parametrize("async_save", [False, True])
def test_a_change_behind_pytorchs_back_is_refused_at_save(tmp_path, mutate, async_save):
    base = frozen_base()
    with manager(tmp_path, async_save=async_save) as m:
        m.save(state_at(1, base))
        m.wait()
        versions = {k: t._version for k, t in base.flatten_keys("/").items()}
        mutate(base)
        assert versions == {k: t._version for k, t in base.flatten_keys("/").items()}
        with pytest.raises(LeafChangedError, match=r"'params/base/.*' is the same tensor") as e:
            m.save(state_at(2, base))
        assert "Make a new tensor instead" in str(e.value) and "Nothing was saved" in str(e.value)
        assert isinstance(e.value, ValueError) and m.all_steps() == [1]
        # a new tensor in its place is fine, and the policy clock was not moved
        base = base.clone()
        assert m.save(state_at(2, base))
    assert manager(tmp_path).all_steps() == [1, 2]


def test_a_change_outside_the_sample_windows_is_found_by_the_chunk_audit(tmp_path):
    """The guarantee's bound: any change is caught within 1/AUDIT_FRACTION saves."""
    big = torch.randn(64 * 1024, 16)  # 4 MiB, 64 chunks of 64 KiB
    with CheckpointManager(tmp_path, chunk_bytes=64 << 10, async_save=False) as m:
        m.save(TensorDict({"step": torch.tensor(0), "frozen": big}, []))
        row = 64 * 1024 * 33 // 64 + 100  # in chunk 33, far from every window
        big.data[row, 3] += 1.0
        n = int(1 / incr.AUDIT_FRACTION)
        with pytest.raises(LeafChangedError, match=r"'frozen' .* its chunk 33 differs"):
            for step in range(1, n + 2):
                m.save(TensorDict({"step": torch.tensor(step), "frozen": big}, []))
        assert step <= n


def test_the_checks_hash_a_sample_of_the_bytes(tmp_path, monkeypatch):
    """Per save: each reused leaf's 32 KiB of windows, plus 1/32 of the reused bytes."""
    big = torch.randn(1 << 20)  # 4 MiB in 64 chunks
    leaves = {"step": torch.tensor(2), "frozen": big}
    with CheckpointManager(tmp_path, chunk_bytes=64 << 10, async_save=False) as m:
        m.save(TensorDict({"step": torch.tensor(1), "frozen": big}, []))
        seen = []
        real = incr.crc32c.crc32c
        monkeypatch.setattr(
            incr.crc32c, "crc32c", lambda b, value=0: seen.append(len(b)) or real(b, value)
        )
        plan = incr.plan_save(m._last_commit, leaves, 64 << 10, None)
        monkeypatch.undo()
    assert set(plan.reuse) == {"frozen"}
    assert sum(seen) == incr.WINDOW * incr.WINDOWS + (4 << 20) * incr.AUDIT_FRACTION


def test_a_different_object_with_the_same_storage_is_not_reused(tmp_path):
    base = frozen_base()
    with manager(tmp_path, async_save=False) as m:
        m.save(state_at(1, base))
        alias = base.apply(lambda t: t.detach())  # same data_ptr and version, new objects
        assert alias["wte"].data_ptr() == base["wte"].data_ptr()
        m.save(state_at(2, alias))
    assert manager(tmp_path).metadata(2)["save"]["linked_bytes"] == 0


def test_identity_is_held_by_weak_reference(tmp_path):
    """The record keeps nothing alive, and a collected tensor never matches again (an
    ``id()`` or address compare would be unsafe once memory is reused)."""
    base = frozen_base()
    with manager(tmp_path, async_save=True) as m:
        m.save(state_at(1, base))
        m.wait()
        ref = m._last_commit.leaves["params/base/wte"].identity.ref
        assert ref() is base["wte"]
        del base
        gc.collect()
        assert ref() is None
        fresh = frozen_base()  # equal bytes, new objects (possibly at the same addresses)
        m.save(state_at(2, fresh))
    assert manager(tmp_path).metadata(2)["save"]["linked_bytes"] == 0


def test_full_training_reuses_nothing_and_the_identity_check_is_cheap():
    leaves = {f"p/{i}": torch.randn(4) for i in range(2000)}
    last = incr.LastCommit(1, Path("/nowhere"), {})
    t0 = time.perf_counter()
    plan = incr.plan_save(last, leaves, 32 << 20, None)
    elapsed = time.perf_counter() - t0
    assert plan.reuse == {} and len(plan.identities) == 2000
    assert elapsed < 0.2  # ~2 us a leaf; a loose bound for a loaded CI machine


def test_a_failed_save_does_not_poison_the_record(tmp_path, monkeypatch):
    """An OSError after the links were made: the staging directory is removed (only its
    own names: the committed step keeps its files), the next save links from the last
    *committed* step."""
    base = frozen_base()
    with manager(tmp_path, async_save=True) as m:
        m.save(state_at(1, base))
        m.wait()

        def fail(phase):
            if phase == "data_written":
                raise OSError(errno.EIO, "injected I/O error")

        monkeypatch.setattr(protocol, "fault_hook", fail)
        m.save(state_at(2, base))
        with pytest.raises(CheckpointSaveError, match="injected"):
            m.wait()
        monkeypatch.setattr(protocol, "fault_hook", None)
        d1 = tmp_path / "ckpt" / "step_00000001"
        assert all(p.stat().st_nlink == 1 for p in chunk_files(d1, "params/base").values())
        assert m._last_commit.step == 1
        verify_ok(tmp_path / "ckpt", 1)
        s3 = state_at(3, base)
        m.save(s3)
    d3 = tmp_path / "ckpt" / "step_00000003"
    one, three = chunk_files(d1, "params/base"), chunk_files(d3, "params/base")
    assert all(inode(one[k]) == inode(three[k]) for k in one)
    assert manager(tmp_path).all_steps() == [1, 3]
    assert same(manager(tmp_path).restore(3), s3)


def test_a_dead_writers_staging_with_links_is_swept_without_touching_the_step(tmp_path):
    base = frozen_base()
    with manager(tmp_path, async_save=False) as m:
        m.save(state_at(1, base))
        plan = incr.plan_save(
            m._last_commit, store.groups_and_arrays(state_at(2, base))[1], CHUNK, None
        )
    staging = protocol.begin(tmp_path / "ckpt", 2)
    store.write_tree(staging.path, state_at(2, base), {}, chunk_bytes=CHUNK, reuse=plan.reuse)
    staging.release()  # the writer "dies": its lock is free, the staging dir stays
    d1 = tmp_path / "ckpt" / "step_00000001"
    assert all(p.stat().st_nlink == 2 for p in chunk_files(d1, "params/base").values())
    m = manager(tmp_path)  # the start-up sweep
    assert not staging.path.exists() and m.all_steps() == [1]
    assert all(p.stat().st_nlink == 1 for p in chunk_files(d1, "params/base").values())
    verify_ok(tmp_path / "ckpt")


def save_to_fallback(monkeypatch, primary: Path, fallback: Path, base: TensorDict) -> None:
    """Step 1 in ``primary``; then the primary is full, so step 2 goes to ``fallback``."""
    with CheckpointManager(
        primary, fallback_directory=fallback, chunk_bytes=CHUNK, async_save=False
    ) as m:
        m.save(state_at(1, base))
        real = protocol.begin

        def begin(root, step):
            if root == primary:
                raise OSError(errno.ENOSPC, "No space left on device", str(root))
            return real(root, step)

        monkeypatch.setattr(protocol, "begin", begin)
        with pytest.warns(RuntimeWarning, match="saving to fallback"):
            m.save(state_at(2, base))


def test_fallback_directory_on_the_same_file_system_links_across(tmp_path, monkeypatch):
    base = frozen_base()
    primary, fallback = tmp_path / "ckpt", tmp_path / "fallback"
    save_to_fallback(monkeypatch, primary, fallback, base)
    one = chunk_files(primary / "step_00000001", "params/base")
    two = chunk_files(fallback / "step_00000002", "params/base")
    assert all(inode(one[k]) == inode(two[k]) for k in one)
    assert same(
        CheckpointManager(primary, fallback_directory=fallback).restore(2), state_at(2, base)
    )
    verify_ok(fallback)


@pytest.mark.skipif(
    not Path("/dev/shm").is_dir() or os.stat("/dev/shm").st_dev == os.stat("/tmp").st_dev,
    reason="needs /dev/shm on another file system than /tmp",
)
def test_fallback_on_another_file_system_writes_instead_of_linking(tmp_path, monkeypatch):
    import tempfile

    base = frozen_base()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        fallback = Path(shm) / "fallback"
        save_to_fallback(monkeypatch, tmp_path / "ckpt", fallback, base)
        meta = CheckpointManager(fallback).metadata(2)
        assert meta["save"]["linked_bytes"] == 0  # EXDEV: every chunk written
        assert same(CheckpointManager(fallback).restore(2), state_at(2, base))
        verify_ok(fallback)


@pytest.mark.parametrize(
    "obstacle",
    [
        pytest.param("eperm", id="link-refused"),
        pytest.param("set-aside", id="previous-step-set-aside"),
        pytest.param("deleted", id="previous-step-deleted"),
        pytest.param("chunk-bytes", id="other-chunk-size"),
        pytest.param("compression", id="other-compression"),
    ],
)
def test_whatever_prevents_linking_the_leaf_is_written(tmp_path, monkeypatch, obstacle):
    base = frozen_base()
    s2 = state_at(2, base)
    with manager(tmp_path, async_save=False) as m:
        m.save(state_at(1, base))
        d1 = tmp_path / "ckpt" / "step_00000001"
        if obstacle == "eperm":
            monkeypatch.setattr(
                os, "link", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EPERM, "no"))
            )
        elif obstacle == "set-aside":
            protocol.set_aside(d1, "superseded")
        elif obstacle == "deleted":
            protocol.delete_step(d1)
        elif obstacle == "chunk-bytes":
            m.chunk_bytes = CHUNK * 2  # wte's chunks change; one-chunk leaves do not
        else:
            m.compression = "zstd:1"
        assert m.save(s2)
    meta = manager(tmp_path).metadata(2)["save"]
    wte = chunk_files(tmp_path / "ckpt" / "step_00000002", "params/base/wte").values()
    assert all(p.stat().st_nlink == 1 for p in wte)
    if obstacle != "chunk-bytes":
        assert meta["linked_bytes"] == 0 and meta["written_bytes"] == meta["bytes"]
    assert same(manager(tmp_path).restore(2), s2)
    verify_ok(tmp_path / "ckpt", 2)


def test_incremental_false_writes_every_byte(tmp_path):
    base = frozen_base()
    with manager(tmp_path, async_save=False, incremental=False) as m:
        m.save(state_at(1, base))
        m.save(state_at(2, base))
    d = tmp_path / "ckpt"
    one, two = chunk_files(d / "step_00000001", ""), chunk_files(d / "step_00000002", "")
    assert all(inode(one[k]) != inode(two[k]) for k in one)
    assert manager(tmp_path).metadata(2)["save"]["linked_bytes"] == 0


def test_compressed_leaves_are_linked_too(tmp_path):
    base = frozen_base()
    s2 = state_at(2, base)
    with manager(tmp_path, async_save=False, compression="blosc-lz4") as m:
        m.save(state_at(1, base))
        m.save(s2)
    meta = manager(tmp_path).metadata(2)["save"]
    assert meta["linked_bytes"] > 0
    assert same(manager(tmp_path).restore(2), s2)
    verify_ok(tmp_path / "ckpt")


def test_redone_steps_after_a_resume_from_an_earlier_step(tmp_path):
    """A run at 3 resumes from 1 and redoes 2 and 3: the old 2 and 3 (which share linked
    chunks with 1) are moved aside and still verify; the new 3 links from the new 2."""
    with manager(tmp_path, async_save=False) as m:
        base = frozen_base()
        for step in (1, 2, 3):
            m.save(state_at(step, base))
    with manager(tmp_path, async_save=False) as m:
        base = m.restore(1)["params"]["base"]  # new objects, the same bytes
        redo = {s: state_at(s, base) for s in (2, 3)}
        for s in (2, 3):
            m.save(redo[s])
    d = tmp_path / "ckpt"
    two, three = (
        chunk_files(d / "step_00000002", "params/base"),
        chunk_files(d / "step_00000003", "params/base"),
    )
    assert all(inode(two[k]) == inode(three[k]) for k in two)
    m = manager(tmp_path)
    aside = m.set_aside_steps()
    assert sorted(aside) == [2, 3]  # the old 2 replaced, the old 3 superseded
    for (p,) in aside.values():
        assert reader.verify_tree(p, json.loads((p / "manifest.json").read_bytes())) > 0
    assert same(m.restore(2), redo[2]) and same(m.restore(3), redo[3])
    verify_ok(d)


def test_host_snapshot_does_not_copy_reused_device_leaves():
    """Leaves on another device ("meta" stands in for an accelerator here) that are reused
    become shape-only placeholders; the tree keeps its groups, CPU leaves are kept."""
    dev = torch.empty(4, 3, device="meta")
    cpu = torch.randn(2)
    state = TensorDict({"a": {"dev": dev, "cpu": cpu}, "empty": {}}, []).lock_()
    spec = plan_array("a/dev", dev)
    reuse = {"a/dev": incr.Reuse(Path("/prev"), spec, dev)}
    host = incr.host_snapshot(state, store.groups_and_arrays(state)[1], reuse)
    groups, leaves = store.groups_and_arrays(host)
    assert groups == ["", "a", "empty"] and set(leaves) == {"a/dev", "a/cpu"}
    assert leaves["a/dev"].device.type == "meta" and leaves["a/dev"].shape == (4, 3)
    assert torch.equal(leaves["a/cpu"], cpu)
    assert incr.host_snapshot(TensorDict({"x": cpu}, []), {"x": cpu}, {}) is not None


def test_inference_tensors_have_no_version_counter_and_are_always_written(tmp_path):
    with torch.inference_mode():
        frozen = torch.randn(64, 64)
    with manager(tmp_path, async_save=False) as m:
        for step in (1, 2):
            m.save(TensorDict({"step": torch.tensor(step), "frozen": frozen}, []))
    assert manager(tmp_path).metadata(2)["save"]["linked_bytes"] == 0
    assert torch.equal(manager(tmp_path).restore(2)["frozen"], frozen)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_resumed_run_links_the_restored_leaves_it_carries(tmp_path, async_save):
    """After a whole-state restore, the first save links what the run carries over from
    the restored tree (a resumed fine-tune's frozen base) from the restored step."""
    with manager(tmp_path, async_save=False) as m:
        m.save(state_at(1, frozen_base()))
    with manager(tmp_path, async_save=async_save) as m:
        base = m.restore(target=state_at(1, frozen_base()))["params"]["base"]
        s2 = state_at(2, base)
        m.save(s2)
    d = tmp_path / "ckpt"
    one, two = (
        chunk_files(d / "step_00000001", "params/base"),
        chunk_files(d / "step_00000002", "params/base"),
    )
    assert all(inode(one[k]) == inode(two[k]) for k in one)
    assert same(manager(tmp_path).restore(2), s2)
    verify_ok(d)


def test_a_partial_restore_records_nothing(tmp_path):
    with manager(tmp_path, async_save=False) as m:
        m.save(state_at(1, frozen_base()))
    with manager(tmp_path, async_save=False) as m:
        base = m.restore(only="params")["params"]["base"]
        assert m._last_commit is None
        m.save(state_at(2, base))
    assert manager(tmp_path).metadata(2)["save"]["linked_bytes"] == 0


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("async_save", [False, True])
def test_a_donated_step_is_saved_every_step_and_restores(tmp_path, fused, async_save):
    """The fused Adam kernels write the donated leaves in place without bumping their
    version counters: the step bumps them, or the next save would take them as unchanged
    (and refuse them, their bytes differing)."""
    import ftrain
    from ftrain.state import tree_equal
    from tests.unit.test_apply import _batch, _model, _mse

    model = _model()
    tx = ftrain.optim.adamw(1e-2, weight_decay=0.1, fused=fused)
    state = ftrain.init_state(model, tx, seed=0)
    step = ftrain.make_step(model, _mse, tx, donate=True)
    m = CheckpointManager(tmp_path, async_save=async_save)
    saved = {}
    for i in range(4):
        state, _ = step(state, _batch(i))
        m.save(state)
        m.wait()  # the writer is done before the next step donates the state
        saved[i + 1] = state.clone()
    for s, want in saved.items():
        assert tree_equal(m.restore(s), want), s


@pytest.mark.parametrize("async_save", [False, True])
def test_a_source_step_another_writer_replaced_is_not_linked(tmp_path, async_save, caplog):
    """Manager B redid step 1 on A's location (A's step set aside, B's committed under the
    same name, same sizes, other bytes): A's next save linked B's chunks under A's crc32c
    and reported success — a step committed already corrupt, and A's work lost (restore
    fell back to B's step). The source's sealed manifest is now read first: a leaf whose
    entry there is not the one recorded is written again."""
    base = frozen_base()
    a = manager(tmp_path, async_save=async_save)
    a.save(state_at(1, base))
    a.wait()
    other = state_at(1, frozen_base(seed=5))  # same shapes, other bytes
    # a writer A's writer lock cannot see (another host on a shared file system, whose
    # flock does not reach this one): here A's lock is simply dropped
    a._writers.release()
    b = manager(tmp_path, async_save=False)
    b.save(other, force=True)  # a redo: A's step 1 moves aside
    b.close()
    s2 = state_at(2, base)
    a.save(s2)
    a.close()
    assert "no longer holds what this CheckpointManager committed" in caplog.text
    m = manager(tmp_path)
    assert m.metadata(2)["save"]["linked_bytes"] == 0
    assert same(m.restore(2), s2) and same(m.restore(1), other)
    verify_ok(tmp_path / "ckpt")


def _flip(path: Path, offset: int) -> None:
    """One byte of ``path`` changed in place (the same inode: every step sharing it)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


def _rot_then_save(tmp_path, where: str, saves: int, caplog) -> tuple[TensorDict, Path]:
    """Step 1 committed, one of its shared files damaged in place (``where``: a chunk's
    payload or trailer, or a ``zarr.json``), then ``saves`` more saves with LatestN(2)."""
    base = frozen_base()
    with manager(tmp_path, async_save=False, keep_policy=LatestN(2)) as m:
        m.save(state_at(1, base))
        wte = tmp_path / "ckpt" / "step_00000001" / "params" / "base" / "wte"
        if where == "document":
            doc = wte / "zarr.json"
            doc.write_text(doc.read_text().replace('"float32"', '"float3X"'))
        else:
            chunk = sorted(p for p in wte.rglob("c*") if p.is_file())[2]
            _flip(chunk, 100 if where == "payload" else chunk.stat().st_size - 2)
        for s in range(2, 2 + saves):
            m.save(state_at(s, base))
    return state_at(1 + saves, base), tmp_path / "ckpt"


@pytest.mark.parametrize(
    ("where", "saves"),
    [
        pytest.param("document", 1, id="zarr-json-at-once"),
        # wte's 4 chunks are 4 of the ~9 reused chunks: the audit's ~1/32 of the bytes a
        # save (one chunk at least) reaches all of them within the 10 saves
        pytest.param("trailer", 10, id="trailer-within-an-audit-cycle"),
        pytest.param("payload", 10, id="payload-within-an-audit-cycle"),
    ],
)
def test_a_damaged_shared_file_is_not_linked_into_new_steps(tmp_path, caplog, where, saves):
    """One flipped byte in a chunk file that every step shares (the frozen base): each later
    save linked the damaged file under its old crc32c and said it succeeded, retention
    removed the older steps, and at the next start no step restored. The file is checked
    before a link (its size always, the audited chunks whole, a zarr.json by its bytes) and
    written afresh from memory; the new steps are intact and say so."""
    newest, root = _rot_then_save(tmp_path, where, saves, caplog)
    m = CheckpointManager(root)
    assert m.all_steps() == [saves, saves + 1]
    assert same(m.restore(), newest), "the newest step holds the intact bytes"
    verify_ok(root, saves + 1)
    # a zarr.json of other bytes is written afresh without a word (an older ftrain's
    # documents were pretty-printed: not damage)
    said = "do not match their checksums and were written afresh" in caplog.text
    assert said == (where != "document"), caplog.text


def test_a_transient_read_error_is_raised_not_taken_for_corruption(tmp_path, monkeypatch):
    """EMFILE while restoring a chunk made an intact step "corrupt": restore fell back to
    an older one (its steps trained again) and the next save set the intact step aside.
    Such an error of the machine is raised as an OSError that says so; nothing is judged."""
    base = frozen_base()
    with manager(tmp_path, async_save=False) as m:
        for s in (1, 2):
            m.save(state_at(s, base), force=True)
    real_open = os.open

    def emfile(path, flags, *a, **k):
        if str(path).endswith("step_00000002/params/base/wte/c.1.0"):
            raise OSError(errno.EMFILE, "Too many open files", str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", emfile)
    with pytest.raises(OSError, match="a limit of this machine, not a fault of the checkpoint"):
        manager(tmp_path).restore()
    monkeypatch.setattr(os, "open", real_open)
    real_scandir = os.scandir

    def emfile_listing(path="."):  # the walk that refuses symbolic links in a step
        if str(path).endswith("step_00000002"):
            raise OSError(errno.EMFILE, "Too many open files", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", emfile_listing)
    with pytest.raises(OSError, match="cannot list .*a limit of this machine"):
        manager(tmp_path).restore()
    monkeypatch.setattr(os, "scandir", real_scandir)
    again = manager(tmp_path)
    assert again.all_steps() == [1, 2] and same(again.restore(), state_at(2, base))


@pytest.mark.parametrize("sweeper", ["unlinked", "holding"])
def test_a_lock_swept_before_its_flock_is_retaken_under_a_new_name(tmp_path, monkeypatch, sweeper):
    """Another process's start-up sweep (a restore-only manager) can unlink a staging lock
    between its creation and its flock, or hold it while it judges it; the save failed
    ("swept before it was taken", or BlockingIOError) and the CLI stopped the run. A fresh
    name is taken."""
    real_flock, swept = protocol.fcntl.flock, []

    def sweep_first(fd, op):
        locks = list((tmp_path / "ckpt").glob(".step_*.lock"))
        if locks and not swept:  # the staging lock's flock (not the writer lock's)
            swept.append(locks[0].name)
            if sweeper == "holding":
                raise BlockingIOError(11, "Resource temporarily unavailable")
            locks[0].unlink()  # what sweep_stale does to a free orphan lock
        return real_flock(fd, op)

    monkeypatch.setattr(protocol.fcntl, "flock", sweep_first)
    with manager(tmp_path, async_save=False) as m:
        assert m.save(state_at(1, frozen_base()), force=True)
    assert swept and manager(tmp_path).all_steps() == [1]
    assert not list((tmp_path / "ckpt").glob(".step_*"))


def test_a_sweep_unlinks_an_orphan_lock_only_while_it_holds_it(tmp_path):
    """The sweep let a free orphan lock go, then unlinked it: a writer that took it in
    between wrote with no lock a later sweep respects. Held by another: kept."""
    root = tmp_path / "ckpt"
    root.mkdir()
    free, held = root / ".step_00000001.tmp-1-aaaa.lock", root / ".step_00000002.tmp-1-bbbb.lock"
    free.touch()
    held.touch()
    fd = os.open(held, os.O_RDWR)
    protocol.fcntl.flock(fd, protocol.fcntl.LOCK_EX)
    try:
        assert protocol.sweep_stale(root) == [free]
        assert held.exists() and not free.exists()
    finally:
        os.close(fd)
