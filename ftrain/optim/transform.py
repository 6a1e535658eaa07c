"""Gradient transformations (optax ``transform.py`` style), written once, on flat leaf lists.

Each factory closes over its settings; its state holds only what changes. Every ``update``
is a :class:`~ftrain.optim.base.FlatUpdate` whose flat function is pure: it uses
out-of-place ``torch._foreach_*`` kernels (in-place ones only on tensors it just made, or,
in a bucketed update, on updates its caller gave up: ``owned``, :mod:`ftrain.optim.bucketed`).
Gradient processing (clipping, loss scaling, the cross-rank mean) is in
:mod:`ftrain.optim.processing`.

Counts (``count``: int64, 0-d) are created **on the CPU**, like the ``step`` of a
non-capturable ``torch.optim`` optimizer: bias corrections and schedules are evaluated on the
host and enter the foreach kernels as Python floats, which costs no device synchronisation,
launches no tiny kernels, and rounds exactly like ``torch.optim``'s Python-double scalars.
If a state is moved to an accelerator, the same code keeps working with device scalars
(no host sync either; the scalar is cast to the leaves' dtype to keep the fused path).
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDictBase

from ftrain.optim import masks as _masks
from ftrain.optim.base import (
    GradientTransformation,
    Path,
    check_keys,
    empty_state,
    flatten,
    make_transform,
    new_td,
    per_structure,
    unflatten,
)
from ftrain.optim.bucketed import leafwise, mul
from ftrain.optim.fused import adam_flat
from ftrain.optim.schedule import Schedule, rate_of

__all__ = [
    "add_decayed_weights",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "trace",
]

Leaves = list[torch.Tensor]


# ----------------------------------------------------------------------------- helpers


def _number(
    fn: str, name: str, value: float, *, low: float | None = None, high: float | None = None
) -> float:
    """Validate a hyper-parameter: finite, ``low <= value < high``; the error names it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{fn} requires a finite number for {name}, got {name}={value!r}")
    if low is not None and value < low:
        raise ValueError(f"{fn} requires {name} >= {low}, got {name}={value!r}")
    if high is not None and value >= high:
        raise ValueError(f"{fn} requires {name} < {high}, got {name}={value!r}")
    return float(value)


def momentum_coefficient(fn: str, name: str, value: float) -> float:
    """A momentum in ``[0, 1)``, as the command line's ``optim.momentum``: at 1 the buffer
    never decays (it grows without bound on a steady gradient), above 1 it grows faster
    every step, and the run diverges later rather than at once."""
    value = _number(fn, name, value, low=0.0)
    if value >= 1.0:
        raise ValueError(
            f"{fn} requires {name} < 1 (a momentum of 1 or more grows its buffer every step "
            f"until the run diverges; 0.9 is usual), got {name}={value!r}"
        )
    return value


def _zero_count() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64)


def _zeros_like_tree(params: TensorDictBase) -> TensorDictBase:
    keys, leaves = flatten(params)
    zeros = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves]
    return unflatten(keys, zeros, device=params.device)


def _state_leaves(state: TensorDictBase, name: str, keys: list[Path], what: str) -> Leaves:
    skeys, leaves = flatten(state[name])
    check_keys(keys, skeys, what)
    return leaves


def _leafwise(flat, *per_leaf: str):
    """The bucketed form of a built-in (every one is leafwise; its name is its flat's)."""
    name = flat.__qualname__.split(".<locals>", 1)[0]
    return leafwise(flat, name, per_leaf)


def _add(u: Leaves, params: Leaves, alpha: float, owned: bool) -> Leaves:
    """``u + alpha * params``: written into ``u`` when the caller gave it up (``owned``)."""
    if not owned:
        return torch._foreach_add(u, params, alpha=alpha)
    torch._foreach_add_(u, params, alpha=alpha)
    return u


