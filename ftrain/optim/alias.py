"""Named optimizers: one-line chains of transforms (optax ``alias.py`` style).

Each matches its ``torch.optim`` namesake for the same hyper-parameters (see
``tests/unit/test_optim.py``); ``lr`` may be a float or a schedule of the update count, and
the rate of the next update is ``tree_get(opt_state, "learning_rate")``.
"""

from __future__ import annotations

from ftrain.optim import masks as _masks
from ftrain.optim.base import GradientTransformation, chain
from ftrain.optim.fused import applying_adamw
from ftrain.optim.schedule import Schedule, rate_of
from ftrain.optim.transform import (
    add_decayed_weights,
    momentum_coefficient,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)

__all__ = ["adam", "adamw", "sgd"]


def sgd(
    lr: float | Schedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Stochastic gradient descent, as ``torch.optim.SGD`` (dampening 0, maximize False).

    ``chain(add_decayed_weights(weight_decay), trace(momentum, nesterov),
    scale_by_learning_rate(lr))``; the first two members are left out when their coefficient
    is 0, so the state is ``{"scale_by_learning_rate": {"count"}}`` for plain SGD and
    ``{"add_decayed_weights": {}, "trace": {"trace": ...}, "scale_by_learning_rate":
    {"count"}}`` with both.

    Args:
        lr: learning rate (float >= 0) or schedule.
        momentum: momentum coefficient, in [0, 1) (1 or more is refused: it diverges).
        nesterov: Nesterov momentum (requires ``momentum > 0``, as in torch).
        weight_decay: L2 penalty added to the gradient before momentum, >= 0.

    Returns:
        A :class:`GradientTransformation` (named after the function when nested in a chain).

    Raises:
        ValueError: for out-of-range hyper-parameters.

    Example:
        >>> from ftrain.optim import sgd
        >>> tx = sgd(0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    """
    momentum = momentum_coefficient("sgd", "momentum", momentum)
    if nesterov and momentum == 0.0:
        raise ValueError(f"sgd with nesterov=True requires a positive momentum, got {momentum=}")
    members = []
    if weight_decay != 0.0:
        members.append(add_decayed_weights(weight_decay))
    if momentum != 0.0:
        members.append(trace(momentum, nesterov))
    members.append(scale_by_learning_rate(lr))
    return chain(*members, name="sgd")


def adam(
    lr: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    fused: bool = False,
) -> GradientTransformation:
    """Adam, as ``torch.optim.Adam`` without weight decay.

    ``chain(scale_by_adam(b1, b2, eps), scale_by_learning_rate(lr))``; state
    ``{"scale_by_adam": {"count", "mu", "nu"}, "scale_by_learning_rate": {"count"}}``.

    Args:
        lr: learning rate (float >= 0) or schedule.
        b1: first-moment decay, in [0, 1).
        b2: second-moment decay, in [0, 1).
        eps: denominator epsilon, >= 0.
        fused: the moments and update in torch's fused Adam kernel (see
            :func:`~ftrain.optim.scale_by_adam`).

    Returns:
        A :class:`GradientTransformation` (named after the function when nested in a chain).

    Raises:
        ValueError: for out-of-range hyper-parameters.

    Example:
        >>> from ftrain.optim import adam
        >>> tx = adam(3e-4, b2=0.95)
    """
    return chain(scale_by_adam(b1, b2, eps, fused), scale_by_learning_rate(lr), name="adam")


def adamw(
    lr: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: _masks.Mask | None = None,
    fused: bool = False,
) -> GradientTransformation:
    """AdamW (decoupled weight decay), as ``torch.optim.AdamW``.

    ``chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(lr))``: the decay is scaled by the (scheduled) learning rate like
    torch's ``p *= 1 - lr * weight_decay``. State ``{"scale_by_adam": {"count", "mu", "nu"},
    "add_decayed_weights": {}, "scale_by_learning_rate": {"count"}}``.

    Args:
        lr: learning rate (float >= 0) or schedule.
        b1: first-moment decay, in [0, 1).
        b2: second-moment decay, in [0, 1).
        eps: denominator epsilon, >= 0.
        weight_decay: decoupled decay coefficient, >= 0.
        mask: which parameters decay (predicate on paths or TensorDict of bools; ``None``:
            all), e.g. ``masks.ndim_at_least(2)``; replaces torch's param groups.
        fused: torch's fused AdamW kernel (:mod:`ftrain.optim.fused`): the step's update
            of each parameter is one pass (decay, moments, rate and apply), as
            ``torch.optim.AdamW(fused=True)``; rounded in another order than the foreach
            chain (within 1e-6 of torch.optim in fp32); the same state either way.

    Returns:
        A :class:`GradientTransformation` (named after the function when nested in a chain).

    Raises:
        ValueError: for out-of-range hyper-parameters.

    Example:
        >>> from ftrain.optim import adamw, masks, schedule
        >>> tx = adamw(schedule.warmup_cosine(6e-4, 2000, 600_000, end=6e-5),
        ...            b2=0.95, weight_decay=0.1, mask=masks.ndim_at_least(2))
    """
    tx = chain(
        scale_by_adam(b1, b2, eps, fused),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(lr),
        name="adamw",
    )
    return applying_adamw(tx, b1, b2, eps, weight_decay, mask, rate_of(lr)) if fused else tx
