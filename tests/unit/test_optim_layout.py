"""Tests for ftrain.optim: state layouts, masks, norms and argument errors."""

from __future__ import annotations

import re

import pytest
import torch
from tensordict import TensorDict

from ftrain import optim
from ftrain.optim import masks

from .test_optim import WARMUP_COSINE, decay_table, leaves_of, make_grads, make_params

# ----------------------------------------------------------------------------- layouts


def test_adamw_state_layout():
    params = make_params()
    state = optim.adamw(1e-3).init(params)
    assert set(state.keys()) == {"scale_by_adam", "add_decayed_weights", "scale_by_learning_rate"}
    adam = state["scale_by_adam"]
    assert set(adam.keys()) == {"count", "mu", "nu"}
    for count in (adam["count"], state["scale_by_learning_rate", "count"]):
        assert count.dtype == torch.int64 and count.ndim == 0 and count.device.type == "cpu"
    assert optim.flatten(adam["mu"])[0] == optim.flatten(params)[0]
    assert adam["mu", "h", "0", "attn", "weight"].shape == (6, 4)
    assert len(list(state["add_decayed_weights"].keys())) == 0


def test_sgd_state_layout():
    params = make_params()
    assert set(optim.sgd(0.1).init(params).keys()) == {"scale_by_learning_rate"}
    state = optim.sgd(0.1, momentum=0.9, weight_decay=0.1).init(params)
    assert list(state.keys()) == ["add_decayed_weights", "trace", "scale_by_learning_rate"]
    assert optim.flatten(state["trace", "trace"])[0] == optim.flatten(params)[0]


def test_chain_dedupes_names_and_nests():
    tx = optim.chain(optim.scale(2.0), optim.scale(3.0), optim.chain(optim.scale(1.0)))
    state = tx.init(make_params())
    assert list(state.keys()) == ["scale", "scale_1", "chain"]
    assert list(state["chain"].keys()) == ["scale"]


def test_update_rejects_a_state_from_another_tree():
    tx = optim.adam(1e-3)
    params = make_params()
    other = params.exclude("scalar")
    with pytest.raises(ValueError, match="'scalar'|leaves expected"):
        tx.update(make_grads(0), tx.init(other), params)
    with pytest.raises(ValueError, match="params does not match"):
        tx.update(make_grads(0), tx.init(params), other)
    with pytest.raises(ValueError, match="no entry 'scale_by_adam'"):
        tx.update(make_grads(0), optim.sgd(0.1).init(params), params)
    with pytest.raises(TypeError, match="TensorDict"):
        tx.update({"w": torch.ones(1)}, tx.init(params), params)


def test_add_decayed_weights_needs_params():
    tx = optim.adamw(1e-3)
    params = make_params()
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update(make_grads(0), tx.init(params), None)


def test_empty_tree():
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3), optim.trace(0.9))
    empty = TensorDict(batch_size=[])
    state = tx.init(empty)
    updates, state = tx.update(empty, state, empty)
    assert len(list(updates.keys(include_nested=True, leaves_only=True))) == 0
    assert int(state["adamw", "scale_by_adam", "count"]) == 1
    assert optim.global_norm(empty) == 0


# ----------------------------------------------------------------------------- masks & norms


def test_masks_select_the_right_paths():
    params = make_params()
    keys, leaves = optim.flatten(params)
    picked = lambda m: {optim.path_str(keys[i]) for i in masks.resolve(m, keys, leaves)}  # noqa: E731
    assert picked(masks.ndim_at_least(2)) == {"h.0.attn.weight", "h.1.attn.weight", "wte.weight"}
    assert picked(masks.exclude("ln_", "wte", "h.1")) == {
        "h.0.attn.bias",
        "h.0.attn.weight",
        "scalar",
        "double",
    }
    both = masks.all_of(masks.ndim_at_least(2), masks.exclude("wte"))
    assert picked(both) == {"h.0.attn.weight", "h.1.attn.weight"}
    table = masks.to_predicate(decay_table())
    assert picked(table) == {"h.0.attn.weight", "h.1.attn.weight"}