def _scalar(value: torch.Tensor, leaves: Leaves) -> float | torch.Tensor:
    """A 0-d tensor as a foreach scalar: a Python float when it lives on the CPU (no device
    sync; rounds like torch.optim), else a device tensor in the leaves' dtype (fused path).
    Under ``torch.compile`` it stays a tensor: ``.item()`` would break the graph."""
    if value.device.type == "cpu" and not torch.compiler.is_compiling():
        return value.item()
    if leaves and leaves[0].dtype in (torch.float32, torch.float64):
        return value.to(leaves[0].dtype)
    return value


# ----------------------------------------------------------------------------- transforms


def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, fused: bool = False
) -> GradientTransformation:
    """Rescale updates by Adam's bias-corrected moments (``torch.optim.Adam(W)`` numerics).

    With ``t = count + 1``: ``mu = lerp(mu, g, 1 - b1)``, ``nu = b2 * nu + (1 - b2) * g**2``,
    ``update = (mu / (sqrt(nu) / sqrt(1 - b2**t) + eps)) / (1 - b1**t)``.

    ``fused=True`` computes the same formula in torch's fused Adam kernel (what
    ``torch.optim.Adam(fused=True)`` runs): one pass over gradient and moments instead of
    eight (the step's figures: docs/benchmarks.md, "Fused AdamW"). Moments and update are
    rounded in another order (100 AdamW steps land within 1e-6 of torch.optim in fp32,
    2e-15 in fp64, as torch's fused and foreach AdamW do of each other; bf16 and fp16
    leaves are computed in fp32 inside the kernel). Same state layout, so a run may switch
    it at a resume (the resumed steps are then rounded the other way).

    State: ``count`` (int64, 0-d, CPU), ``mu`` and ``nu`` (TensorDicts shaped like params).

    Args:
        b1: decay of the first moment, in [0, 1).
        b2: decay of the second moment, in [0, 1).
        eps: added to the denominator, >= 0.
        fused: use torch's fused kernel (floating-point leaves on a device it supports).

    Returns:
        A :class:`GradientTransformation` named ``scale_by_adam``.

    Raises:
        ValueError: if a hyper-parameter is out of range.

    Example:
        >>> from ftrain.optim import chain, scale_by_adam, scale_by_learning_rate
        >>> tx = chain(scale_by_adam(b2=0.95), scale_by_learning_rate(3e-4))
    """
    b1 = _number("scale_by_adam", "b1", b1, low=0.0, high=1.0)
    b2 = _number("scale_by_adam", "b2", b2, low=0.0, high=1.0)
    eps = _number("scale_by_adam", "eps", eps, low=0.0)

    def init(params: TensorDictBase) -> TensorDictBase:
        mu = _zeros_like_tree(params)
        return new_td({"count": _zero_count(), "mu": mu, "nu": mu.clone()})

    def flat(keys, g, state, params, owned=False, donated=False):
        mu = _state_leaves(state, "mu", keys, "scale_by_adam state 'mu'")
        nu = _state_leaves(state, "nu", keys, "scale_by_adam state 'nu'")
        count = state["count"] + 1
        if not g:
            return g, new_td({"count": count, "mu": {}, "nu": {}})
        if donated:  # torch.optim's in-place moments: the same kernels, the same bits
            torch._foreach_lerp_(mu, g, 1.0 - b1)
            torch._foreach_mul_(nu, b2)
        else:
            mu = torch._foreach_lerp(mu, g, 1.0 - b1)
            nu = torch._foreach_mul(nu, b2)
        torch._foreach_addcmul_(nu, g, g, 1.0 - b2)
        t = count.to(torch.float64)
        bc1 = _scalar(1.0 - b1**t, g)
        bc2_sqrt = _scalar(torch.sqrt(1.0 - b2**t), g)
        denom = torch._foreach_sqrt(nu)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, eps)
        # donated, g is dead now and the update goes into it (the same division, no new
        # buffer); pure, a new buffer holds the next params anyway, so a copy would not pay
        if owned and donated:
            torch._foreach_copy_(g, mu)
            torch._foreach_div_(g, denom)
            out = g
        else:
            out = torch._foreach_div(mu, denom)
        del denom  # freed before the last pass: one fewer set of buffers at the peak
        torch._foreach_div_(out, bc1)
        dev = state["mu"].device
        return out, new_td(
            {
                "count": count,
                "mu": unflatten(keys, mu, device=dev),
                "nu": unflatten(keys, nu, device=dev),
            }
        )

    if fused:
        flat = adam_flat(b1, b2, eps, foreach=flat)
    prepare = leafwise(flat, "scale_by_adam", ("mu", "nu"))
    return make_transform("scale_by_adam", init, flat, prepare=prepare)


