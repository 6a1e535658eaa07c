"""The pure step's state buffer pool (ftrain/optim/buffers.py).

A pure step may write its new state into the buffers of an older state only when nothing
outside the pool refers to them any more: every way of holding a tensor is tried here,
and the pooled run must be bit-identical to one that clones.
"""

import gc
import threading

import pytest
import torch
from tensordict import TensorDict

import ftrain
from ftrain.ckpt import CheckpointManager
from ftrain.ckpt import manager as manager_module
from ftrain.optim import buffers
from ftrain.optim.buffers import BufferPool
from ftrain.state import first_difference, init_state, tree_equal
from tests.unit.test_apply import _batch, _model, _mse  # the same small model and data

o = ftrain.optim


def _setup():
    model = _model()
    tx = o.chain(o.clip_by_global_norm(0.5), o.adamw(1e-2, weight_decay=0.1, fused=True))
    return init_state(model, tx, seed=0), ftrain.make_step(model, _mse, tx)


def _run(steps: int, pooling: bool, monkeypatch) -> TensorDict:
    monkeypatch.setattr(buffers, "POOLING", pooling)
    state, step = _setup()
    for i in range(steps):
        state, _ = step(state, _batch(i))
    return state


@pytest.fixture
def made(monkeypatch):
    """The number of flat buffers the pools have made so far."""
    count = [0]
    original = buffers._Buffer.__init__

    def counted(self, leaves, copy=True):
        count[0] += 1
        original(self, leaves, copy)

    monkeypatch.setattr(buffers._Buffer, "__init__", counted)
    return count


def test_a_loop_reuses_the_buffers_of_the_state_two_steps_back(made, monkeypatch):
    state, step = _setup()
    per_step = []
    for i in range(6):
        state, _ = step(state, _batch(i))
        per_step.append(made[0])
    # params, mu, nu: one buffer each on the first two steps, none after
    assert per_step == [3, 6, 6, 6, 6, 6]
    pooled = state
    assert tree_equal(pooled, _run(6, False, monkeypatch)), "pooled differs from clones"


def _flat(leaves) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in leaves])


def _hold(way: str, state: TensorDict):
    """Hold (part of) ``state`` in one way; returns a reader of the values seen through it."""
    leaf = state["params", "0", "weight"]
    if way == "the whole state":
        return lambda: _flat(state.flatten_keys(".").values())
    if way == "one leaf":
        return lambda: leaf
    if way == "a view of a leaf":
        view = leaf[1:3]
        return lambda: view
    if way == "a reshaped moment":
        moment = state["opt", "adamw", "scale_by_adam", "mu", "2", "bias"].reshape(1, -1)
        return lambda: moment
    if way == "a numpy array":
        array = leaf.numpy()
        return lambda: torch.from_numpy(array)
    if way == "its storage object":
        storage = leaf.untyped_storage()
        return lambda: torch.tensor([], dtype=leaf.dtype).set_(storage)
    if way == "a tensor saved for backward":
        x = torch.ones(16, 4, requires_grad=True)
        y = (leaf * x).sum()  # autograd keeps the leaf's own TensorImpl, no Python reference
        return lambda: torch.autograd.grad(y, x, retain_graph=True)[0]
    if way == "a dict of its leaves":
        leaves = dict(state["params"].flatten_keys(".").items())
        return lambda: _flat(leaves.values())
    raise AssertionError(way)


WAYS = [
    "the whole state",
    "one leaf",
    "a view of a leaf",
    "a reshaped moment",
    "a numpy array",
    "its storage object",
    "a tensor saved for backward",
    "a dict of its leaves",
]


@pytest.mark.parametrize("way", WAYS)
def test_a_state_held_in_any_way_is_never_written(way, monkeypatch):
    state, step = _setup()
    state, _ = step(state, _batch(0))  # from here on each state lives in pool buffers
    read = _hold(way, state)
    before = read().clone()
    for i in range(1, 5):
        state, _ = step(state, _batch(i))
    gc.collect()
    assert torch.equal(read(), before), f"{way}: a held buffer was written"
    assert tree_equal(state, _run(5, False, monkeypatch)), f"{way}: pooled differs from clones"


def _hold_in_a_child(tensors, held, done) -> None:
    leaf = tensors.get()  # e.g. an evaluation or logging worker keeping the params
    first = leaf.clone()
    held.set()
    done.wait(timeout=60)
    tensors.put(bool(torch.equal(leaf, first)))