def test_masked_decay_touches_only_selected_leaves():
    params = make_params()
    tx = optim.add_decayed_weights(0.5, masks.ndim_at_least(2))
    grads = make_grads(0)
    updates, _ = tx.update(grads, tx.init(params), params)
    for k, u, g, p in zip(
        *optim.flatten(updates), leaves_of(grads), leaves_of(params), strict=True
    ):
        expected = g + 0.5 * p if p.ndim >= 2 else g
        assert torch.equal(u, expected), optim.path_str(k)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: masks.ndim_at_least(-1), "n=-1"),
        (lambda: masks.exclude(), "substrings=()"),
        (lambda: masks.exclude(""), "substrings=('',)"),
        (lambda: masks.all_of(), "predicates=()"),
        (
            lambda: optim.add_decayed_weights(0.1, mask=TensorDict({"w": torch.ones(2)})),
            "single booleans",
        ),
    ],
)
def test_mask_errors(make, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        make()


def test_td_mask_missing_path_is_named():
    params = make_params()
    tx = optim.add_decayed_weights(0.1, TensorDict({"wte": {"weight": torch.tensor(True)}}))
    with pytest.raises(ValueError, match="no entry for parameter 'double'"):
        tx.update(make_grads(0), tx.init(params), params)


def test_global_norm_and_clip_match_torch():
    grads = make_grads(0)
    flat = [torch.nn.Parameter(torch.zeros_like(t)) for t in leaves_of(grads)]
    for p, g in zip(flat, leaves_of(grads), strict=True):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(flat, 0.5, foreach=True)
    # mixed fp32/fp64 leaves: the norm is promoted to fp64
    assert optim.global_norm(grads).dtype == torch.float64
    assert torch.allclose(optim.global_norm(grads).float(), norm.float(), rtol=1e-6)
    tx = optim.clip_by_global_norm_torch(0.5)
    clipped, _ = tx.update(grads, tx.init(grads))
    for ours, theirs in zip(leaves_of(clipped), flat, strict=True):
        torch.testing.assert_close(ours, theirs.grad, rtol=1e-6, atol=0)
    assert torch.allclose(optim.global_norm(clipped).float(), torch.tensor(0.5), rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clip_by_global_norm_is_optax_rule_in_the_leaves_dtype(dtype):
    grads = make_grads(0).apply(lambda t: t.to(dtype))  # one dtype for every leaf
    norm = optim.global_norm(grads)
    assert norm.dtype == dtype  # an fp64 model gets an fp64 norm, not a float32 one
    tx = optim.clip_by_global_norm(0.5)
    clipped, _ = tx.update(grads, tx.init(grads))
    for ours, g in zip(leaves_of(clipped), leaves_of(grads), strict=True):
        assert ours.dtype == dtype
        assert torch.equal(ours, g * (0.5 / norm))  # max_norm / max(norm, max_norm), no 1e-6
    tol = 1e-15 if dtype == torch.float64 else 1e-6
    assert abs(float(optim.global_norm(clipped)) - 0.5) < tol
    within, _ = optim.clip_by_global_norm(float(norm) * 2).update(grads, tx.init(grads))
    assert all(torch.equal(a, b) for a, b in zip(leaves_of(within), leaves_of(grads), strict=True))


def test_update_runs_without_host_sync():
    """On the meta device any .item() or host read raises: the device path never syncs."""
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(WARMUP_COSINE, weight_decay=0.1))
    params = make_params().to("meta")
    state = tx.init(make_params()).to("meta")  # counts on the accelerator, e.g. after .to(device)
    updates, state = tx.update(make_grads(0).to("meta"), state, params)
    assert all(t.device.type == "meta" for t in leaves_of(updates))
    updates, state = tx.update(make_grads(0).to("meta"), state, params)
    assert optim.tree_get(state, ("scale_by_adam", "count")).device.type == "meta"


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: optim.scale_by_adam(b1=1.0), "b1=1.0"),
        (lambda: optim.scale_by_adam(b2=-0.1), "b2=-0.1"),
        (lambda: optim.scale_by_adam(eps=float("nan")), "eps=nan"),
        (lambda: optim.add_decayed_weights(-1.0), "weight_decay=-1.0"),
        (lambda: optim.scale_by_learning_rate(-0.1), "learning_rate=-0.1"),
        (lambda: optim.scale(float("inf")), "factor=inf"),
        (lambda: optim.clip_by_global_norm(0.0), "max_norm=0.0"),
        (lambda: optim.trace(-0.5), "decay=-0.5"),
        (lambda: optim.trace(0.0, nesterov=True), "decay=0.0"),
        (lambda: optim.sgd(0.1, nesterov=True), "momentum=0.0"),
        # a momentum of 1 or more diverges (accepted until 2026-12-07; torch checks only >= 0)
        (lambda: optim.trace(2.0), r"decay < 1 .*got decay=2.0"),
        (lambda: optim.sgd(0.1, momentum=1.5), r"sgd requires momentum < 1 .*momentum=1.5"),
        (lambda: optim.sgd(0.1, momentum=1.0), r"sgd requires momentum < 1 .*momentum=1.0"),
        (lambda: optim.sgd(0.1, momentum=-0.1), "sgd requires momentum >= 0.0"),
        (lambda: optim.adamw(0.1, weight_decay=-0.1), "weight_decay=-0.1"),
    ],
)
def test_bad_hyperparameters_are_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_types():
    with pytest.raises(TypeError, match="learning_rate"):
        optim.scale_by_learning_rate("0.1")
    with pytest.raises(TypeError, match="chain member 1"):
        optim.chain(optim.scale(1.0), lambda u: u)
    with pytest.raises(TypeError, match="mask"):
        optim.add_decayed_weights(0.1, mask=3)