def add_decayed_weights(
    weight_decay: float = 0.0, mask: _masks.Mask | None = None
) -> GradientTransformation:
    """Add ``weight_decay * param`` to the updates of the leaves ``mask`` selects.

    Before ``scale_by_adam`` this is L2 regularisation (``torch.optim.SGD``'s weight decay);
    after it and before ``scale_by_learning_rate`` it is AdamW's decoupled decay.

    Args:
        weight_decay: the decay coefficient, >= 0.
        mask: which leaves decay: a predicate ``(path, tensor) -> bool`` (see
            :mod:`ftrain.optim.masks`), a TensorDict of bools, or ``None`` for all leaves.
            Resolved once per parameter structure and cached.

    Returns:
        A stateless :class:`GradientTransformation` named ``add_decayed_weights``; its
        ``update`` requires ``params``.

    Raises:
        ValueError: for a negative or non-finite ``weight_decay``; at update time if
            ``params`` is missing.

    Example:
        >>> from ftrain.optim import add_decayed_weights, masks
        >>> tx = add_decayed_weights(0.1, mask=masks.ndim_at_least(2))
    """
    wd = _number("add_decayed_weights", "weight_decay", weight_decay, low=0.0)
    predicate = _masks.to_predicate(mask)
    cache: dict[tuple[Path, ...], list[int] | None] = {}

    def resolve(keys: list[Path], params: Leaves) -> list[int] | None:
        idx = _masks.resolve(predicate, keys, params)
        return None if len(idx) == len(keys) else idx

    def selected(keys: list[Path], params: Leaves) -> list[int] | None:
        """Indices to decay, or None for all of them."""
        if predicate is None:
            return None
        return per_structure(cache, tuple(keys), lambda: resolve(keys, params))

    def init(params: TensorDictBase) -> TensorDictBase:
        return empty_state()

    def flat(keys, u, state, params, owned=False):
        if params is None:
            raise ValueError(
                "add_decayed_weights needs the parameters: call update(updates, state, params)"
            )
        idx = selected(keys, params)
        if wd == 0.0 or not u or idx == []:
            return u, empty_state()
        if idx is None:
            return _add(u, params, wd, owned), empty_state()
        out = list(u)
        decayed = _add([u[i] for i in idx], [params[i] for i in idx], wd, owned)
        for i, v in zip(idx, decayed, strict=True):
            out[i] = v
        return out, empty_state()

    return make_transform("add_decayed_weights", init, flat, prepare=_leafwise(flat))


