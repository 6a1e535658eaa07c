"""LoRA adapters (ftrain.lora) on the GPT-2 recipe."""

import pytest
import torch
from tensordict import TensorDict

import ftrain
from ftrain import lora, optim
from ftrain.recipes.gpt2 import GPT, GPTConfig, lm_loss
from ftrain.state.tree import flatten, path_str


def _gpt(seed=0):
    return GPT(GPTConfig.tiny(dropout=0.0), generator=torch.Generator().manual_seed(seed))


def _lora_gpt(seed=0, targets=("c_attn", "c_proj")):
    model = _gpt(seed)
    adapted = lora.apply_lora(
        model, rank=4, alpha=8, targets=list(targets), generator=torch.Generator().manual_seed(9)
    )
    return model, adapted


def _tokens(i=0):
    g = torch.Generator().manual_seed(50 + i)
    return torch.randint(0, 256, (4, 33), generator=g)


def _batch(i=0):
    t = _tokens(i)
    return {"x": t[:, :-1], "y": t[:, 1:]}


def lora_tx(lr=1e-2):
    return optim.multi_transform(
        {"lora": optim.adamw(lr), "frozen": optim.frozen()},
        {"lora": lora.is_adapter, "frozen": None},
    )


def test_step_zero_equals_the_base_model_exactly():
    base = _gpt().eval()
    model, adapted = _lora_gpt()
    assert len(adapted) == 12  # attn.c_attn, attn.c_proj and mlp.c_proj in 4 blocks
    assert sorted({a.rsplit(".", 1)[-1] for a in adapted}) == ["c_attn", "c_proj"]
    x = _tokens()[:, :32]
    assert torch.equal(model.eval()(x), base(x))
    names = {n for n, _ in model.named_parameters()}
    assert {n for n, _ in base.named_parameters()} <= names  # base names unchanged
    assert "transformer.h.0.attn.c_attn.lora_A" in names


def test_only_adapters_train_and_the_base_stays_the_same_objects():
    model, _ = _lora_gpt()
    tx = lora_tx()
    state = ftrain.init_state(model, tx, seed=0)
    opt_paths = [path_str(k) for k in flatten(state["opt"])[0]]
    assert opt_paths and all(".lora_" in p for p in opt_paths if ".mu." in p or ".nu." in p)
    step = ftrain.make_step(model, lm_loss, tx)
    new, _ = step(state, _batch())
    for k, old, now in zip(*flatten(state["params"]), flatten(new["params"])[1], strict=True):
        if lora.is_adapter(path_str(k)):
            continue
        assert now is old, path_str(k)
    assert not torch.equal(
        new["params", "transformer", "h", "0", "attn", "c_attn", "lora_B"],
        0 * new["params", "transformer", "h", "0", "attn", "c_attn", "lora_B"],
    )


def test_merge_gives_the_plain_model_with_the_lora_models_logits():
    model, _ = _lora_gpt()
    tx = lora_tx(3e-2)
    state = ftrain.init_state(model, tx, seed=0)
    step = ftrain.make_step(model, lm_loss, tx)
    for i in range(4):
        state, _ = step(state, _batch(i))
    merged = lora.merge(state["params"], 8 / 4)
    assert not any(lora.is_adapter(path_str(k)) for k in flatten(merged)[0])
    plain = _gpt(seed=5)
    plain.load_state_dict(dict(merged.flatten_keys(".").items()), strict=True)
    state["params"].to_module(model)
    x = _tokens(7)[:, :32]
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(x), model.eval()(x), rtol=1e-5, atol=1e-5)


def test_merge_keeps_dtype_and_checks_shapes():
    p = TensorDict(
        {
            "l": {
                "weight": torch.zeros(2, 3, dtype=torch.bfloat16),
                "lora_A": torch.ones(1, 3, dtype=torch.bfloat16),
                "lora_B": torch.ones(2, 1, dtype=torch.bfloat16),
            }
        },
        batch_size=[],
    )
    assert lora.merge(p, 1.0)["l", "weight"].dtype == torch.bfloat16
    bad = p.clone()
    bad["l", "lora_A"] = torch.ones(1, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cannot merge LoRA adapters of 'l'"):
        lora.merge(bad, 1.0)
    with pytest.raises(ValueError, match="missing"):
        lora.merge(p.exclude(("l", "lora_B")), 1.0)


def test_apply_lora_errors_name_the_fix():
    with pytest.raises(ValueError, match="match no module; the model's Linear layers are named"):
        lora.apply_lora(_gpt(), rank=2, alpha=4, targets=["q_proj"], generator=torch.Generator())
    with pytest.raises(ValueError, match="not nn.Linear"):
        lora.apply_lora(_gpt(), rank=2, alpha=4, targets=["ln_1"], generator=torch.Generator())
    with pytest.raises(ValueError, match="rank must be a positive int"):
        lora.apply_lora(_gpt(), rank=0, alpha=4, targets=["c_attn"], generator=torch.Generator())
    g = torch.Generator()
    with pytest.raises(
        ValueError, match=r"dropout must be a number in \[0, 1\), got dropout='0.1'"
    ):
        lora.apply_lora(_gpt(), rank=2, alpha=4, targets=["c_attn"], generator=g, dropout="0.1")
    with pytest.raises(TypeError, match="generator must be a torch.Generator .*got None"):
        lora.apply_lora(_gpt(), rank=2, alpha=4, targets=["c_attn"], generator=None)
    # "*" matched the model itself: setattr(model, "", ...) made a cycle the forward never used
    linear = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"the model itself is an nn.Linear: .*Sequential"):
        lora.apply_lora(linear, rank=1, alpha=1, targets=["*"], generator=g)
    assert list(dict(linear.named_modules())) == [""]  # untouched
    wrapped = torch.nn.Sequential(torch.nn.Linear(3, 2))
    assert lora.apply_lora(wrapped, rank=1, alpha=1, targets=["*"], generator=g) == ["0"]
    adapted = lora.apply_lora(
        _gpt(), rank=2, alpha=4, targets=["transformer.h.0.attn.*"], generator=torch.Generator()
    )
    assert adapted == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj"]
    # a typo beside a target that matches: adapters on part of the model, silently, before
    for typo in (["c_attn", "c_prj"], ["transformer.h.*.attn.*", "mlp.cfc"]):
        with pytest.warns(RuntimeWarning, match=rf"LoRA targets \['{typo[1]}'\] match no nn.Lin"):
            lora.apply_lora(_gpt(), rank=2, alpha=4, targets=typo, generator=torch.Generator())
