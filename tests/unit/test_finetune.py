"""Frozen parameters and parameter groups: ``multi_transform``, ``frozen``, the step."""

import pytest
import torch
from tensordict import TensorDict

import ftrain
from ftrain import optim
from ftrain.optim import masks
from ftrain.state.tree import flatten, path_str


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.body = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 1)
        self.emb = torch.nn.Linear(4, 4, bias=False)
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.seen_requires_grad = {}

    def forward(self, x):
        self.seen_requires_grad = {
            "emb": self.emb.weight.requires_grad,
            "body": self.body.weight.requires_grad,
        }
        return self.head(torch.tanh(self.body(self.emb(x))))


def mse(m, b):
    return ((m(b["x"]) - b["y"]) ** 2).mean()


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return {"x": torch.randn(16, 4, generator=g), "y": torch.randn(16, 1, generator=g)}


def frozen_emb_tx(lr=0.05):
    return optim.multi_transform(
        {"train": optim.adamw(lr, weight_decay=0.1), "frozen": optim.frozen()},
        {"frozen": masks.glob("emb.*"), "train": None},
    )


def _opt_paths(opt):
    return [path_str(k) for k in flatten(opt)[0]]


def test_frozen_leaves_get_no_grad_no_state_and_stay_the_same_objects():
    model = Net()
    tx = frozen_emb_tx()
    state = ftrain.init_state(model, tx, seed=0)
    assert not any("emb" in p for p in _opt_paths(state["opt"]))  # no moments for emb
    assert any(p.endswith("mu.body.weight") for p in _opt_paths(state["opt"]))
    step = ftrain.make_step(model, mse, tx)
    s = state
    for i in range(3):
        new, _ = step(s, batch(i))
        assert new["params", "emb", "weight"] is s["params", "emb", "weight"]
        assert not torch.equal(new["params", "body", "weight"], s["params", "body", "weight"])
        s = new
    # the frozen weight was not differentiated at all; the trainable one was
    assert model.seen_requires_grad == {"emb": False, "body": True}
    assert torch.equal(s["params", "emb", "weight"], state["params", "emb", "weight"])


def test_multi_transform_equals_per_label_reference_on_identical_gradients():
    """optax's definition: each label's transform on its own leaves, nothing shared."""
    g = torch.Generator().manual_seed(1)
    params = TensorDict(
        {"head": {"w": torch.randn(3, 3, generator=g)}, "body": {"w": torch.randn(5, generator=g)}},
        batch_size=[],
    )
    grads = [params.apply(lambda t: torch.randn(t.shape, generator=g)) for _ in range(4)]
    head_tx, body_tx = optim.adamw(1e-2, weight_decay=0.1), optim.sgd(0.1, momentum=0.9)
    tx = optim.multi_transform(
        {"head": head_tx, "body": body_tx}, {"head": masks.glob("head.*"), "body": None}
    )
    state = tx.init(params)
    ref = {"head": head_tx.init(params.select("head")), "body": body_tx.init(params.select("body"))}
    p = params
    for grad in grads:
        updates, state = tx.update(grad, state, p)
        for label, sub_tx in (("head", head_tx), ("body", body_tx)):
            ref_u, ref[label] = sub_tx.update(grad.select(label), ref[label], p.select(label))
            assert torch.equal(updates[label, "w"], ref_u[label, "w"])
        p = p + updates
    assert float(optim.learning_rates(state)["head.scale_by_learning_rate.learning_rate"]) == 1e-2


