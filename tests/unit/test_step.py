import re

import pytest
import torch
from tensordict import TensorDict

import ftrain
from ftrain.nn import Dropout
from ftrain.state import first_difference, init_state, tree_equal
from ftrain.step import evaluate, make_eval_step, make_step


def _model(seed=0, p=0.0):
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Tanh(), Dropout(p), torch.nn.Linear(16, 2)
    )
    with torch.no_grad():
        for prm in m.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * 0.3)
    return m


def _mse(m, b):
    return ((m(b["x"]) - b["y"]) ** 2).mean()


def _batch(i, n=8):
    g = torch.Generator().manual_seed(100 + i)
    return TensorDict(x=torch.randn(n, 4, generator=g), y=torch.randn(n, 2, generator=g))


def _tx():
    return ftrain.optim.adamw(ftrain.optim.schedule.warmup_cosine(1e-2, 3, 20), weight_decay=0.1)


def _clipped(max_norm, tx):
    return ftrain.optim.chain(ftrain.optim.clip_by_global_norm_torch(max_norm), tx)


def _loss_scaled(tx, scale):
    return ftrain.optim.dynamic_loss_scale(tx, init_scale=scale)


def test_step_is_pure_over_several_steps():
    model = _model(p=0.2)
    tx = ftrain.optim.chain(ftrain.optim.clip_by_global_norm(1.0), _tx())
    step = make_step(model, _mse, tx)
    state = init_state(model, tx, seed=0)
    for i in range(4):
        snapshot = state.clone()
        new, _ = step(state, _batch(i))
        assert tree_equal(state, snapshot), first_difference(state, snapshot)
        state = new
    assert int(state["step"]) == 4


def test_module_parameters_are_never_changed():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tx = _tx()
    state = init_state(model, tx, seed=0)
    make_step(model, _mse, tx)(state, _batch(0))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_recomputing_a_step_with_dropout_is_identical_and_keys_matter():
    model = _model(p=0.5)
    tx = _tx()
    step = make_step(model, _mse, tx)
    state = init_state(model, tx, seed=0)
    a, ma = step(state, _batch(0))
    b, mb = step(state, _batch(0))
    assert tree_equal(a, b) and float(ma["loss"]) == float(mb["loss"])
    other = init_state(model, tx, seed=1)
    c, mc = step(other, _batch(0))
    assert float(mc["loss"]) != float(ma["loss"]), "a different base key must change dropout"


def test_step_does_not_touch_global_rng():
    model = _model(p=0.5)
    tx = _tx()
    state = init_state(model, tx, seed=0)
    before = torch.get_rng_state()
    make_step(model, _mse, tx)(state, _batch(0))
    assert torch.equal(before, torch.get_rng_state())


def test_grad_accum_equals_one_step_on_the_whole_batch():
    model = _model()
    tx = ftrain.optim.sgd(0.1, momentum=0.9)
    state = init_state(model, tx, seed=0)
    whole, mw = make_step(model, _mse, tx)(state, _batch(0, n=8))
    accum, ma = make_step(model, _mse, tx, grad_accum=4)(state, _batch(0, n=8))
    torch.testing.assert_close(accum["params"], whole["params"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ma["loss"], mw["loss"])
    assert int(ma["samples"]) == 8


def test_grad_accum_rejects_indivisible_batch():
    model = _model()
    tx = _tx()
    state = init_state(model, tx, seed=0)
    with pytest.raises(ValueError, match="grad_accum=3"):
        make_step(model, _mse, tx, grad_accum=3)(state, _batch(0, n=8))


def test_matches_imperative_torch_loop_with_clipping():
    model = _model()
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    tx = _clipped(0.5, ftrain.optim.sgd(0.05, momentum=0.9))
    state = init_state(model, tx, seed=0)
    step = make_step(model, _mse, tx)
    for i in range(10):
        state, metrics = step(state, _batch(i))
        opt.zero_grad(set_to_none=True)
        _mse(ref, _batch(i)).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch.testing.assert_close(metrics["grad_norm"], norm)
        opt.step()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            state["params"][tuple(name.split("."))], p.detach(), rtol=1e-6, atol=1e-7
        )


