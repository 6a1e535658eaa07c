"""Tests for ftrain.optim: numerics against torch.optim, and the transform contract."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch.func import functional_call

from ftrain import optim
from ftrain.optim import masks, schedule

STEPS = 100
PEAK = 3e-3

# ----------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls run ~10x faster single-threaded on a shared 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)  # test-only: library code never touches the global RNG
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.Tanh(),
        torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32)),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )
    return model.to(dtype)


def make_data(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, 16, 8, generator=g, dtype=dtype)
    y = torch.randn(STEPS, 16, 4, generator=g, dtype=dtype)
    return list(zip(x, y, strict=True))


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


def grads_of(model, params: TensorDict, x, y) -> TensorDict:
    """Gradients w.r.t. detached leaves via a functional call (the model is not mutated)."""
    keys, leaves = optim.flatten(params)
    leaves = [t.detach().requires_grad_() for t in leaves]
    named = {optim.path_str(k): t for k, t in zip(keys, leaves, strict=True)}
    loss = loss_of(functional_call(model, named, (x,)), y)
    # Rebuild in reverse insertion order: the optimizer must not depend on key order.
    grads = torch.autograd.grad(loss, leaves)
    return optim.unflatten(keys[::-1], grads[::-1])


def run_ftrain(tx, dtype=torch.float32) -> TensorDict:
    model = make_model(dtype)
    params = TensorDict.from_module(model).detach().clone()
    state = tx.init(params)
    for x, y in make_data(dtype):
        updates, state = tx.update(grads_of(model, params, x, y), state, params)
        params = params + updates
    return params


def run_torch(make_opt, dtype=torch.float32, *, lr_lambda=None, clip=None) -> TensorDict:
    model = make_model(dtype)
    opt = make_opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    for x, y in make_data(dtype):
        opt.zero_grad()
        loss_of(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
    return TensorDict.from_module(model).detach().clone()


def rel_err(a: TensorDict, b: TensorDict) -> float:
    """||a - b|| / ||b|| over the whole parameter vector (all leaves concatenated)."""
    ka, la = optim.flatten(a)
    kb, lb = optim.flatten(b)
    assert ka == kb
    va = torch.cat([t.double().flatten() for t in la])
    vb = torch.cat([t.double().flatten() for t in lb])
    return ((va - vb).norm() / vb.norm()).item()


def leaf_rel_err(a: TensorDict, b: TensorDict) -> float:
    """The worst per-leaf relative error."""
    pairs = zip(optim.flatten(a)[1], optim.flatten(b)[1], strict=True)
    return max(((x - y).double().norm() / y.double().norm()).item() for x, y in pairs)


def assert_matches_torch(ours: TensorDict, theirs: TensorDict) -> None:
    """fp32: whole-vector relative error <= 1e-6. fp64: every leaf within 1e-12.

    fp64 shows the algorithms are the same (any formula slip shows up at 1e-4 or worse);
    fp32 bounds the rounding drift over 100 steps. Much of that drift is torch's: it rounds
    AdamW's decay factor ``1 - lr * wd`` to fp32 on every step, a bias that compounds (our
    fp32 run lands ~5x closer to the fp64 trajectory than torch's does), so tests with a
    constant rate pick ``lr * wd`` with ``1 - lr * wd`` exact in fp32. torch's own fused and
    foreach SGD differ by ~1e-6 on single small leaves, so the fp32 bound is on the whole
    parameter vector.
    """
    dtype = optim.flatten(theirs)[1][0].dtype
    start = TensorDict.from_module(make_model(dtype)).detach()
    assert rel_err(start, theirs) > 1e-2, "params barely moved: the comparison is vacuous"
    if dtype == torch.float64:
        err = leaf_rel_err(ours, theirs)
        assert err <= 1e-12, f"fp64 per-leaf relative error {err:.3g} vs torch.optim"
    else:
        err = rel_err(ours, theirs)
        assert err <= 1e-6, f"fp32 relative error {err:.3g} vs torch.optim"


def two_d(model):
    return [p for p in model.parameters() if p.ndim >= 2]


def one_d(model):
    return [p for p in model.parameters() if p.ndim < 2]


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])

# ----------------------------------------------------------------------------- equivalence

WARMUP_COSINE = schedule.warmup_cosine(PEAK, warmup_steps=10, decay_steps=STEPS, end=PEAK / 10)


def lr_lambda(step: int) -> float:
    return float(WARMUP_COSINE(step)) / PEAK


@DTYPES
def test_adamw_warmup_cosine_matches_torch(dtype):
    tx = optim.adamw(WARMUP_COSINE, b1=0.8, b2=0.95, eps=1e-7, weight_decay=0.1)
    ours = run_ftrain(tx, dtype)
    theirs = run_torch(
        lambda m: torch.optim.AdamW(
            m.parameters(), lr=PEAK, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1, foreach=True
        ),
        dtype,
        lr_lambda=lr_lambda,
    )
    assert_matches_torch(ours, theirs)


@DTYPES
def test_adamw_mask_matches_torch_param_groups(dtype):
    lr, wd = 2**-9, 0.5  # 1 - lr * wd is exact in fp32: see assert_matches_torch
    ours = run_ftrain(optim.adamw(lr, weight_decay=wd, mask=masks.ndim_at_least(2)), dtype)
    theirs = run_torch(
        lambda m: torch.optim.AdamW(
            [{"params": two_d(m)}, {"params": one_d(m), "weight_decay": 0.0}],
            lr=lr,
            weight_decay=wd,
            foreach=True,
        ),
        dtype,
    )
    assert_matches_torch(ours, theirs)
    # and the mask matters: decaying everything lands far away
    assert rel_err(run_ftrain(optim.adamw(lr, weight_decay=wd), dtype), theirs) > 1e-3


@DTYPES
def test_adam_matches_torch(dtype):
    ours = run_ftrain(optim.adam(PEAK, b2=0.99), dtype)
    theirs = run_torch(
        lambda m: torch.optim.Adam(m.parameters(), lr=PEAK, betas=(0.9, 0.99), foreach=True), dtype
    )
    assert_matches_torch(ours, theirs)


@DTYPES
@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_fused_adamw_matches_torch(dtype, kernel):
    """``fused=True`` (torch's fused Adam kernel) is within the same bounds of torch's fused
    AdamW and of its foreach AdamW as the foreach chain is."""
    lr, wd = 2**-9, 2**-3  # 1 - lr * wd is exact in fp32: see assert_matches_torch
    ours = run_ftrain(optim.adamw(lr, b2=0.95, weight_decay=wd, fused=True), dtype)
    theirs = run_torch(
        lambda m: torch.optim.AdamW(
            m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=wd, **{kernel: True}
        ),
        dtype,
    )
    assert_matches_torch(ours, theirs)


def _assert_rounding_close(got: TensorDict, want: TensorDict) -> None:
    """Equal up to rounding: a few ulps of fp32 / fp64, leaf by leaf."""
    for k, a, b in zip(*optim.flatten(got), optim.flatten(want)[1], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, optim.path_str(k)
        tol = 1e-6 if a.dtype == torch.float32 else 1e-14
        assert torch.allclose(a, b, rtol=tol, atol=0), optim.path_str(k)


def test_fused_adam_is_the_foreach_formula_and_keeps_the_input_state():
    params = make_params()  # fp32 and fp64 leaves: one kernel call per dtype
    fused, plain = optim.scale_by_adam(fused=True), optim.scale_by_adam()
    state = fused.init(params)
    for seed in range(3):
        snapshot = state.clone()
        got, new = fused.update(make_grads(seed), state, params)
        want, ref = plain.update(make_grads(seed), state, params)
        assert (state == snapshot).all(), "the pure update wrote into its input state"
        assert int(new["count"]) == int(ref["count"]) == seed + 1
        _assert_rounding_close(got, want)
        _assert_rounding_close(new.exclude("count"), ref.exclude("count"))
        state = new


def test_fused_adam_runs_bf16_leaves_in_fp32_inside_the_kernel():
    g = torch.Generator().manual_seed(3)
    p32 = TensorDict(w=torch.randn(64, generator=g))
    grads = [torch.randn(64, generator=g) for _ in range(5)]
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        tx = optim.scale_by_adam(fused=True)
        params = p32.to(dtype)
        state = tx.init(params)
        for grad in grads:
            u, state = tx.update(TensorDict(w=grad.to(dtype)), state, params)
        assert u["w"].dtype == dtype
        runs[dtype] = u["w"].float()
    assert torch.allclose(runs[torch.bfloat16], runs[torch.float32], rtol=2e-2, atol=1e-2)


@DTYPES
def test_clip_then_adamw_matches_clip_grad_norm(dtype):
    lr, wd = 2**-9, 2**-3  # 1 - lr * wd is exact in fp32: see assert_matches_torch
    tx = optim.chain(optim.clip_by_global_norm_torch(0.05), optim.adamw(lr, weight_decay=wd))
    ours = run_ftrain(tx, dtype)
    theirs = run_torch(
        lambda m: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd, foreach=True),
        dtype,
        clip=0.05,
    )
    assert_matches_torch(ours, theirs)


@pytest.mark.parametrize("write", ["data", "numpy"])
def test_clip_reads_gradients_written_behind_autograd(write):
    # a user's step logs the norm, then sums gradients in place the way dist.all_reduce
    # does (no version bump); the clip must see the new values, not a remembered norm
    g = TensorDict({"w": torch.full((4,), 1.0)}, batch_size=[])
    assert float(optim.global_norm(g)) == 2.0
    if write == "data":
        g["w"].data.mul_(10.0)
    else:
        g["w"].numpy()[:] = 10.0
    assert float(optim.global_norm(g)) == 20.0
    tx = optim.clip_by_global_norm(1.0)
    u, _ = tx.update(g, tx.init(g))
    assert u["w"].norm().item() == pytest.approx(1.0)


@DTYPES
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"momentum": 0.9},
        {"momentum": 0.9, "nesterov": True},
        {"momentum": 0.9, "weight_decay": 1e-2},
        {"momentum": 0.8, "nesterov": True, "weight_decay": 1e-2},
        {"weight_decay": 1e-2},
    ],
    ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "plain",
)
def test_sgd_matches_torch(kwargs, dtype):
    ours = run_ftrain(optim.sgd(0.05, **kwargs), dtype)
    theirs = run_torch(
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, foreach=True, **kwargs), dtype
    )
    assert_matches_torch(ours, theirs)


@DTYPES
def test_sgd_schedule_matches_lambda_lr(dtype):
    sched = schedule.cosine_decay(0.1, decay_steps=STEPS, alpha=0.1)
    ours = run_ftrain(optim.sgd(sched, momentum=0.9), dtype)
    theirs = run_torch(
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=True),
        dtype,
        lr_lambda=lambda s: float(sched(s)) / 0.1,
    )
    assert_matches_torch(ours, theirs)


# ----------------------------------------------------------------------------- contract


def make_params() -> TensorDict:
    g = torch.Generator().manual_seed(2)

    def block():
        return {
            "attn": {"weight": torch.randn(6, 4, generator=g), "bias": torch.randn(6, generator=g)}
        }

    return TensorDict(
        {
            "h": {"0": block(), "1": block()},
            "wte": {"weight": torch.randn(10, 4, generator=g)},
            "ln_f": {"weight": torch.ones(4), "bias": torch.zeros(4)},
            "scalar": torch.tensor(0.5),
            "double": torch.randn(3, dtype=torch.float64, generator=g),
        },
        batch_size=[],
    )


def make_grads(seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(100 + seed)
    keys, leaves = optim.flatten(make_params())
    grads = [torch.randn(t.shape, dtype=t.dtype, generator=g) for t in leaves]
    return optim.unflatten(keys[::-1], grads[::-1])  # different insertion order than params


def decay_table() -> TensorDict:
    keys, leaves = optim.flatten(make_params())
    return optim.unflatten(
        keys, [torch.tensor(k[0] == "h" and t.ndim == 2) for k, t in zip(keys, leaves, strict=True)]
    )


def user_negate() -> optim.GradientTransformation:
    """A user transform with a plain TensorDict update function (not a FlatUpdate)."""

    def init(params):
        return TensorDict({"calls": torch.zeros((), dtype=torch.int64)}, batch_size=[])

    def update(updates, state, params=None):
        return updates.apply(torch.neg), TensorDict({"calls": state["calls"] + 1}, batch_size=[])

    return optim.GradientTransformation(init, update)


TRANSFORMS = {
    "scale_by_adam": lambda: optim.scale_by_adam(),
    "scale_by_adam_fused": lambda: optim.scale_by_adam(fused=True),
    "add_decayed_weights": lambda: optim.add_decayed_weights(0.1),
    "add_decayed_weights_ndim_mask": lambda: optim.add_decayed_weights(0.1, masks.ndim_at_least(2)),
    "add_decayed_weights_exclude_mask": lambda: optim.add_decayed_weights(
        0.1, masks.exclude("ln_", "wte")
    ),
    "add_decayed_weights_td_mask": lambda: optim.add_decayed_weights(0.1, decay_table()),
    "scale_by_learning_rate": lambda: optim.scale_by_learning_rate(0.1),
    "scale_by_learning_rate_schedule": lambda: optim.scale_by_learning_rate(
        schedule.linear(0.1, 0.0, 4)
    ),
    "scale": lambda: optim.scale(-0.5),
    "clip_by_global_norm": lambda: optim.clip_by_global_norm(0.1),
    "clip_by_global_norm_noop": lambda: optim.clip_by_global_norm(1e6),
    "clip_by_global_norm_torch": lambda: optim.clip_by_global_norm_torch(0.1),
    "dynamic_loss_scale": lambda: optim.dynamic_loss_scale(optim.adamw(1e-2), init_scale=4.0),
    "trace": lambda: optim.trace(0.9),
    "trace_nesterov": lambda: optim.trace(0.9, nesterov=True),
    "chain_empty": lambda: optim.chain(),
    "chain_nested": lambda: optim.chain(
        optim.clip_by_global_norm(1.0), optim.chain(optim.scale(2.0), optim.scale(0.5))
    ),
    "chain_generic": lambda: optim.chain(user_negate(), optim.scale_by_adam(), optim.scale(2.0)),
    "sgd": lambda: optim.sgd(0.1),
    "sgd_momentum_wd": lambda: optim.sgd(0.1, momentum=0.9, weight_decay=1e-2),
    "sgd_nesterov": lambda: optim.sgd(schedule.constant(0.1), momentum=0.9, nesterov=True),
    "adam": lambda: optim.adam(1e-2),
    "adamw": lambda: optim.adamw(WARMUP_COSINE, weight_decay=0.1),
    "adamw_masked": lambda: optim.adamw(1e-2, weight_decay=0.1, mask=masks.ndim_at_least(2)),
    "adamw_fused": lambda: optim.adamw(WARMUP_COSINE, weight_decay=0.1, fused=True),
}


def leaves_of(td: TensorDict) -> list[torch.Tensor]:
    return optim.flatten(td)[1]


def assert_trees_equal(a: TensorDict, b: TensorDict, what: str) -> None:
    ka, la = optim.flatten(a)
    kb, lb = optim.flatten(b)
    assert ka == kb, f"{what}: different keys"
    for k, x, y in zip(ka, la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device, (what, k)
        assert torch.equal(x, y), f"{what}: {optim.path_str(k)} differs"


def assert_same_structure(out: TensorDict, ref: TensorDict) -> None:
    ko, lo = optim.flatten(out)
    kr, lr = optim.flatten(ref)
    assert ko == kr
    for x, y in zip(lo, lr, strict=True):
        assert (x.shape, x.dtype, x.device) == (y.shape, y.dtype, y.device)
        assert torch.isfinite(x).all()


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_transform_contract(name):
    tx = TRANSFORMS[name]()
    params = make_params()
    state = tx.init(params)
    assert isinstance(state, TensorDict) and state.batch_size == torch.Size([])
    assert all(isinstance(t, torch.Tensor) for t in leaves_of(state))
    for step in range(3):
        grads = make_grads(step)
        snapshot = [t.clone() for t in (grads, state, params)]

        updates, new_state = tx.update(grads, state, params)

        # pure: no input leaf changed, bit for bit
        for before, after, what in zip(
            snapshot, (grads, state, params), ("updates", "state", "params"), strict=True
        ):
            assert_trees_equal(after, before, f"{name} mutated its {what} at step {step}")
        assert_same_structure(updates, grads)
        assert_same_structure(new_state, state)
        # deterministic: the same inputs give the same bits
        again, again_state = tx.update(grads, state, params)
        assert_trees_equal(again, updates, f"{name} updates")
        assert_trees_equal(again_state, new_state, f"{name} state")
        state = new_state


LR_CASES = {
    "scale_by_learning_rate": (lambda: optim.scale_by_learning_rate(0.3), lambda: optim.chain()),
    "schedule": (
        lambda: optim.scale_by_learning_rate(schedule.linear(0.3, 0.1, 2)),
        lambda: optim.chain(),
    ),
    "adamw": (
        lambda: optim.adamw(WARMUP_COSINE, weight_decay=0.1),
        lambda: optim.chain(optim.scale_by_adam(), optim.add_decayed_weights(0.1)),
    ),
    "adam": (lambda: optim.adam(schedule.cosine_decay(0.1, 3)), lambda: optim.scale_by_adam()),
    "sgd": (
        lambda: optim.sgd(schedule.linear(0.2, 0.0, 3), momentum=0.9, weight_decay=0.1),
        lambda: optim.chain(optim.add_decayed_weights(0.1), optim.trace(0.9)),
    ),
}


@pytest.mark.parametrize("name", list(LR_CASES))
def test_lr_is_the_rate_applied(name):
    make_tx, make_base = LR_CASES[name]
    tx, base = make_tx(), make_base()
    params = make_params()
    state, base_state = tx.init(params), base.init(params)
    for step in range(5):
        lr = optim.tree_get(state, "learning_rate")
        assert lr.dtype == torch.float64 and lr.ndim == 0
        grads = make_grads(step)
        updates, state = tx.update(grads, state, params)
        base_updates, base_state = base.update(grads, base_state, params)
        factor = -lr.item()  # a Python double, as the foreach kernels receive it
        expected = base_updates.apply(lambda t, f=factor: t * f)
        assert_trees_equal(updates, expected, f"{name} step {step}")


def test_lr_follows_the_schedule_from_the_state_alone():
    tx = optim.adamw(WARMUP_COSINE)
    params = make_params()
    state = tx.init(params)
    for step in range(12):
        assert torch.equal(optim.tree_get(state, "learning_rate"), WARMUP_COSINE(step))
        state = tx.update(make_grads(step), state, params)[1]
    restored = state.clone()  # e.g. read back from a checkpoint
    assert torch.equal(optim.tree_get(restored, "learning_rate"), WARMUP_COSINE(12))
    no_rate = optim.chain(optim.scale_by_adam()).init(params)
    assert optim.tree_get(no_rate, "learning_rate", None) is None
    with pytest.raises(KeyError, match="learning_rate"):
        optim.tree_get(no_rate, "learning_rate")


def test_tree_get_finds_nested_hyperparameters_and_refuses_ambiguity():
    params = make_params()
    tx = optim.dynamic_loss_scale(optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.3)))
    state = tx.init(params)
    assert float(optim.tree_get(state, "learning_rate")) == 0.3
    assert float(optim.tree_get(state, ("loss_scale", "scale"))) == 2.0**16
    two = optim.chain(optim.sgd(0.1), optim.sgd(0.2)).init(params)
    with pytest.raises(ValueError, match="ambiguous"):
        optim.tree_get(two, "learning_rate")
    assert float(optim.tree_get(two, ("sgd_1", "scale_by_learning_rate", "learning_rate"))) == 0.2


def test_leaf_get_on_a_flattened_state_matches_tree_get():
    from ftrain.optim.base import leaf_get
    from ftrain.state.tree import flatten

    params = make_params()
    tx = optim.dynamic_loss_scale(optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.3)))
    keys, leaves = flatten(tx.init(params))
    assert float(leaf_get(keys, leaves, "learning_rate")) == 0.3
    assert float(leaf_get(keys, leaves, ("loss_scale", "scale"))) == 2.0**16
    assert leaf_get(keys, leaves, "no_such_entry", None) is None
    with pytest.raises(KeyError, match="no_such_entry"):
        leaf_get(keys, leaves, "no_such_entry")
    two = flatten(optim.chain(optim.sgd(0.1), optim.sgd(0.2)).init(params))
    with pytest.raises(ValueError, match="ambiguous"):
        leaf_get(*two, "learning_rate")
    assert float(leaf_get(*two, ("sgd_1", "scale_by_learning_rate", "learning_rate"))) == 0.2


def _stepped(tx, params, n=5):
    state = tx.init(params)
    for _ in range(n):
        _, state = tx.update(params.apply(torch.ones_like), state, params)
    return state


@pytest.mark.parametrize("kind", ["adamw", "adamw_fused", "chain", "groups", "loss_scale", "sgd"])
def test_refresh_hyperparams_shows_the_current_schedules_rate(kind):
    """After a resume with another schedule the shown ``learning_rate`` leaves are the new
    schedule's at the restored count; every other leaf is the same tensor; with the same
    schedule nothing changes."""
    params = TensorDict({"w": torch.ones(3, 2), "head": {"b": torch.zeros(2)}}, [])

    def make(decay):
        lr = schedule.warmup_cosine(1e-2, 2, decay)
        return {
            "adamw": lambda: optim.adamw(lr),
            "adamw_fused": lambda: optim.adamw(lr, fused=True),
            "chain": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adam(lr)),
            "groups": lambda: optim.multi_transform(
                {
                    "head": optim.sgd(schedule.warmup_cosine(5e-3, 2, decay)),
                    "body": optim.adamw(lr),
                },
                {"head": masks.glob("head.*"), "body": None},
            ),
            "loss_scale": lambda: optim.dynamic_loss_scale(optim.adamw(lr)),
            "sgd": lambda: optim.sgd(lr),
        }[kind]()

    old = _stepped(make(12), params)
    same = optim.refresh_hyperparams(make(12), old)
    new = optim.refresh_hyperparams(make(40), old)
    rates_old, rates_new = optim.learning_rates(old), optim.learning_rates(new)
    assert rates_old and set(rates_old) == set(rates_new)
    for path, rate in optim.learning_rates(same).items():
        assert torch.equal(rate, rates_old[path]), path
    want = float(schedule.warmup_cosine(1e-2, 2, 40)(torch.tensor(5)))
    got = sorted(float(r) for r in rates_new.values())
    assert got[-1] == pytest.approx(want, rel=1e-12) and got[-1] != float(max(rates_old.values()))
    kept_old = {k: v for k, v in zip(*optim.flatten(old), strict=True) if k[-1] != "learning_rate"}
    kept_new = {k: v for k, v in zip(*optim.flatten(new), strict=True) if k[-1] != "learning_rate"}
    assert kept_old.keys() == kept_new.keys()
    assert all(kept_new[k] is v for k, v in kept_old.items())  # shared, not copied


def test_dynamic_loss_scale_updates_meta_tensors_so_the_compiled_step_warms_its_caches():
    """The compiled step runs ``tx.update`` once on meta tensors to fill per-structure caches
    (the weight-decay mask) before tracing; ``dynamic_loss_scale`` read its skip flag on the
    host (``bool`` of a meta tensor raises), the warm-up gave up, and every fp16 compiled
    run with a mask (the CLI's adamw, LoRA, freeze, groups) compiled twice, the second
    time reported as a recompile at step 2."""
    tx = optim.dynamic_loss_scale(
        optim.adamw(1e-3, weight_decay=0.1, mask=masks.ndim_at_least(2)), init_scale=4.0
    )
    params = TensorDict({"w": torch.ones(3, 2), "b": torch.ones(2)}, [])
    meta = params.to("meta")
    updates, state = tx.update(meta.apply(torch.zeros_like), tx.init(params).to("meta"), meta)
    assert updates["w"].is_meta and updates["w"].shape == (3, 2)
    assert state["loss_scale", "scale"].is_meta