def test_frozen_leaves_given_to_update_get_zero_updates():
    params = TensorDict({"a": torch.ones(2), "b": torch.ones(3)}, batch_size=[])
    tx = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.multi_transform(
            {"t": optim.sgd(0.1, momentum=0.9), "f": optim.frozen()},
            {"f": masks.glob("b"), "t": None},
        ),
        optim.trace(0.5),  # stateful, outside the multi_transform: state for "a" only
    )
    state = tx.init(params)
    paths = _opt_paths(state)
    assert "trace.trace.a" in paths and "multi_transform.t.trace.trace.a" in paths
    assert not [p for p in paths if p.endswith(".b")]  # no state for the frozen leaf
    updates, state = tx.update(params.clone(), state, params)
    assert torch.equal(updates["b"], torch.zeros(3))
    assert not torch.equal(updates["a"], torch.zeros(2))
    assert optim.frozen_indices(tx, *flatten(params)) == [1]


def test_global_norm_clip_sees_trainable_leaves_only():
    model = Net()
    tx = optim.chain(optim.clip_by_global_norm(1e9), frozen_emb_tx())
    state = ftrain.init_state(model, tx, seed=0)
    _, m = ftrain.make_step(model, mse, tx)(state, batch(0))
    # the reference: autograd over the trainable parameters only
    ref = Net()
    loss = mse(ref, batch(0))
    trainable = [p for n, p in ref.named_parameters() if not n.startswith("emb")]
    norm = torch.linalg.vector_norm(
        torch.stack([g.norm() for g in torch.autograd.grad(loss, trainable)])
    )
    torch.testing.assert_close(m["grad_norm"], norm, rtol=1e-6, atol=0)


def test_groups_have_their_own_learning_rates_in_the_metrics():
    model = Net()
    tx = optim.multi_transform(
        {"default": optim.adamw(1e-3), "head": optim.adamw(1e-2), "frozen": optim.frozen()},
        {"frozen": masks.glob("emb.*"), "head": masks.glob("head.*"), "default": None},
    )
    state = ftrain.init_state(model, tx, seed=0)
    _, m = ftrain.make_step(model, mse, tx)(state, batch(0))
    assert float(m["lr"]) == 1e-3 and float(m["lr_default"]) == 1e-3
    assert float(m["lr_head"]) == 1e-2


def test_donate_and_dynamic_loss_scale_with_frozen_leaves():
    model = Net()
    tx = optim.dynamic_loss_scale(frozen_emb_tx())
    ref_tx = optim.dynamic_loss_scale(frozen_emb_tx())
    state = ftrain.init_state(model, tx, seed=0, precision="fp16")
    ref_state = ftrain.init_state(model, ref_tx, seed=0, precision="fp16")
    emb = state["params", "emb", "weight"]
    donated = ftrain.make_step(model, mse, tx, donate=True, precision="fp16")
    pure = ftrain.make_step(model, mse, ref_tx, precision="fp16")
    for i in range(3):
        state, _ = donated(state, batch(i))
        ref_state, _ = pure(ref_state, batch(i))
    assert state["params", "emb", "weight"] is emb
    assert ftrain.tree_equal(state["params"], ref_state["params"])


def test_every_parameter_frozen_is_a_clear_error():
    model = Net()
    tx = optim.multi_transform({"f": optim.frozen()}, {"f": None})
    state = ftrain.init_state(model, tx, seed=0)
    with pytest.raises(ValueError, match="every parameter is frozen"):
        ftrain.make_step(model, mse, tx)(state, batch(0))


def test_label_errors_name_the_parameter_and_the_fix():
    params = TensorDict({"a": torch.ones(2), "b": torch.ones(2)}, batch_size=[])
    tx = optim.multi_transform({"x": optim.sgd(0.1)}, {"x": masks.glob("a")})
    with pytest.raises(ValueError, match="'b' matches no label.*catch-all"):
        tx.init(params)
    with pytest.raises(ValueError, match=r"labels \['y'\] have no transform"):
        optim.multi_transform({"x": optim.sgd(0.1)}, {"y": None})
    with pytest.raises(ValueError, match="got label 'z'"):
        optim.multi_transform({"x": optim.sgd(0.1)}, lambda p, t: "z").init(params)
    with pytest.raises(ValueError, match="plain name"):
        optim.multi_transform({"a.b": optim.sgd(0.1)}, {"a.b": None})


