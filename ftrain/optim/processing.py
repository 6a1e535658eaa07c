"""Gradient processing as transforms: clipping, dynamic loss scaling, the cross-rank mean.

These used to be code inside the step; as transforms (optax's ``clip_by_global_norm`` and
``apply_if_finite`` shapes) they compose with any optimizer and keep their state, if any,
in the optimizer state. The step only computes gradients and applies updates::

    tx = dynamic_loss_scale(chain(clip_by_global_norm(1.0), adamw(6e-4)))  # fp16

Norms are computed in the leaves' dtype (an fp64 model gets an fp64 norm); mixed dtypes
are promoted to the widest one.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from tensordict import TensorDictBase

from ftrain.optim.base import (
    GradientTransformation,
    empty_state,
    flat_update,
    flatten,
    make_transform,
    member_state,
    new_td,
    refreshing_members,
)
from ftrain.optim.bucketed import (
    Body,
    Source,
    applies,
    applying,
    call_body,
    hands_on,
    mul,
    owning,
    prepare_of,
)
from ftrain.state.tree import rebuild, structure

__all__ = [
    "clip_by_global_norm",
    "clip_by_global_norm_torch",
    "dynamic_loss_scale",
    "global_norm",
    "mean_across_ranks",
]

Leaves = list[torch.Tensor]

# torch.amp.GradScaler's defaults.
GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL, INIT_SCALE = 2.0, 0.5, 2000, 2.0**16


def _positive(fn: str, name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{fn} requires a finite number for {name}, got {name}={value!r}")
    if value <= 0:
        raise ValueError(f"{fn} requires a positive {name}, got {name}={value!r}")
    return float(value)


class _LastNorm:
    """The norm of the last tensors asked for, while they are alive and unmodified.

    The step reports the gradients' norm and ``clip_by_global_norm`` then needs the norm of
    the very same tensors: remembering it saves a full read of the gradients (~5 % of an
    MLP step on a CPU). Weak references (nothing is kept alive) plus each tensor's version
    counter (bumped by every in-place op) make a hit mean "the same values" — but only
    where nothing writes the tensors behind autograd's back (``.data``, ``.numpy()``,
    ``dist.all_reduce`` bump no counter), so it is armed only inside
    :func:`remembered_norms`, around the library's own step.
    """

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []
        self.versions: list[int] = []
        self.norm: torch.Tensor | None = None

    def get(self, leaves: Leaves) -> torch.Tensor | None:
        if self.norm is None or len(leaves) != len(self.refs):
            return None
        for t, ref, v in zip(leaves, self.refs, self.versions, strict=True):
            if ref() is not t or t._version != v:
                return None
        return self.norm

    def put(self, leaves: Leaves, norm: torch.Tensor) -> torch.Tensor:
        self.refs = [weakref.ref(t) for t in leaves]
        self.versions = [t._version for t in leaves]
        self.norm = norm
        return norm


_LAST_NORM = threading.local()


@contextlib.contextmanager
def remembered_norms() -> Iterator[None]:
    """Within: :func:`global_norm_of` remembers the norm of the last tensors it was asked
    for. The library's step opens it from its gradient-norm metric to the end of its
    update, where nothing but ``tx`` touches the gradients. Outside, every call reads the
    tensors: a user's step may write gradients in place without bumping their version
    counters (an in-place ``dist.all_reduce`` between logging the norm and clipping), and
    a remembered norm would then clip by the old one."""
    _LAST_NORM.memo = _LastNorm()
    try:
        yield
    finally:
        _LAST_NORM.memo = None


def global_norm_of(leaves: Leaves) -> torch.Tensor:
    """The L2 norm of a list of tensors taken together, in their (widest) dtype, no host sync."""
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    if torch.compiler.is_compiling():  # in a graph the compiler dedupes it
        return _norm(leaves)
    if any(t.is_inference() for t in leaves):  # no version counters to trust
        return _norm(leaves)
    memo = getattr(_LAST_NORM, "memo", None)
    if memo is None:  # outside the library's step (see remembered_norms)
        return _norm(leaves)
    hit = memo.get(leaves)
    return hit if hit is not None else memo.put(leaves, _norm(leaves))


def _norm(leaves: Leaves) -> torch.Tensor:
    return _combine(torch._foreach_norm(leaves, 2))


def _streamed_norm(src: Source) -> torch.Tensor:
    """The global norm of a source's input, one bucket held at a time: per-leaf norms of
    each bucket, then their norm, which is exactly :func:`_norm` of the whole list."""
    if src.whole is not None:  # the step's own gradients: the grad-norm metric's memo
        return global_norm_of(src.whole)
    return _combine([n for span in src.spans for n in torch._foreach_norm(src.read(span), 2)])


def _combine(norms: Leaves) -> torch.Tensor:
    """The norm of per-leaf norms (the widest dtype when they are mixed)."""
    first = norms[0]
    if any(n.dtype != first.dtype or n.device != first.device for n in norms):
        dtype = first.dtype
        for n in norms:
            dtype = torch.promote_types(dtype, n.dtype)
        norms = [n.to(device=first.device, dtype=dtype) for n in norms]
    return torch.linalg.vector_norm(torch.stack(norms), 2)


def global_norm(tree: TensorDictBase) -> torch.Tensor:
    """The L2 norm of all leaves of a tree taken together (as ``clip_grad_norm_`` computes it).

    No host synchronisation: the result stays on the leaves' device, in their dtype.

    Args:
        tree: a nested TensorDict (e.g. gradients).

    Returns:
        A 0-d tensor (the leaves' dtype, the widest for mixed dtypes; float32 if empty).

    Raises:
        TypeError: if ``tree`` is not a TensorDict.

    Example:
        >>> from tensordict import TensorDict
        >>> global_norm(TensorDict({"a": torch.full((4,), 0.5), "b": {"c": torch.ones(3)}}))
        tensor(2.)
    """
    return global_norm_of(flatten(tree)[1])


def _scaled(leaves: Leaves, coef: torch.Tensor, owned: bool = False) -> Leaves:
    """Every leaf times ``coef`` (cast to each leaf's dtype; one kernel per dtype group),
    in place when the caller gave up ``leaves`` (``owned``)."""
    if all(t.dtype == coef.dtype for t in leaves):
        return mul(leaves, coef, owned)
    out = list(leaves)
    for dtype in {t.dtype for t in leaves}:
        idx = [i for i, t in enumerate(leaves) if t.dtype == dtype]
        scaled = mul([leaves[i] for i in idx], coef.to(dtype), owned)
        for i, v in zip(idx, scaled, strict=True):
            out[i] = v
    return out


def _clipper(name: str, max_norm: float, coefficient) -> GradientTransformation:
    max_norm = _positive(name, "max_norm", max_norm)

    def flat(keys, u, state, params):
        if not u:
            return u, empty_state()
        return _scaled(u, coefficient(global_norm_of(u), max_norm)), empty_state()

    def prepare(src: Source, state: TensorDictBase) -> Body:
        coef = coefficient(_streamed_norm(src), max_norm) if src.keys else None

        def body(idx, u, params, owned=False, donated=False):  # stateless
            return (_scaled(u, coef, owned) if u else u), empty_state()

        return owning(body)

    return make_transform(name, lambda params: empty_state(), flat, prepare=prepare)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale updates so that their global L2 norm is at most ``max_norm`` (optax's rule).

    ``updates * max_norm / max(norm, max_norm)``: unchanged (a factor of exactly 1) when the
    norm is within bounds, else scaled to norm ``max_norm``. The norm is in the leaves'
    dtype; no host sync (a non-finite norm gives non-finite updates). For
    ``torch.nn.utils.clip_grad_norm_``'s rule use :func:`clip_by_global_norm_torch`.

    Args:
        max_norm: the maximum global norm, > 0.

    Returns:
        A stateless :class:`GradientTransformation` named ``clip_by_global_norm``.

    Raises:
        ValueError: if ``max_norm`` is not a positive finite number.

    Example:
        >>> from ftrain.optim import adamw, chain
        >>> tx = chain(clip_by_global_norm(1.0), adamw(6e-4))
    """

    def coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
        return max_norm / torch.clamp(norm, min=max_norm)

    return _clipper("clip_by_global_norm", max_norm, coefficient)


def clip_by_global_norm_torch(max_norm: float) -> GradientTransformation:
    """``torch.nn.utils.clip_grad_norm_``'s rule: ``coef = min(max_norm / (norm + 1e-6), 1)``.

    Every leaf is multiplied by ``coef`` (always; no host sync). Use it to reproduce a
    PyTorch loop exactly; :func:`clip_by_global_norm` is optax's rule (no ``1e-6``).

    Args:
        max_norm: the maximum global norm, > 0.

    Returns:
        A stateless :class:`GradientTransformation` named ``clip_by_global_norm_torch``.

    Raises:
        ValueError: if ``max_norm`` is not a positive finite number.

    Example:
        >>> tx = clip_by_global_norm_torch(1.0)
    """

    def coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
        return torch.clamp(max_norm / (norm + 1e-6), max=1.0)

    return _clipper("clip_by_global_norm_torch", max_norm, coefficient)


def outermost_loss_scale(keys, leaves) -> torch.Tensor | None:
    """The ``scale`` leaf of a :func:`dynamic_loss_scale` that wraps the whole optimizer
    (its state at ``opt["loss_scale"]``), ``None`` if there is none.

    Raises:
        ValueError: a loss scale nested inside another transform (``chain(clip, dynamic_
            loss_scale(opt))``): the step would scale the loss by it while the transforms
            before it see the scaled gradients, so a clip clips them ``scale``× too hard.
    """
    found = [i for i, k in enumerate(keys) if tuple(k[-2:]) == ("loss_scale", "scale")]
    nested = [".".join(keys[i]) for i in found if len(keys[i]) != 2]
    if nested:
        raise ValueError(
            f"dynamic_loss_scale must be the outermost transform, found its state at "
            f"opt.{nested[0]}: the transforms before it would see gradients still multiplied "
            "by the loss scale (a clip would shrink them by about that factor, 2**16 at the "
            "start). Wrap the whole optimizer once: tx = dynamic_loss_scale(chain(clip_by_global_norm(c), optimizer))"
        )
    return leaves[found[0]] if found else None


def init_loss_scale(init_scale: float = INIT_SCALE) -> TensorDictBase:
    """The loss-scale counters: ``scale`` (float32), ``growth_tracker`` (int32), ``skipped``."""
    return new_td(
        {
            "scale": torch.tensor(init_scale, dtype=torch.float32),
            "growth_tracker": torch.tensor(0, dtype=torch.int32),
            "skipped": torch.tensor(0, dtype=torch.int64),
        }
    )


def _unscale(u: Leaves, ls: TensorDictBase, rule: tuple[float, float, int]):
    """GradScaler's unscale + non-finite check + scale update, out of place."""
    device = u[0].device if u else ls["scale"].device
    inv, found_inf = _inverse_scale(ls, device)
    unscaled = torch._foreach_mul(u, inv) if u else u
    _check_finite(unscaled, found_inf)
    return unscaled, _next_scale(ls, found_inf, rule, device), found_inf


def _inverse_scale(ls: TensorDictBase, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(1 / scale, found_inf = 0)`` on ``device``."""
    inv = ls["scale"].to(device).double().reciprocal().float()
    return inv, torch.zeros((), dtype=torch.float32, device=device)


def _check_finite(unscaled: Leaves, found_inf: torch.Tensor) -> None:
    """Set ``found_inf`` if any leaf has a non-finite value (it is never reset, so one flag
    collects the buckets of a bucketed update)."""
    if unscaled:  # the check only: multiplying by 1 is exact
        one = torch.ones((), dtype=torch.float32, device=found_inf.device)
        torch._amp_foreach_non_finite_check_and_unscale_(unscaled, found_inf, one)


def _next_scale(ls: TensorDictBase, found_inf: torch.Tensor, rule, device) -> TensorDictBase:
    """The loss-scale counters after this update (GradScaler's growth/backoff kernel)."""
    scale = ls["scale"].to(device, copy=True)
    tracker = ls["growth_tracker"].to(device, copy=True)
    torch._amp_update_scale_(scale, tracker, found_inf, *rule)
    skipped = ls["skipped"] + (found_inf > 0).to(ls["skipped"].device, torch.int64)
    return new_td(
        {
            "scale": scale.to(ls["scale"].device),
            "growth_tracker": tracker.to(ls["growth_tracker"].device),
            "skipped": skipped,
        }
    )


def _select_finite(found_inf, u, out, old_inner, new_inner, new_ls):
    """The skip without a branch (for compiled steps): where ``found_inf``, ``-0.0`` updates
    and the old inner state, else the inner update's results."""
    skip = found_inf > 0
    out = [torch.where(skip, torch.full_like(t, -0.0), v) for t, v in zip(u, out, strict=True)]
    layout, new_leaves = structure(new_inner)
    kept = [
        torch.where(skip.to(n.device), o, n)
        for o, n in zip(flatten(old_inner)[1], new_leaves, strict=True)
    ]
    return out, new_td({"loss_scale": new_ls, "inner": rebuild(layout, kept)})


def _scale_rule(fn: str, growth: float, backoff: float, interval: int) -> tuple:
    """GradScaler's own bounds: a scale that grows after finite steps and shrinks after
    a non-finite one, every ``interval`` (a whole number) steps."""
    growth, backoff = (
        _positive(fn, "growth_factor", growth),
        _positive(fn, "backoff_factor", backoff),
    )
    if growth <= 1.0 or backoff >= 1.0:
        raise ValueError(
            f"{fn} needs growth_factor > 1 and backoff_factor < 1 (as GradScaler), got "
            f"growth_factor={growth!r}, backoff_factor={backoff!r}"
        )
    whole = isinstance(interval, int) or (isinstance(interval, float) and interval.is_integer())
    if isinstance(interval, bool) or not whole or interval < 1:
        raise ValueError(
            f"{fn} needs a whole growth_interval >= 1, got growth_interval={interval!r}"
        )
    return growth, backoff, int(interval)


def dynamic_loss_scale(
    inner: GradientTransformation,
    *,
    init_scale: float = INIT_SCALE,
    growth_factor: float = GROWTH_FACTOR,
    backoff_factor: float = BACKOFF_FACTOR,
    growth_interval: int = GROWTH_INTERVAL,
) -> GradientTransformation:
    """fp16 dynamic loss scaling around ``inner`` (optax ``apply_if_finite`` shape).

    The step multiplies the loss by ``tree_get(opt_state, ("loss_scale", "scale"))``; this
    transform divides the gradients by it, and if any is not finite *skips* the update as
    ``torch.amp.GradScaler`` skips ``optimizer.step()``: ``inner``'s state (so also the LR
    schedule's count) is kept, the updates are ``-0.0`` (``p + -0.0 == p`` bit for bit),
    the scale backs off and ``skipped`` grows. Otherwise ``inner`` runs on the unscaled
    gradients. Scale growth/backoff follow GradScaler exactly (same kernels).

    The skip decision reads one flag on the host per update (as GradScaler's ``step()``).

    State: ``{"loss_scale": {"scale", "growth_tracker", "skipped"}, "inner": inner's}``.

    Args:
        inner: the optimizer to run on finite, unscaled gradients.
        init_scale: the first loss scale (GradScaler's 2**16).
        growth_factor: scale multiplier after ``growth_interval`` finite steps in a row.
        backoff_factor: scale multiplier after a non-finite step.
        growth_interval: finite steps between growths.

    Returns:
        A :class:`GradientTransformation` named ``dynamic_loss_scale``.

    Raises:
        ValueError: for a non-positive setting.

    Example:
        >>> from ftrain.optim import adamw
        >>> tx = dynamic_loss_scale(adamw(1e-3))
    """
    fn = "dynamic_loss_scale"
    init_scale = _positive(fn, "init_scale", init_scale)
    rule = _scale_rule(fn, growth_factor, backoff_factor, growth_interval)
    inner_flat = flat_update(inner)

    def init(params: TensorDictBase) -> TensorDictBase:
        return new_td({"loss_scale": init_loss_scale(init_scale), "inner": inner.init(params)})

    def flat(keys, u, state, params):
        ls = member_state(state, "loss_scale", fn)
        old_inner = member_state(state, "inner", fn)
        unscaled, new_ls, found_inf = _unscale(u, ls, rule)
        # no host read in a graph, nor of a meta tensor (the compiled step's cache warm-up
        # runs this on meta tensors so the inner caches fill before tracing): select instead
        if torch.compiler.is_compiling() or found_inf.is_meta:
            out, new_inner = inner_flat(keys, unscaled, old_inner, params)
            return _select_finite(found_inf, u, out, old_inner, new_inner, new_ls)
        if bool(found_inf):  # skipped: -0.0 leaves every parameter bit-identical
            out = [torch.full_like(t, -0.0) for t in u]
            # the old moments as new tensors: shared ones would be written in place by the
            # next donated step while an async save of the old (pinned) state reads them
            return out, new_td({"loss_scale": new_ls, "inner": old_inner.clone()})
        out, new_inner = inner_flat(keys, unscaled, old_inner, params)
        return out, new_td({"loss_scale": new_ls, "inner": new_inner})

    inner_prepare = prepare_of(inner)
    prepare = None
    if inner_prepare is not None:

        def prepare(src: Source, state: TensorDictBase) -> Body:
            ls = member_state(state, "loss_scale", fn)
            old_inner = member_state(state, "inner", fn)
            return _bucketed_loss_scale(src, ls, old_inner, rule, inner_prepare)

        if applies(inner_prepare):
            applying(prepare)

    # inner's frozen leaves are frozen here too: the step leaves them out of the update
    frozen_of, refresh = (
        getattr(inner.update, "frozen_of", None),
        refreshing_members([("inner", inner)], fn),
    )
    return make_transform(fn, init, flat, frozen_of, prepare, refresh)


def _bucketed_loss_scale(src: Source, ls, old_inner, rule, inner_prepare) -> Body:
    """``dynamic_loss_scale``'s bucketed form: the finiteness check over every bucket and the
    skip decision first (one host read, as the whole-tree form), then a leafwise body."""
    device = src.params[0].device if src.keys else ls["scale"].device
    inv, found_inf = _inverse_scale(ls, device)
    for span in src.spans:
        _check_finite(torch._foreach_mul(src.read(span), inv), found_inf)
    new_ls = _next_scale(ls, found_inf, rule, device)
    if bool(found_inf):  # skipped: -0.0 leaves every parameter bit-identical
        copied: list = []  # the old moments, copied once for every bucket

        def skipped(idx, u, params, owned=False, donated=False, apply=False):  # old state
            if apply:  # the parameters as they were: kept (donated) or copied
                out = params if donated else [p.clone() for p in params]
            else:
                out = [torch.full_like(t, -0.0) for t in u]
            # the old moments: kept when donated, else copied (shared, the next donated
            # step would write them while an async save of the old, pinned state reads)
            if not donated and not copied:
                copied.append(old_inner.clone())
            inner = old_inner.copy() if donated else copied[0]
            return out, new_td({"loss_scale": new_ls, "inner": inner})

        return _applying_if(inner_prepare, owning(skipped))

    def unscale(idx, u, params, owned=False):
        return (mul(u, inv, owned) if u else u), None

    inner_body = inner_prepare(src.then(unscale), old_inner)

    def body(idx, u, params, owned=False, donated=False, apply=False):
        unscaled = unscale(idx, u, params, owned)[0]  # new tensors, or u written: owned
        out, new_inner = call_body(inner_body, idx, unscaled, params, True, donated, apply)
        return out, new_td({"loss_scale": new_ls, "inner": new_inner})

    # unscale writes into owned updates
    return _applying_if(inner_prepare, owning(body, hands_on=hands_on(inner_body)))


def _applying_if(inner_prepare, body: Body) -> Body:
    """``body``, marked applying when the inner transform's prepare is."""
    return applying(body) if applies(inner_prepare) else body


def mean_across_ranks(group=None) -> GradientTransformation:
    """Average the updates over ``torch.distributed`` ranks (data parallelism), in one bucket.

    Stateless. The step uses it as its collective hook (``make_step(dp=True)``), before the
    grad-norm metric and ``tx``, so every rank sees the same gradients and the same norm.

    Args:
        group: the process group (default: the world).

    Returns:
        A :class:`GradientTransformation` named ``mean_across_ranks``; an identity when
        ``torch.distributed`` is not initialised or has one rank.

    Example:
        >>> tx = mean_across_ranks()
    """
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    def flat(keys, u, state, params):
        if not u or not (dist.is_available() and dist.is_initialized()):
            return u, empty_state()
        world = dist.get_world_size(group)
        if world == 1:
            return u, empty_state()
        bucket = _flatten_dense_tensors(u)  # a new buffer: the inputs stay as they were
        dist.all_reduce(bucket, group=group)
        bucket /= world
        return list(_unflatten_dense_tensors(bucket, u)), empty_state()

    return make_transform("mean_across_ranks", lambda params: empty_state(), flat)