def test_deprecated_clip_argument_is_the_torch_rule_transform():
    model = _model()
    tx = ftrain.optim.sgd(0.05, momentum=0.9)
    with pytest.warns(DeprecationWarning, match="clip_by_global_norm"):
        old = make_step(model, _mse, tx, clip=0.5)
    new = make_step(model, _mse, _clipped(0.5, tx))
    a = init_state(model, tx, seed=0)
    b = init_state(model, _clipped(0.5, tx), seed=0)
    for i in range(3):
        a, ma = old(a, _batch(i))
        b, mb = new(b, _batch(i))
        assert float(ma["grad_norm"]) == float(mb["grad_norm"])
    assert tree_equal(a["params"], b["params"])
    scaled = _loss_scaled(tx, 2.0**4)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="inside the loss"):
        make_step(model, _mse, scaled, clip=0.5)(init_state(model, scaled, seed=0), _batch(0))


def test_grad_norm_metric_is_of_the_unscaled_gradients():
    model = _model()
    plain, scaled = ftrain.optim.sgd(0.1), _loss_scaled(ftrain.optim.sgd(0.1), 2.0**8)
    _, m1 = make_step(model, _mse, plain)(init_state(model, plain, seed=0), _batch(0))
    state = init_state(model, scaled, seed=0)
    _, m2 = make_step(model, _mse, scaled)(state, _batch(0))  # fp32 with a loss scale
    torch.testing.assert_close(m2["grad_norm"], m1["grad_norm"])
    assert float(m2["lr"]) == 0.1


def test_cursor_in_batch_becomes_state_data():
    model = _model()
    tx = _tx()
    state = init_state(model, tx, seed=0)
    cursor = TensorDict(epoch=torch.tensor(0), position=torch.tensor(8))
    new, _ = make_step(model, _mse, tx)(state, _batch(0).set("cursor", cursor))
    assert int(new["data"]["position"]) == 8 and int(state["data"]["position"]) == 0


def test_donate_matches_pure_and_poisons_input():
    model = _model()
    tx = _tx()
    pure_state = init_state(model, tx, seed=0)
    donated_state = pure_state.clone()
    pure, donated = make_step(model, _mse, tx), make_step(model, _mse, tx, donate=True)
    for i in range(3):
        pure_state, _ = pure(pure_state, _batch(i))
        old = donated_state
        donated_state, _ = donated(donated_state, _batch(i))
    assert tree_equal(pure_state, donated_state)
    with pytest.raises(RuntimeError, match="donated"):
        donated(old, _batch(0))


def test_metrics_are_tensors_with_lr_of_this_update():
    model = _model()
    sched = ftrain.optim.schedule.warmup_cosine(1e-2, 3, 20)
    tx = ftrain.optim.adamw(sched)
    state = init_state(model, tx, seed=0)
    step = make_step(model, _mse, tx)
    lrs = []
    for i in range(4):
        state, m = step(state, _batch(i))
        assert set(m.keys()) >= {"loss", "grad_norm", "lr", "samples"}
        assert "tokens" not in m.keys(), "the loss counted no tokens: none are made up"
        lrs.append(float(m["lr"]))
    assert lrs == pytest.approx([float(sched(i)) for i in range(4)])


def test_fp16_loss_scaling_matches_gradscaler_and_skips_nonfinite():
    model = _model()
    # fp16 overflows: 2**24 * loss > 65504 forces a skip, as in GradScaler
    tx = _loss_scaled(ftrain.optim.sgd(0.1, momentum=0.9), 2.0**24)
    state = init_state(model, tx, seed=0, precision="fp16")
    step = make_step(model, _mse, tx, precision="fp16")
    new, _ = step(state, _batch(0))
    ls = new["opt", "loss_scale"]
    assert int(ls["skipped"]) == 1 and float(ls["scale"]) == 2.0**23
    assert int(new["step"]) == 1
    # skipped: params and the inner optimizer state bit-identical, only the counters moved
    assert tree_equal(new["params"], state["params"])
    assert tree_equal(new["opt", "inner"], state["opt", "inner"])

    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    for _ in range(1):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _mse(ref, _batch(0))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.get_scale() == float(new["opt", "loss_scale", "scale"])