def test_a_leaf_another_process_holds_is_never_written():
    """Sent through torch.multiprocessing, a leaf's storage moves to shared memory and
    its holder lives in the other process, where no reference count here can see it."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    tensors, held, done = ctx.Queue(), ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_in_a_child, args=(tensors, held, done))
    child.start()
    try:
        state, step = _setup()
        state, _ = step(state, _batch(0))
        tensors.put(state["params", "0", "weight"])
        assert held.wait(timeout=60)
        for i in range(1, 6):
            state, _ = step(state, _batch(i))
        done.set()
        assert tensors.get(timeout=60), "a buffer the other process holds was written"
    finally:
        child.join(timeout=60)


def test_an_old_state_in_a_list_keeps_its_values_and_the_pool_stays_bounded(monkeypatch):
    state, step = _setup()
    history = [state]
    snapshots = [state.clone()]
    for i in range(6):
        state, _ = step(state, _batch(i))
        history.append(state)
        snapshots.append(state.clone())
    for i, (kept, snap) in enumerate(zip(history, snapshots, strict=True)):
        assert tree_equal(kept, snap), (i, first_difference(kept, snap))
    pools = [p for p in buffers._POOLS if p.nbytes()]
    assert pools and all(p.nbytes() <= 2 * 3 * 4 * (16 * 4 + 16 + 2 * 16 + 2) for p in pools)


def test_a_state_past_the_budget_is_cloned(made, monkeypatch):
    monkeypatch.setattr(buffers, "POOL_BYTES", 100)  # the model's state is ~1.4 KB
    state, step = _setup()
    for i in range(4):
        state, _ = step(state, _batch(i))
    assert made[0] == 0
    assert tree_equal(state, _run(4, False, monkeypatch))


def test_release_buffers_hands_the_spare_back(monkeypatch):
    buffers.release_buffers()
    state, step = _setup()
    for i in range(3):
        state, _ = step(state, _batch(i))
    assert buffers.release_buffers() > 0
    assert buffers.release_buffers() == 0
    before = state.clone()
    state, _ = step(state, _batch(3))  # after a release the pool starts again, correctly
    assert not tree_equal(state, before)


def test_an_incremental_save_sees_a_reused_view_as_changed(tmp_path, made):
    state, step = _setup()
    expected = []
    with CheckpointManager(tmp_path / "ckpt", async_save=False) as m:
        for i in range(5):
            state, _ = step(state, _batch(i))
            m.save(state)  # steps 3-5 reuse the view objects of steps 1-3
            expected.append(state.clone())
        assert made[0] == 6, "the saved states' buffers were reused"
        for s, want in enumerate(expected, start=1):
            got = m.restore(s)
            assert tree_equal(got, want), (s, first_difference(got, want))


def test_a_state_an_async_save_is_writing_is_never_reused(tmp_path, made, monkeypatch):
    """The save of step 1 is held in flight (its writer waits on a gate) while the loop
    runs four more steps: its buffers stay the save's, and it commits step 1's values."""
    gate, real = threading.Event(), manager_module.write_tree

    def gated(*args, **kwargs):
        assert gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(manager_module, "write_tree", gated)
    state, step = _setup()
    with CheckpointManager(tmp_path / "ckpt", async_save=True) as m:
        state, _ = step(state, _batch(0))
        expected = state.clone()
        m.save(state)
        for i in range(1, 5):
            state, _ = step(state, _batch(i))
        assert made[0] > 6, "the pinned state's buffers must not have been reused"
        gate.set()
        m.wait()
        got = m.restore(1)
    assert tree_equal(got, expected), first_difference(got, expected)
    assert tree_equal(state, _run(5, False, monkeypatch))


def test_pool_unit_behaviour():
    pool = BufferPool()
    a = pool.copies("k", [torch.ones(2), torch.zeros(3)])
    a_ptr = a[0].data_ptr()
    b = pool.copies("k", [torch.ones(2), torch.zeros(3)])
    assert b[0].data_ptr() != a_ptr  # a is held
    del a
    c = pool.copies("k", [torch.full((2,), 5.0), torch.zeros(3)])
    assert c[0].data_ptr() == a_ptr and c[0].tolist() == [5.0, 5.0] and b[0].tolist() == [1, 1]
    # a different shape under the same key never lands in a buffer cut for another
    d = pool.copies("k", [torch.ones(5)])
    assert d[0].shape == (5,) and d[0].data_ptr() not in (b[0].data_ptr(), c[0].data_ptr())
    # one leaf: a real copy (torch's flatten of one tensor would be a view of it)
    src = torch.arange(4.0)
    (e,) = pool.copies("one", [src])
    assert e.data_ptr() != src.data_ptr()
    # leaves the pool does not handle are cloned
    mixed = [torch.ones(2), torch.ones(2, dtype=torch.float64)]
    assert all(
        x.data_ptr() != y.data_ptr() for x, y in zip(pool.copies("m", mixed), mixed, strict=True)
    )

    # a tensor subclass (a DTensor, say) must stay one: cloned, never cut from a buffer
    class Sub(torch.Tensor):
        pass

    sub = torch.ones(3).as_subclass(Sub)
    for _ in range(3):
        (got,) = pool.copies("sub", [sub])
        assert type(got) is Sub and got.data_ptr() != sub.data_ptr()
    with pytest.raises(ValueError, match="spares >= 1"):
        BufferPool(spares=0)