def scale_by_learning_rate(learning_rate: float | Schedule) -> GradientTransformation:
    """Multiply updates by ``-learning_rate`` (descent), with a schedule of the step count.

    The rate of an update is ``schedule(count)`` *before* the count advances, so the first
    update uses ``schedule(0)`` (like ``LambdaLR``). The rate is recomputed from the count
    at every update (a schedule changed on resume applies at once); the state also shows
    the rate the *next* update applies, as optax's ``inject_hyperparams`` shows its
    hyper-parameters: ``tree_get(opt_state, "learning_rate")``.

    State: ``count`` (int64, 0-d, CPU): updates applied so far; ``learning_rate`` (float64,
    0-d): ``schedule(count)``.

    Args:
        learning_rate: a non-negative float or a schedule ``count -> value``
            (see :mod:`ftrain.optim.schedule`).

    Returns:
        A :class:`GradientTransformation` named ``scale_by_learning_rate``.

    Raises:
        ValueError: for a negative or non-finite float rate.
        TypeError: if ``learning_rate`` is neither a number nor callable.

    Example:
        >>> from tensordict import TensorDict
        >>> from ftrain.optim import scale_by_learning_rate, schedule
        >>> tx = scale_by_learning_rate(schedule.warmup_cosine(6e-4, 100, 5000))
        >>> float(tx.init(TensorDict())["learning_rate"])
        0.0
    """
    if callable(learning_rate):
        schedule, const = learning_rate, None
    elif isinstance(learning_rate, int | float) and not isinstance(learning_rate, bool):
        schedule = None
        const = _number("scale_by_learning_rate", "learning_rate", learning_rate, low=0.0)
    else:
        raise TypeError(
            f"learning_rate must be a float or a schedule count -> value, got {learning_rate!r}"
        )

    rate = rate_of(learning_rate)

    def init(params: TensorDictBase) -> TensorDictBase:
        count = _zero_count()
        return new_td({"count": count, "learning_rate": rate(count)})

    def flat(keys, u, state, params, owned=False):
        count = state["count"]
        factor = -const if schedule is None else _scalar(-rate(count), u)
        out = mul(u, factor, owned) if u else u
        return out, new_td({"count": count + 1, "learning_rate": rate(count + 1)})

    def refresh(state: TensorDictBase) -> TensorDictBase:  # the shown rate, this schedule's
        count = state["count"]
        return new_td({"count": count, "learning_rate": rate(count)})

    return make_transform(
        "scale_by_learning_rate", init, flat, prepare=_leafwise(flat), refresh=refresh
    )


def scale(factor: float) -> GradientTransformation:
    """Multiply updates by a constant ``factor``.

    Args:
        factor: a finite number.

    Returns:
        A stateless :class:`GradientTransformation` named ``scale``.

    Raises:
        ValueError: if ``factor`` is not finite.

    Example:
        >>> from ftrain.optim import chain, scale, scale_by_adam
        >>> tx = chain(scale_by_adam(), scale(-1e-3))  # plain Adam with a fixed rate
    """
    factor = _number("scale", "factor", factor)

    def init(params: TensorDictBase) -> TensorDictBase:
        return empty_state()

    def flat(keys, u, state, params, owned=False):
        return (mul(u, factor, owned) if u else u), empty_state()

    return make_transform("scale", init, flat, prepare=_leafwise(flat))


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum, exactly as ``torch.optim.SGD`` (dampening 0) computes it.

    ``trace = decay * trace + g`` (the zero-initialised buffer makes the first step's buffer
    ``g``, torch's first-step rule); the update is ``trace``, or ``g + decay * trace`` with
    Nesterov momentum.

    State: ``trace`` (a TensorDict shaped like params).

    Args:
        decay: the momentum coefficient, in [0, 1).
        nesterov: use Nesterov momentum (requires ``decay > 0``).

    Returns:
        A :class:`GradientTransformation` named ``trace``.

    Raises:
        ValueError: for a ``decay`` outside [0, 1) or not finite, or ``nesterov`` with zero
            decay.

    Example:
        >>> from ftrain.optim import chain, scale_by_learning_rate, trace
        >>> tx = chain(trace(0.9, nesterov=True), scale_by_learning_rate(0.1))
    """
    decay = momentum_coefficient("trace", "decay", decay)
    if nesterov and decay == 0.0:
        raise ValueError(f"trace with nesterov=True requires a positive decay, got {decay=}")

    def init(params: TensorDictBase) -> TensorDictBase:
        return new_td({"trace": _zeros_like_tree(params)})

    def flat(keys, g, state, params, owned=False, donated=False):  # new or the state's
        buf = _state_leaves(state, "trace", keys, "trace state 'trace'")
        if not g:
            return g, new_td({"trace": {}})
        if donated:
            torch._foreach_mul_(buf, decay)
        else:
            buf = torch._foreach_mul(buf, decay)
        torch._foreach_add_(buf, g)
        # pure: the update may share storage with the new state (nobody mutates either)
        out = torch._foreach_add(g, buf, alpha=decay) if nesterov else buf
        return out, new_td({"trace": unflatten(keys, buf, device=state["trace"].device)})

    # its update is its new state's buffer (no nesterov): never handed on owned
    prepare = leafwise(flat, "trace", ("trace",), aliases_state=True)
    return make_transform("trace", init, flat, prepare=prepare)