def test_eval_does_not_disturb_state():
    model = _model(p=0.5)
    tx = _tx()
    state = init_state(model, tx, seed=0)
    snapshot = state.clone()
    ev = make_eval_step(model, _mse)
    out = evaluate(ev, state, [_batch(0), _batch(1)])
    assert tree_equal(state, snapshot)
    expected = (float(_mse(model.eval(), _batch(0))) + float(_mse(model, _batch(1)))) / 2
    assert out["loss"] == pytest.approx(expected, rel=1e-6)
    assert out["samples"] == 16


def test_bad_arguments():
    model = _model()
    tx = _tx()
    with pytest.raises(ValueError, match="grad_accum=0"):
        make_step(model, _mse, tx, grad_accum=0)
    with pytest.raises(ValueError, match="fp8"):
        make_step(model, _mse, tx, precision="fp8")
    with pytest.raises(ValueError, match="clip=-1"):
        make_step(model, _mse, tx, clip=-1)
    with pytest.raises(ValueError, match="dynamic_loss_scale"):
        init_state(model, tx, seed=0, precision="fp16")
    state = init_state(model, tx, seed=0)
    with pytest.raises(ValueError, match="dynamic_loss_scale"):
        make_step(model, _mse, tx, precision="fp16")(state, _batch(0))
    with pytest.raises(TypeError, match="scalar tensor"):
        make_step(model, lambda m, b: m(b["x"]), tx)(state, _batch(0))


def test_key_order_of_the_state_does_not_change_the_result():
    # Regression: a restored checkpoint lists keys in storage order, a live state in module
    # order; summing per-leaf grad norms in insertion order made a resumed run drift by ulps.
    model = _model()
    tx = _clipped(0.5, _tx())
    state = init_state(model, tx, seed=0)
    keys, leaves = ftrain.state.flatten(state["params"])
    reordered = TensorDict(
        {k: v for k, v in reversed(list(zip(keys, leaves, strict=True)))}, batch_size=[]
    )
    assert [k for k in reordered.keys(True, True)] != keys
    step = make_step(model, _mse, tx)
    a, b = state, ftrain.state.replace(state, params=reordered)
    for i in range(5):
        a, ma = step(a, _batch(i))
        b, mb = step(b, _batch(i))
        assert float(ma["grad_norm"]) == float(mb["grad_norm"])
    assert tree_equal(a, b)


def test_states_share_no_tensordict_nodes_so_locking_does_not_accumulate():
    # Locking a node that an earlier state already locked appends to its lock-parent list:
    # shared nodes made every step's lock_() (and memory) grow with the steps run.
    model = _model()
    tx = _tx()
    for donate in (False, True):
        state = init_state(model, tx, seed=0)
        step = make_step(model, _mse, tx, donate=donate)
        for i in range(5):
            old = state
            state, _ = step(state, _batch(i))
            for key in ("data", "buffers", "opt", "params"):
                assert state[key] is not old[key], (donate, key)
        assert state.is_locked and state["data"].is_locked
        assert len(state["data"]._lock_parents_weakrefs) <= 1


