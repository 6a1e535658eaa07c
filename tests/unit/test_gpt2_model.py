"""GPT-2 recipe model and loss: shapes, sizes, tying, causality, keyed dropout and init."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from torch.func import functional_call

from ftrain.nn import use_generator
from ftrain.recipes.gpt2 import GPT, GPTConfig, init_weights, lm_loss

V = 256


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tiny(seed: int = 0, **overrides) -> GPT:
    return GPT(GPTConfig.tiny(**overrides), generator=_gen(seed))


def _tokens(b: int = 2, t: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=_gen(seed))


def test_forward_shape_and_dtype():
    model = _tiny().eval()
    logits = model(_tokens(3, 10))
    assert logits.shape == (3, 10, V)
    assert logits.dtype == torch.float32


def test_sequence_longer_than_block_size_is_a_clear_error():
    model = _tiny(block_size=8).eval()
    with pytest.raises(ValueError, match="sequence length 9 exceeds.*block_size=8"):
        model(_tokens(1, 9))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"n_embd": 65}, "n_embd=65 and n_head=4"),
        ({"n_layer": 0}, "n_layer=0"),
        ({"vocab_size": 2.5}, "vocab_size=2.5"),
        ({"dropout": 1.0}, "dropout=1.0"),
        ({"bias": 1}, "bias=1"),
    ],
)
def test_config_validation_names_the_bad_value(overrides, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig.tiny(**overrides)


def test_param_counts():
    tiny = _tiny()
    assert 100_000 <= tiny.num_params() <= 1_000_000
    assert tiny.num_params() == 220_544
    assert tiny.num_params(non_embedding=True) == 220_544 - 64 * 64
    # GPT-2 small, shape only: nothing allocated, nothing initialised
    gpt2 = GPT(GPTConfig.gpt2(), device="meta")
    assert all(p.is_meta for p in gpt2.parameters())
    assert gpt2.num_params() == 86_039_040
    assert GPT(GPTConfig.gpt2(vocab_size=50304), device="meta").num_params() == 124_475_904


def test_generator_is_required_for_a_real_device():
    with pytest.raises(ValueError, match="explicit generator"):
        GPT(GPTConfig.tiny())


def test_output_layer_is_tied_to_token_embedding_with_one_leaf():
    model = _tiny()
    names = [n for n, _ in model.named_parameters()]
    assert "transformer.wte.weight" in names
    assert not any("lm_head" in n for n in names)
    # the pytree the trainer holds has the tied weight once, so an out-of-place update
    # of it cannot untie the embedding from the head
    params = TensorDict.from_module(model)
    assert not any("lm_head" in k for k in params.keys(True, True))
    assert list(model.state_dict()) == names


def test_functional_call_matches_module_and_reaches_both_uses():
    model = _tiny().eval()
    idx = _tokens()
    params = dict(model.named_parameters())
    out = functional_call(model, params, (idx,))
    torch.testing.assert_close(out, model(idx), rtol=0, atol=0)
    # a new wte swapped in through the params pytree changes the output
    scaled = TensorDict.from_module(model).apply(lambda t: t.detach().clone())
    scaled["transformer", "wte", "weight"] *= 2
    with scaled.to_module(model):
        assert not torch.equal(model(idx), out)


def test_tied_weight_gradient_sums_embedding_and_head_contributions():
    model = _tiny().eval()
    idx = _tokens()
    captured = {}

    def keep(name):
        def hook(_module, _inputs, output):
            output.retain_grad()
            captured[name] = output

        return hook

    model.transformer.wte.register_forward_hook(keep("emb"))
    model.transformer.ln_f.register_forward_hook(keep("h"))
    logits = model(idx)
    logits.retain_grad()
    logits.square().mean().backward()

    C = model.config.n_embd
    expected = torch.zeros_like(model.transformer.wte.weight)
    expected.index_add_(0, idx.flatten(), captured["emb"].grad.reshape(-1, C))  # embedding
    head = logits.grad.reshape(-1, V).T @ captured["h"].detach().reshape(-1, C)  # lm_head
    assert head.abs().sum() > 0
    torch.testing.assert_close(model.transformer.wte.weight.grad, expected + head)


def test_causal_future_tokens_do_not_change_earlier_logits():
    model = _tiny().eval()
    idx = _tokens(2, 20)
    changed = idx.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % V
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=0)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_dropout_is_keyed_by_the_generator():
    model = _tiny(dropout=0.5).train()
    idx = _tokens()

    def run(seed: int) -> torch.Tensor:
        with use_generator(_gen(seed)):
            return model(idx)

    before = torch.get_rng_state()
    torch.testing.assert_close(run(7), run(7), rtol=0, atol=0)
    assert not torch.allclose(run(7), run(8))
    assert torch.equal(torch.get_rng_state(), before)


def test_train_mode_dropout_without_generator_raises():
    model = _tiny().train()
    with pytest.raises(RuntimeError, match="without a generator"):
        model(_tokens())


def test_eval_mode_has_no_dropout():
    model = _tiny(dropout=0.5)
    idx = _tokens()
    reference = GPT(GPTConfig.tiny(dropout=0.0), generator=_gen(0)).eval()(idx)
    model.eval()
    torch.testing.assert_close(model(idx), reference, rtol=0, atol=0)
    # and with a generator present, still no draws in eval mode
    with use_generator(_gen(3)):
        torch.testing.assert_close(model(idx), reference, rtol=0, atol=0)


def test_init_is_keyed_and_leaves_global_rng_alone():
    before = torch.get_rng_state()
    a, b, c = _tiny(0), _tiny(0), _tiny(1)
    assert torch.equal(torch.get_rng_state(), before)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if name.endswith("weight") and ".ln_" not in name:
            assert not torch.equal(pa, pc), name
    # re-initialising with the same generator state reproduces the weights
    init_weights(c, _gen(0))
    for pa, pc in zip(a.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pc)


def test_init_follows_gpt2():
    model = GPT(GPTConfig.tiny(n_layer=8, n_embd=128), generator=_gen(0))
    resid = 0.02 / math.sqrt(2 * 8)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif ".ln_" in name:
            assert torch.all(p == 1), name
        else:
            expected = resid if name.endswith("c_proj.weight") else 0.02
            assert abs(p.std().item() - expected) / expected < 0.1, name


def test_lm_loss_starts_near_uniform_and_decreases_with_sgd():
    model = _tiny(dropout=0.0)
    seq = torch.arange(32).repeat(2) % 16  # a repeating pattern: easy to learn
    batch = TensorDict(x=seq[:-1].view(1, -1).repeat(4, 1), y=seq[1:].view(1, -1).repeat(4, 1))
    batch.batch_size = [4]
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of(p):
        return lm_loss(lambda x: functional_call(model, p, (x,)), batch)

    loss0, aux = loss_of(params)
    assert aux["tokens"].dtype == torch.int64 and int(aux["tokens"]) == 4 * 63
    assert abs(loss0.item() - math.log(V)) < 0.5  # small init: near-uniform predictions
    losses = [loss0.item()]
    for _ in range(10):
        g = torch.func.grad(lambda p: loss_of(p)[0])(params)
        # clip the global grad norm to 1 (as the recipe does) so plain SGD does not spike
        norm = torch.linalg.vector_norm(torch.stack([t.norm() for t in g.values()])).item()
        lr = 0.5 * min(1.0, 1.0 / norm)
        params = {k: v - lr * g[k] for k, v in params.items()}
        losses.append(loss_of(params)[0].item())
    assert losses[-1] < 0.6 * losses[0], losses