def test_compiled_step_with_frozen_leaves_matches_eager():
    model = Net()
    tx = frozen_emb_tx()
    state = ftrain.init_state(model, tx, seed=0)
    eager = ftrain.make_step(model, mse, tx)
    compiled = ftrain.make_step(model, mse, tx, compile=True)
    a, b = state, state
    for i in range(3):
        a, _ = eager(a, batch(i))
        b, _ = compiled(b, batch(i))
    assert b["params", "emb", "weight"] is state["params", "emb", "weight"]
    (keys, xs), ys = flatten(a["params"]), flatten(b["params"])[1]
    for k, x, y in zip(keys, xs, ys, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=path_str(k))


def test_glob_mask():
    m = masks.glob("transformer.h.[0-1].*", "*.lora_A")
    assert m("transformer.h.1.attn.c_attn.weight", None)
    assert not m("transformer.h.2.attn.c_attn.weight", None)
    assert m("transformer.h.7.attn.c_attn.lora_A", None)
    with pytest.raises(ValueError, match="pattern"):
        masks.glob()


class BNNet(torch.nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.lin = torch.nn.Linear(4, width)
        self.bn = torch.nn.BatchNorm1d(width)

    def forward(self, x):
        return self.bn(self.lin(x))


def _bn_buffers(mean: float, var: float, n: int, width: int = 4) -> TensorDict:
    bn = {"running_mean": torch.full((width,), mean), "running_var": torch.full((width,), var)}
    return TensorDict({"bn": bn | {"num_batches_tracked": torch.tensor(n)}}, batch_size=[])


def test_init_from_takes_the_base_runs_buffers_too(tmp_path):
    """init.from loaded params only: a BatchNorm's running statistics started again from
    0/1 (eval outputs wrong from step 0), silently. Now they come with the params, and a
    base whose buffers do not fit is refused."""
    from omegaconf import OmegaConf

    from ftrain.ckpt import CheckpointManager
    from ftrain.cli.finetune import init_from
    from ftrain.config import ConfigError
    from ftrain.state.tree import replace

    tx = optim.adamw(1e-3)
    base = replace(ftrain.init_state(BNNet(), tx, seed=0), buffers=_bn_buffers(0.5, 2.0, 30))
    CheckpointManager(tmp_path / "base", async_save=False).save(base)
    cfg = OmegaConf.create(
        {
            "init": {"from": str(tmp_path / "base")},
            "checkpoint": {"storage": {}},
            "optim": {"freeze": ["bn.*"], "groups": {}},
            "model": {},
        }
    )
    state, line, _ = init_from(cfg, ftrain.init_state(BNNet(), tx, seed=1))
    assert "(and 3 buffers)" in line
    assert torch.equal(state["buffers"]["bn"]["running_var"], torch.full((4,), 2.0))
    assert int(state["buffers"]["bn"]["num_batches_tracked"]) == 30
    assert torch.equal(state["params"]["bn"]["weight"], base["params"]["bn"]["weight"])
    # a base saved through the API as params only (no buffers group) still initialises
    bare = TensorDict({"step": torch.tensor(1), "params": base["params"]}, batch_size=[])
    CheckpointManager(tmp_path / "bare", async_save=False).save(bare)
    cfg_bare = OmegaConf.merge(cfg, {"init": {"from": str(tmp_path / "bare")}})
    state, line, _ = init_from(cfg_bare, ftrain.init_state(BNNet(), tx, seed=1))
    assert "buffers" not in line and torch.equal(
        state["buffers"]["bn"]["running_var"], torch.ones(4)
    )
    other = replace(ftrain.init_state(BNNet(), tx, seed=1), buffers=_bn_buffers(0, 1, 0, 5))
    with pytest.raises(ConfigError, match="buffers of another shape/dtype: bn.running_mean"):
        init_from(cfg, other)


def test_init_from_refuses_a_base_of_another_function_and_names_the_adapter_fix():
    """A base of n_head=4 loaded into an n_head=16 model without a word (no shape shows
    the heads); a plain run started from a LoRA run was told to set model.lora.alpha,
    which led only to "parameters the model does not have"."""
    from omegaconf import OmegaConf

    from ftrain.cli.finetune import _check_adapter_alpha, _check_fit, _check_same_function
    from ftrain.config import ConfigError

    cfg = OmegaConf.create({"model": {"n_head": 16, "lora": {"rank": 0, "alpha": 16}}})
    attrs = {"config": {"model": {"n_head": 4, "lora": {"rank": 4, "alpha": 8}}}}
    with pytest.raises(ConfigError, match=r"model.n_head=16 \(base run: 4\).* model.n_head=4"):
        _check_same_function(cfg, attrs, "init.from='base'")
    _check_same_function(cfg, {"config": {"model": {"n_head": 16}}}, "init.from='base'")
    _check_same_function(cfg, {}, "init.from='base'")  # saved by other code: shapes decide
    adapters = {"h.0.attn.lora_A": torch.zeros(2, 4), "h.0.attn.w": torch.zeros(4, 4)}
    _check_adapter_alpha(cfg, adapters, attrs, "init.from='base'")  # LoRA off: not the issue
    cfg = OmegaConf.merge(cfg, {"optim": {"groups": {}, "freeze": []}})
    with pytest.raises(ConfigError, match="trained LoRA adapters: set model.lora.rank"):
        _check_fit(cfg, adapters, {"h.0.attn.w": torch.zeros(4, 4)}, "init.from='base'")


def test_a_config_that_trains_nothing_or_an_empty_group_is_refused_at_start():
    """Every parameter frozen failed at step 1 after an emergency save (which then refused
    the corrected config); a group whose parameters optim.freeze (or an earlier group) also
    took trained nothing while its learning rate was logged."""
    from omegaconf import OmegaConf

    from ftrain.cli.finetune import check_labels
    from ftrain.config import ConfigError

    params = ftrain.init_state(Net(), optim.adamw(1e-3), seed=0)["params"]

    def cfg(freeze, groups=None):
        optim_cfg = {"freeze": freeze, "groups": groups or {}}
        return OmegaConf.create({"optim": optim_cfg, "model": {}})

    with pytest.raises(ConfigError, match=r"every parameter is frozen \(optim.freeze=\['\*'\]"):
        check_labels(cfg(["*"]), params)
    shadowed = {"top": {"params": ["body.*"], "lr": 3e-3}}
    with pytest.raises(ConfigError, match=r"top.params=\['body.\*'\] take no parameter: optim"):
        check_labels(cfg(["body.*", "emb.*"], shadowed), params)
    check_labels(cfg(["emb.*"], shadowed), params)  # fine: body trains in its group
    earlier = {"all": {"params": ["*"]}, "bias": {"params": ["*.bias"]}}
    with pytest.raises(ConfigError, match=r"they go to \['all'\] first"):
        check_labels(cfg([], earlier), params)


def test_a_lora_target_matching_nothing_is_a_start_warning_line_not_a_python_warning():
    """`model.lora.targets=[c_attn,c_prj]` printed a raw `build.py:118: RuntimeWarning`
    with a source line, unlike every other start warning (`[step=0] warning: ...`)."""
    import warnings

    from ftrain.cli.build import build_model
    from ftrain.config import load_config

    cfg = load_config(["model=gpt2_tiny", "model.lora.rank=4", "model.lora.targets=[c_attn,c_prj]"])
    notes: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_model(cfg, notes)
    assert len(notes) == 1 and notes[0].startswith("warning: LoRA targets ['c_prj'] match no")
    with pytest.warns(RuntimeWarning, match="c_prj"):  # without a report: a Python warning
        build_model(cfg)