class _TiedAlias(torch.nn.Module):
    """nanoGPT-style tie: one Parameter registered under two names."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(5, 3, generator=g))
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.emb(x))


def _ce(m, b):
    return torch.nn.functional.cross_entropy(m(b["x"]), b["y"])


def test_tied_alias_is_one_leaf_trained_like_the_imperative_loop():
    model, ref = _TiedAlias(), _TiedAlias()
    tx = ftrain.optim.sgd(0.1)
    state = init_state(model, tx, seed=0)
    assert list(state["params"].keys(include_nested=True, leaves_only=True)) == [("emb", "weight")]
    step = make_step(model, _ce, tx)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batch = TensorDict(x=torch.tensor([0, 1, 2, 3]), y=torch.tensor([1, 2, 3, 4]))
    for _ in range(3):
        state, _ = step(state, batch)
        opt.zero_grad()
        _ce(ref, batch).backward()
        opt.step()
    torch.testing.assert_close(state["params"]["emb", "weight"], ref.emb.weight.detach())
    assert model.head.weight is model.emb.weight  # the module is left as it was


def test_train_mode_for_the_step_then_modes_restored():
    model = _model(p=0.5)
    model.eval()
    tx = _tx()
    step = make_step(model, _mse, tx)
    state = init_state(model, tx, seed=0)
    new, _ = step(state, _batch(0))
    assert not any(m.training for m in model.modules())
    model.train()
    again, _ = step(state, _batch(0))
    assert all(m.training for m in model.modules())
    assert tree_equal(new, again)  # dropout ran in both: the step forces train mode


def test_a_submodule_replaced_between_steps_is_bound_again():
    model = _model()
    tx = ftrain.optim.sgd(0.1)
    state = init_state(model, tx, seed=0)
    step = make_step(model, _mse, tx)
    state, _ = step(state, _batch(0))
    model[3] = torch.nn.Linear(16, 2)  # same names, new module object
    new, _ = step(state, _batch(1))
    assert not torch.equal(new["params"]["3", "weight"], state["params"]["3", "weight"])
    fresh, _ = make_step(_model(), _mse, tx)(state, _batch(1))
    assert tree_equal(new, fresh)


def test_donate_never_overwrites_a_state_pinned_by_a_reader():
    from ftrain.state import pin, unpin

    model = _model()
    tx = _tx()
    state = init_state(model, tx, seed=0)
    step = make_step(model, _mse, tx, donate=True)
    pin(state)  # e.g. an async checkpoint save still reading it
    snapshot = state.clone()
    new, _ = step(state, _batch(0))
    assert tree_equal(state, snapshot), "a pinned state must stay as it was"
    unpin(state)
    step(state, _batch(1))  # not donated, so still usable; now it is updated in place
    with pytest.raises(RuntimeError, match="donated"):
        step(state, _batch(2))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_loss_scale_inside_another_transform_is_refused(precision):
    """chain(clip, dynamic_loss_scale(sgd)): the step scaled the loss by the nested scale
    while the clip saw the scaled gradients, so updates came out ~1000x too small with no
    sign in the metrics (fp16 init_state said "needs dynamic loss scaling", make_step ran)."""
    model = _model()
    nested = ftrain.optim.chain(
        ftrain.optim.clip_by_global_norm(1.0), _loss_scaled(ftrain.optim.sgd(0.1), 2.0**10)
    )
    with pytest.raises(ValueError, match=r"outermost transform.*opt\.dynamic_loss_scale"):
        init_state(model, nested, seed=0, precision=precision)
    outer = _loss_scaled(ftrain.optim.chain(ftrain.optim.clip_by_global_norm(1.0), _tx()), 2.0**10)
    state = init_state(model, outer, seed=0, precision=precision)
    state = state.clone().unlock_()
    state["opt"] = nested.init(state["params"])  # a state made for the nested tx
    with pytest.raises(ValueError, match="outermost transform"):
        make_step(model, _mse, nested, precision=precision)(state, _batch(0))
    twice = _loss_scaled(_loss_scaled(_tx(), 2.0), 2.0)
    with pytest.raises(ValueError, match=r"opt\.inner\.loss_scale"):
        init_state(model, twice, seed=0, precision=precision)


def test_fp16_sequence_matches_gradscaler_with_a_skipped_overflow_step():
    model, ref = _model(), _model()
    tx = _loss_scaled(ftrain.optim.sgd(0.05, momentum=0.9), 2.0**10)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    state = init_state(model, tx, seed=0, precision="fp16")
    step = make_step(model, _mse, tx, precision="fp16")
    for i in range(6):
        batch = _batch(i)
        if i == 3:  # activations overflow fp16: both must skip this update
            batch = batch.clone().set("x", batch["x"] * 1e5)
        state, _ = step(state, batch)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _mse(ref, batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        assert float(state["opt", "loss_scale", "scale"]) == scaler.get_scale(), i
    assert int(state["opt", "loss_scale", "skipped"]) == 1
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            state["params"][tuple(name.split("."))], p.detach(), rtol=1e-5, atol=1e-6
        )


def test_a_state_of_another_model_is_refused_naming_the_paths():
    """A state of a smaller model trained the rest from the nn.Module itself (never
    updated, never saved), silently; a larger one failed deep inside torch.func."""
    big = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    small = torch.nn.Sequential(torch.nn.Linear(4, 4))
    tx = ftrain.optim.sgd(0.1)
    batch = {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}

    def loss(m, b):
        return ((m(b["x"])[:, :1] - b["y"]) ** 2).mean()

    with pytest.raises(ValueError, match=r"missing from the state \['1.bias', '1.weight'\]"):
        ftrain.make_step(big, loss, tx)(ftrain.init_state(small, tx, seed=0), batch)
    with pytest.raises(ValueError, match=r"not in the model \['1.bias', '1.weight'\]"):
        ftrain.make_step(small, loss, tx)(ftrain.init_state(big, tx, seed=0), batch)


def test_a_tied_alias_in_the_state_is_named_as_one():
    from ftrain.step import check_params_match

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    keys = [("emb", "weight"), ("head", "weight")]  # as TensorDict.from_module lists them
    with pytest.raises(ValueError, match="'head.weight' is a tied alias of 'emb.weight'"):
        check_params_match(Tied(), keys)
    assert check_params_match(Tied(), keys[:1])


def test_swapped_or_foreign_arguments_are_named():
    """init_state(tx, model), a torch.optim optimizer, a None loss: AttributeErrors from
    deep inside before."""
    model, tx = torch.nn.Linear(2, 1), ftrain.optim.sgd(0.1)
    with pytest.raises(TypeError, match=r"needs a torch.nn.Module as model, got .*swapped"):
        ftrain.init_state(tx, model, seed=0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"got torch.optim.sgd.SGD \(a torch.optim optimizer"):
        ftrain.init_state(model, sgd, seed=0)
    with pytest.raises(TypeError, match="make_step.*an ftrain.optim transformation as tx"):
        ftrain.make_step(model, lambda m, b: m(b).sum(), sgd)
    with pytest.raises(TypeError, match="loss_fn must be callable, got None"):
        ftrain.make_step(model, None, tx)
    with pytest.raises(ValueError, match=r"the model \(ReLU\) has no parameters"):
        ftrain.make_step(torch.nn.ReLU(), lambda m, b: m(b).sum(), tx)  # IndexError at step 1


def test_a_submodule_the_user_put_in_eval_mode_stays_so():
    """model.train(); bn.eval() (frozen BatchNorm statistics): the step set every module to
    the root's mode afterwards, and ran BN on batch statistics, updating them."""
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    model.train()
    model[1].eval()
    tx = ftrain.optim.sgd(0.1)
    state = init_state(model, tx, seed=0)
    loss = lambda m, b: (m(b["x"]) - b["y"]).pow(2).mean()  # noqa: E731
    batch = {"x": torch.randn(16, 4) * 3 + 5, "y": torch.zeros(16, 1)}
    new, _ = make_step(model, loss, tx)(state, batch)
    assert model.training and not model[1].training
    assert torch.equal(new["buffers", "1", "running_mean"], state["buffers", "1", "running_mean"])
    ftrain.make_eval_step(model, loss)(state, batch)
    assert model.training and not model[1].training  # eval restores each module's mode