def test_the_norm_of_the_same_unmodified_tensors_is_computed_once(monkeypatch):
    from ftrain.optim.processing import global_norm_of, remembered_norms

    calls = []
    real = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    grads = [torch.full((3,), 2.0), torch.ones(4)]
    with remembered_norms():  # the library's step, from its metric to its update
        first = global_norm_of(grads)  # e.g. the step's grad_norm metric
        tx = optim.clip_by_global_norm(1.0)
        keys = [("a",), ("b",)]
        out, _ = tx.update.flat(keys, grads, tx.init(TensorDict()), None)
        assert len(calls) == 1 and float(first) == 4.0
        assert torch.equal(out[0], grads[0] / 4.0)
        grads[0].mul_(2)  # modified in place: computed again
        assert float(global_norm_of(grads)) == pytest.approx(52**0.5) and len(calls) == 2
        assert float(global_norm_of([t.clone() for t in grads])) == pytest.approx(52**0.5)
        assert len(calls) == 3  # other tensors, same values: no identity, no reuse
    global_norm_of(grads)
    global_norm_of(grads)
    assert len(calls) == 5  # outside the step nothing is remembered (.data writes, all_reduce)


def test_a_mask_predicate_of_the_wrong_shape_is_named():
    """A one-argument lambda failed with Python's own arity error from inside the masks
    module; a predicate answering "no" selected the leaf (a string is truthy)."""
    params = TensorDict({"b": torch.zeros(2), "w": torch.zeros(2, 2)}, [])
    for mask, said in (
        (lambda path: True, r"a mask predicate takes \(path, tensor\) and returns a bool"),
        (lambda path, t: "no", "a mask predicate must return a bool, .* returned 'no' for 'b'"),
    ):
        tx = optim.adamw(1e-3, weight_decay=0.1, mask=mask)
        with pytest.raises(TypeError, match=said):
            tx.update(params.clone(), tx.init(params), params)
    picked = masks.resolve(
        lambda path, t: re.search("w", path), [("b",), ("w",)], [*params.values()]
    )
    assert picked == [1]  # a truthy answer other than a string still selects
