"""The "bring your own model" example: keyed init, keyed data, and it learns."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad

from ftrain.recipes.mlp_regression import MLP, make_data, mse_loss


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_data_is_a_pure_function_of_seed_and_leaves_global_rng_alone():
    before = torch.get_rng_state()
    a, b, c = make_data(64, seed=0), make_data(64, seed=0), make_data(64, seed=1)
    assert torch.equal(torch.get_rng_state(), before)
    assert a.batch_size == torch.Size([64])
    assert a["x"].shape == (64, 8) and a["y"].shape == (64, 1)
    assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"])
    assert not torch.equal(a["x"], c["x"])


def test_model_init_is_keyed_and_leaves_global_rng_alone():
    before = torch.get_rng_state()
    a, b, c = MLP(generator=_gen(0)), MLP(generator=_gen(0)), MLP(generator=_gen(1))
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.w1, c.w1)
    assert a(torch.zeros(5, 8)).shape == (5, 1)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: MLP(0, generator=_gen(0)), "in_dim=0"),
        (lambda: make_data(0, seed=0), "n=0"),
        (lambda: make_data(4, seed=0, noise=-1.0), "noise=-1.0"),
    ],
)
def test_errors_name_the_bad_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_mse_loss_decreases_under_functional_sgd():
    data = make_data(256, seed=0)
    model = MLP(generator=_gen(0))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of(p):
        return mse_loss(lambda x: functional_call(model, p, (x,)), data)[0]

    first = loss_of(params).item()
    for _ in range(100):
        g = grad(loss_of)(params)
        params = {k: v - 0.1 * g[k] for k, v in params.items()}
    assert loss_of(params).item() < 0.3 * first
    _, aux = mse_loss(model, data)
    assert int(aux["samples"]) == 256
