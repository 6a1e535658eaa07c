"""ftrain.load_params: a state's params back into an nn.Module, ties kept, strict checks."""

import os

import pytest
import torch

import ftrain

os.environ["HF_HUB_OFFLINE"] = "1"


def gpt2lm():
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install 'ftrain[test]')"
    )
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=8,
        n_embd=16,
        n_layer=1,
        n_head=2,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def test_hf_gpt2_ties_survive_load_params_but_not_to_module():
    model = gpt2lm()
    state = ftrain.init_state(model, ftrain.optim.sgd(0.1), seed=0)
    x = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    batch = {"x": x}
    step = ftrain.make_step(
        model, lambda m, b: m(b["x"]).logits.pow(2).mean(), ftrain.optim.sgd(0.1)
    )
    trained, _ = step(state, batch)
    wte = model.transformer.wte.weight
    ftrain.load_params(model, trained["params"])
    assert model.lm_head.weight is model.transformer.wte.weight is wte  # same Parameter
    assert torch.equal(wte, trained["params", "transformer", "wte", "weight"])
    # the trap load_params avoids: to_module replaces wte only, lm_head keeps the old one
    other = gpt2lm()
    trained["params"].to_module(other)
    assert other.lm_head.weight is not other.transformer.wte.weight


def test_every_alias_given_with_equal_values_is_fine_different_ones_are_not():
    model = gpt2lm()
    params = {k: v.detach() + 1 for k, v in model.named_parameters(remove_duplicate=False)}
    assert "lm_head.weight" in params
    ftrain.load_params(model, params)
    assert model.lm_head.weight is model.transformer.wte.weight
    params["lm_head.weight"] = params["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="tied parameters given different values"):
        ftrain.load_params(model, params)


def test_tied_aliases_holding_nan_are_the_same_tensor():
    # a diverged run's tied weights: NaN != NaN by value, the same bits all the same
    shared = torch.nn.Linear(2, 2, bias=False)
    model = torch.nn.Sequential(shared, shared)
    w = torch.tensor([[float("nan"), 1.0], [2.0, 3.0]])
    ftrain.load_params(model, {"0.weight": w, "1.weight": w.clone()})
    assert torch.equal(model[0].weight.isnan(), w.isnan())
    with pytest.raises(ValueError, match="tied parameters given different values"):
        ftrain.load_params(model, {"0.weight": w, "1.weight": w.nan_to_num()})
    zeros = torch.zeros(2, 2)
    ftrain.load_params(model, {"0.weight": zeros, "1.weight": -zeros})  # -0.0 == 0.0


def test_strict_checks_report_everything_and_copy_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {
        "0.weight": torch.zeros(3, 2),
        "0.bias": torch.zeros(3, dtype=torch.float64),  # never cast silently
        "1.weight": torch.zeros(2, 3),
        "2.weight": torch.zeros(1),
    }
    with pytest.raises(ValueError) as err:
        ftrain.load_params(model, params)
    msg = str(err.value)
    for part in (
        "not a parameter of the module: 2.weight",
        "missing: 1.bias",
        "0.bias: given torch.float64",
        "1.weight: given",
    ):
        assert part in msg
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ok = {"0.weight": torch.ones(3, 2)}
    ftrain.load_params(model, ok, strict=False)  # the others keep their values
    assert torch.equal(model[0].weight, torch.ones(3, 2)) and torch.equal(
        model[1].weight, before["1.weight"]
    )
    with pytest.raises(TypeError, match="TensorDict or"):
        ftrain.load_params(model, [1])


def test_buffers_are_loaded_too_so_the_module_computes_as_the_state():
    """docs/custom-step.md §5 sends module users to load_params: a BatchNorm kept its
    initial running statistics (no way to load state["buffers"])."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    tx = ftrain.optim.sgd(0.1)
    state = ftrain.init_state(model, tx, seed=0)
    loss = lambda m, b: m(b["x"]).pow(2).mean()  # noqa: E731
    batch = {"x": torch.randn(16, 3) * 4 + 3}
    state, _ = ftrain.make_step(model, loss, tx)(state, batch)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).eval()
    ftrain.load_params(fresh, state["params"], buffers=state["buffers"])
    want = ftrain.make_eval_step(model, loss)(state, batch)["loss"]
    with torch.no_grad():
        assert float(loss(fresh, batch)) == pytest.approx(float(want), rel=1e-6)
    with pytest.raises(ValueError, match="missing buffer: 1.running_mean"):
        ftrain.load_params(fresh, state["params"], buffers={})
    with pytest.raises(ValueError, match="not a buffer of the module: 1.nope"):
        ftrain.load_params(fresh, state["params"], buffers={"1.nope": torch.zeros(1)}, strict=False)


def test_a_module_on_meta_and_a_value_that_is_no_tensor_are_named():
    """Into a module built on the meta device, load_params returned as if it had loaded
    (copy_ into a meta tensor does nothing); a list value was an AttributeError."""
    meta = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match="weight: the module's parameter is on the meta.*to_empty"):
        ftrain.load_params(meta, {"weight": torch.ones(2, 2), "bias": torch.ones(2)})
    real = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="bias: given a list, not a tensor"):
        ftrain.load_params(real, {"weight": torch.ones(2, 2), "bias": [1.0, 1.0]})
    meta.to_empty(device="cpu")
    ftrain.load_params(meta, {"weight": torch.ones(2, 2), "bias": torch.ones(2)})
    assert torch.equal(meta.weight, torch.ones(2, 2))