def test_samples_is_the_leading_dim_the_batch_shares_not_the_first_leaf():
    """A 0-d "alpha" (first in key order) made every batch one sample: evaluate weighted
    its batches by it. A loss that counts its own samples is taken at its word."""
    model = torch.nn.Linear(2, 1)
    loss = lambda m, b: (m(b["x"]) * b["alpha"]).pow(2).mean()  # noqa: E731
    state = init_state(model, ftrain.optim.sgd(0.1), seed=0)
    ev = ftrain.make_eval_step(model, loss)
    batch = {"alpha": torch.tensor(2.0), "a_ids": torch.arange(4), "x": torch.ones(32, 2)}
    batch |= {"y": torch.ones(32)}
    assert int(ev(state, batch)["samples"]) == 32
    own = lambda m, b: (loss(m, b), {"samples": torch.tensor(7)})  # noqa: E731
    assert int(ftrain.make_eval_step(model, own)(state, batch)["samples"]) == 7
    step = make_step(model, loss, ftrain.optim.sgd(0.1))
    assert int(step(state, batch)[1]["samples"]) == 32


def test_requires_grad_false_is_said_to_be_ignored():
    """A PyTorch user's freeze (requires_grad=False) was trained without a word."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].weight.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"0\.weight have requires_grad=False.*frozen\(\) label"):
        make_step(model, lambda m, b: m(b["x"]).sum(), ftrain.optim.sgd(0.1))


@pytest.mark.parametrize(
    "aux, message",
    [
        ({"per_sample": torch.ones(8)}, "aux metric 'per_sample' has shape (8,)"),
        ({"label": "cat"}, "aux metric 'label' is a str"),
        ({3: torch.tensor(1.0)}, "aux metric names must be strings"),
        ([torch.tensor(1.0)], "must be a dict of name to scalar, got list"),
        ({"loss": torch.tensor(1.0)}, "aux metric 'loss' is a name the step reports itself"),
        ({"lr_head": 0.1}, "aux metric 'lr_head' is a name the step reports itself"),
        ({"samples": 2.5}, "'samples' is the batch's sample count"),
        ({"samples": -1}, "must be a whole number >= 0 or an integer tensor, got -1"),
        ({"samples": torch.tensor(8.0)}, "'samples' is the batch's sample count"),
    ],
)
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_an_aux_metric_that_is_not_one_number_is_named_at_the_loss(aux, message, grad_accum):
    """A per-sample aux tensor trained and then failed at ``.item()`` in the loop, a
    traceback far from the loss function; now the step names the metric and its shape."""
    model = _model()

    def loss(m, b):
        return _mse(m, b), aux

    step = make_step(model, loss, _tx(), grad_accum=grad_accum)
    state = init_state(model, _tx(), seed=0)
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        step(state, _batch(0))


@pytest.mark.parametrize(
    "result, message",
    [
        (lambda loss: (loss, {}, 1), "got a tuple of 3: (Tensor, dict, int)"),
        (lambda loss: (loss,), "got a tuple of 1: (Tensor)"),
        (lambda loss: loss.to(torch.complex64), "loss is torch.complex64: it must be a real"),
        (lambda loss: (loss > 0).long(), "loss is torch.int64: it must be a real floating"),
    ],
)
def test_a_loss_of_the_wrong_shape_or_dtype_is_named_at_the_loss(result, message):
    """A tuple of the wrong length was Python's "too many values to unpack"; a complex or
    integer loss was autograd's error from deep inside the backward."""
    model = _model()
    step = make_step(model, lambda m, b: result(_mse(m, b)), _tx())
    with pytest.raises(TypeError, match=re.escape(message)):
        step(init_state(model, _tx(), seed=0), _batch(0))


