import pytest
import torch
from tensordict import TensorDict

import ftrain
from ftrain.state import (
    STATE_KEYS,
    cast,
    count_params,
    first_difference,
    flatten,
    init_state,
    replace,
    tree_equal,
    unflatten,
)


class WithBuffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.norm = torch.nn.BatchNorm1d(2)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def test_init_state_layout():
    model = WithBuffers()
    state = init_state(model, ftrain.optim.sgd(0.1), seed=0)
    assert tuple(sorted(state.keys())) == tuple(sorted(STATE_KEYS))
    assert state["step"].dtype == torch.int64 and state["step"].dim() == 0
    assert set(state["params"].keys(True, True)) == {
        ("lin", "weight"),
        ("lin", "bias"),
        ("norm", "weight"),
        ("norm", "bias"),
    }
    # Persistent buffers only: the non-persistent scratch buffer is not state.
    assert ("norm", "running_mean") in state["buffers"].keys(True, True)
    assert "scratch" not in state["buffers"].keys()
    assert set(state["data"].keys()) == {"epoch", "position"}
    assert torch.equal(state["rng"], ftrain.rng.key(0))


def test_state_owns_copies_and_is_locked():
    model = torch.nn.Linear(2, 2)
    state = init_state(model, ftrain.optim.sgd(0.1), seed=0)
    assert state["params"]["weight"].data_ptr() != model.weight.data_ptr()
    assert not state["params"]["weight"].requires_grad
    with pytest.raises(RuntimeError):
        state["extra"] = torch.zeros(())


def test_bad_precision():
    with pytest.raises(ValueError, match="fp8"):
        init_state(torch.nn.Linear(1, 1), ftrain.optim.sgd(0.1), seed=0, precision="fp8")


def test_fp16_starts_with_gradscaler_scale():
    tx = ftrain.optim.dynamic_loss_scale(ftrain.optim.sgd(0.1))
    state = init_state(torch.nn.Linear(1, 1), tx, seed=0, precision="fp16")
    assert float(state["opt", "loss_scale", "scale"]) == 65536.0
    with pytest.raises(ValueError, match="dynamic_loss_scale"):
        init_state(torch.nn.Linear(1, 1), ftrain.optim.sgd(0.1), seed=0, precision="fp16")


def test_flatten_unflatten_roundtrip():
    t = TensorDict(a=torch.zeros(1), b={"c": torch.ones(2), "d": {"e": torch.arange(3)}})
    keys, leaves = flatten(t)
    assert keys == [("a",), ("b", "c"), ("b", "d", "e")]
    assert tree_equal(unflatten(keys, leaves), t)
    with pytest.raises(ValueError, match="one leaf per key"):
        unflatten(keys[:2], leaves[:1])


def test_flatten_order_does_not_depend_on_insertion_order():
    a = TensorDict(z=torch.zeros(1), a={"y": torch.ones(1), "b": torch.ones(1)})
    b = TensorDict(a={"b": torch.ones(1), "y": torch.ones(1)}, z=torch.zeros(1))
    assert flatten(a)[0] == flatten(b)[0] == [("a", "b"), ("a", "y"), ("z",)]


def test_first_difference_reports_keys_shapes_and_bits():
    a = TensorDict(x=torch.tensor([0.0, 1.0]), y=torch.zeros(2))
    assert first_difference(a, a.clone()) is None
    assert "only in second ['z']" in first_difference(a, a.clone().set("z", torch.zeros(1)))
    assert "(2,)" in first_difference(a, a.clone().set("x", torch.zeros(3)))
    neg = a.clone().set("y", torch.tensor([0.0, -0.0]))
    assert first_difference(a, neg) == "y: values differ at flat index 1 (0.0 vs -0.0)"
    nan = TensorDict(x=torch.tensor(float("nan")))
    assert tree_equal(nan, nan.clone())
    # "a.b" beside a nested a/b read the same when dotted: shown by path then
    dotted, nested = TensorDict({"a.b": torch.ones(1)}), TensorDict({"a": {"b": torch.ones(1)}})
    assert (
        first_difference(dotted, nested)
        == "keys differ: only in first ['a.b'], only in second ['a/b']"
    )
    # conjugate and negative views compare by their values (view() refused them)
    z = torch.tensor([1 + 2j, 3 - 1j])
    assert tree_equal(TensorDict(z=z.conj()), TensorDict(z=z.conj().resolve_conj()))
    assert tree_equal(TensorDict(z=torch._neg_view(z)), TensorDict(z=-z))


def test_replace_cast_count():
    state = init_state(torch.nn.Linear(3, 2), ftrain.optim.sgd(0.1), seed=0)
    new = replace(state, step=torch.tensor(9))
    assert int(new["step"]) == 9 and int(state["step"]) == 0 and new.is_locked
    assert new["params"]["weight"] is state["params"]["weight"]
    with pytest.raises(KeyError, match="nope"):
        replace(state, nope=torch.zeros(()))
    half = cast(state["params"], torch.bfloat16)
    assert half["weight"].dtype == torch.bfloat16
    assert cast(state, torch.float16)["step"].dtype == torch.int64
    assert count_params(state["params"]) == 8
    # the structure is kept: empty sub-trees (buffers, a stateless transform's {}), the lock
    tx = ftrain.optim.adamw(1e-3, weight_decay=0.1)
    full = init_state(torch.nn.Linear(2, 1), tx, seed=0)
    wide = cast(full, torch.float64)
    assert set(wide.keys(True)) == set(full.keys(True)) and wide.is_locked
    step = ftrain.make_step(torch.nn.Linear(2, 1).double(), lambda m, b: m(b["x"]).sum(), tx)
    assert step(wide, {"x": torch.ones(4, 2, dtype=torch.float64)})[0][
        "params", "weight"
    ].dtype == (torch.float64)


def test_place_moves_floats_keeps_integer_bookkeeping_and_layout():
    from ftrain.state import place

    state = init_state(torch.nn.Linear(2, 1), ftrain.optim.adamw(1e-3), seed=0)
    placed = place(state, "meta")  # any device will do; meta needs no memory
    assert placed["params"]["weight"].device.type == "meta"
    assert placed["step"].device.type == "cpu" and placed["rng"].device.type == "cpu"
    assert placed["opt"]["scale_by_adam"]["count"].device.type == "cpu"
    assert "add_decayed_weights" in placed["opt"].keys() and placed.is_locked


def test_pins_nest_and_belong_to_the_object_not_its_values():
    from ftrain.state import check_usable, is_pinned, mark_donated, pin, unpin

    state = init_state(torch.nn.Linear(2, 1), ftrain.optim.sgd(0.1), seed=0)
    pin(state)
    pin(state)
    unpin(state)
    assert is_pinned(state) and not is_pinned(state.clone())
    unpin(state)
    unpin(state)  # an extra release is a no-op
    assert not is_pinned(state)
    mark_donated(state)
    check_usable(state.clone())  # a copy of the values is a fresh, usable state
    with pytest.raises(RuntimeError, match="donated"):
        check_usable(state)
