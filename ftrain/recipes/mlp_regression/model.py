"""Bring your own model: the smallest complete recipe (model + loss + data).

Anything ftrain trains needs three things, and this file shows each in its plainest form:

1. a ``torch.nn.Module`` whose weights come from an explicit ``torch.Generator`` (so the
   init is keyed and never touches torch's global RNG);
2. a loss ``loss_fn(model, batch) -> (scalar loss, aux dict)``; ftrain's step calls it with
   the model bound to the state's parameters through ``torch.func.functional_call``;
3. data as a TensorDict of samples, built from a local generator so it is the same on
   every run.

Example (the same contract ftrain's step relies on, written out by hand):
    >>> import torch
    >>> from torch.func import functional_call, grad
    >>> data = make_data(256, seed=0)
    >>> model = MLP(generator=torch.Generator().manual_seed(0))
    >>> params = dict(model.named_parameters())
    >>> def loss_of(p, batch):
    ...     return mse_loss(lambda x: functional_call(model, p, (x,)), batch)[0]
    >>> for _ in range(200):
    ...     g = grad(loss_of)(params, data)
    ...     params = {k: v - 0.1 * g[k] for k, v in params.items()}
    >>> bool(loss_of(params, data) < 0.1)
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.nn import functional as F

__all__ = ["MLP", "make_data", "mse_loss"]


class MLP(nn.Module):
    """Two-layer perceptron ``y = W2 tanh(W1 x + b1) + b2``.

    Parameters are created directly from ``generator`` (LeCun-normal weights, zero
    biases) rather than via ``nn.Linear``, whose constructor draws from the global RNG.

    Args:
        in_dim: input features.
        hidden: hidden units.
        out_dim: outputs.
        generator: the only source of randomness for the initial weights.

    Example:
        >>> MLP(4, 8, 1, generator=torch.Generator().manual_seed(0))(torch.ones(3, 4)).shape
        torch.Size([3, 1])
    """

    def __init__(
        self, in_dim: int = 8, hidden: int = 64, out_dim: int = 1, *, generator: torch.Generator
    ) -> None:
        super().__init__()
        for name, v in (("in_dim", in_dim), ("hidden", hidden), ("out_dim", out_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"MLP.{name} must be a positive int, got {name}={v!r}")

        def lecun(fan_in: int, fan_out: int) -> nn.Parameter:
            w = torch.randn(fan_in, fan_out, generator=generator) / math.sqrt(fan_in)
            return nn.Parameter(w)

        self.w1 = lecun(in_dim, hidden)
        self.b1 = nn.Parameter(torch.zeros(hidden))
        self.w2 = lecun(hidden, out_dim)
        self.b2 = nn.Parameter(torch.zeros(out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w1 + self.b1) @ self.w2 + self.b2


def mse_loss(
    model: Callable[[torch.Tensor], torch.Tensor], batch: TensorDictBase
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean squared error of ``model(batch["x"])`` against ``batch["y"]``.

    Returns:
        ``(loss, {"samples": n})`` with ``n`` the batch size as an int64 scalar tensor.

    Example:
        >>> m = MLP(2, 4, 1, generator=torch.Generator().manual_seed(0))
        >>> loss, aux = mse_loss(m, make_data(16, seed=0, in_dim=2))
        >>> int(aux["samples"])
        16
    """
    x, y = batch["x"], batch["y"]
    loss = F.mse_loss(model(x), y)
    return loss, {"samples": torch.tensor(x.shape[0], dtype=torch.int64, device=x.device)}


def make_data(
    n: int, seed: int, *, in_dim: int = 8, out_dim: int = 1, noise: float = 0.01
) -> TensorDict:
    """``n`` samples of a fixed smooth function plus noise: ``y = sin(x @ A) + noise``.

    Built from a local generator seeded with ``seed`` (global RNG untouched); the
    teacher matrix ``A`` depends on ``seed`` too, so a seed names one whole dataset.

    Args:
        n: number of samples.
        seed: dataset seed.
        in_dim: input features (``x ~ N(0, 1)``).
        out_dim: target features.
        noise: standard deviation of the Gaussian noise added to the targets.

    Returns:
        ``TensorDict(x=[n, in_dim], y=[n, out_dim], batch_size=[n])``, float32.

    Raises:
        ValueError: for non-positive ``n`` or negative ``noise``.

    Example:
        >>> make_data(10, seed=0)["x"].shape
        torch.Size([10, 8])
    """
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"make_data needs a positive int sample count, got n={n!r}")
    if noise < 0:
        raise ValueError(f"make_data needs noise >= 0, got noise={noise!r}")
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(in_dim, out_dim, generator=g) / math.sqrt(in_dim)
    x = torch.randn(n, in_dim, generator=g)
    y = torch.sin(2.0 * x @ teacher) + noise * torch.randn(n, out_dim, generator=g)
    return TensorDict(x=x, y=y, batch_size=[n])