def test_float64_aux_metrics_keep_their_precision_and_counts_sum():
    model = _model()

    def loss(m, b):
        return _mse(m, b), {"big": torch.tensor(1e300, dtype=torch.float64), "n": len(b["x"])}

    step = make_step(model, loss, _tx(), grad_accum=2)
    _, metrics = step(init_state(model, _tx(), seed=0), _batch(0))
    assert metrics["big"].dtype == torch.float64 and metrics["big"].item() == 1e300
    assert int(metrics["n"]) == 8  # counts sum over micro-batches


def test_a_state_of_another_width_is_refused_naming_the_shapes():
    """A checkpoint of a 64-wide MLP restored without target= into a 32-wide one trained
    the 64-wide weights silently (the step checked the param names only)."""
    wide, narrow = torch.nn.Linear(4, 64), torch.nn.Linear(4, 32)
    tx = ftrain.optim.sgd(0.1)
    state = ftrain.init_state(wide, tx, seed=0)
    step = ftrain.make_step(narrow, lambda m, b: m(b["x"]).pow(2).mean(), tx)
    with pytest.raises(ValueError, match=r"weight: state \(64, 4\), model \(32, 4\)"):
        step(state, {"x": torch.ones(2, 4)})


def test_batches_without_a_cursor_are_said_once_since_a_resume_restarts_them():
    """A list of batches (or the README's random ones) carries no cursor: the state's data
    position never moved, and a resume given the same batches trained them from the first
    again, without a word."""
    model = torch.nn.Linear(2, 1)
    tx = ftrain.optim.sgd(0.1)
    step = ftrain.make_step(model, lambda m, b: m(b["x"]).pow(2).mean(), tx)
    state = ftrain.init_state(model, tx, seed=0)
    with pytest.warns(UserWarning, match="the batches carry no 'cursor'") as said:
        for _ in range(3):
            state, _ = step(state, {"x": torch.ones(4, 2)})
    assert len([w for w in said if "cursor" in str(w.message)]) == 1
