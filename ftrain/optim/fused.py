"""torch's fused Adam kernels behind ``scale_by_adam(fused=True)`` and ``adamw(fused=True)``.

Why. The chain runs one transform at a time: AdamW with clipping is ~13 passes over
parameter-sized buffers, where ``torch.optim.AdamW(fused=True)`` reads gradient, moments
and parameter once and writes them once. Two levels use the kernel:

* ``scale_by_adam(fused=True)`` computes Adam's moments and update in
  ``torch._fused_adam_`` (:func:`adam_flat`): a drop-in member of any chain, whose output
  is an update like the foreach form's.
* ``adamw(fused=True)`` adds an *applying* bucketed form (:func:`applying_adamw`): the step
  asks it for the new parameters (:mod:`ftrain.optim.bucketed`, "Applied updates"), and it
  runs ``torch._fused_adamw_`` on the parameters themselves, which folds the decay, the
  rate and ``p + u`` into the same pass: torch's fused AdamW, written into the donated
  buffers, or into copies when the step is pure.

Numerics: the same formula rounded in another order than the foreach chain (100 steps land
within 1e-6 of ``torch.optim`` in fp32 and 2e-15 in fp64, as torch's own fused and foreach
AdamW do of each other; tested). bf16 and fp16 leaves are computed in fp32 inside the
kernel. The state is the foreach form's, entry for entry, so a run may switch kernels at a
resume. Under ``torch.compile`` the foreach form runs (the compiler fuses it, and it
cannot functionalise the kernels' in-place writes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDictBase

from ftrain.optim import masks as _masks
from ftrain.optim.base import (
    GradientTransformation,
    check_keys,
    empty_state,
    flatten,
    make_transform,
    new_td,
    per_structure,
    pick,
    unflatten,
)
from ftrain.optim.bucketed import Body, Source, applying, call_body, owning, prepare_of
from ftrain.optim.buffers import BufferPool, clones, unpooled

__all__ = ["adam_flat", "applying_adamw"]

Leaves = list[torch.Tensor]


def adam_flat(b1: float, b2: float, eps: float, foreach):
    """``scale_by_adam``'s flat update in ``torch._fused_adam_`` (``foreach``: the foreach
    form, run under ``torch.compile``).

    The kernel updates its "params" in place as ``p - lr / bc1 * mu / denom``; run on a
    zero buffer with ``lr = -1`` the result is Adam's update ``mu / denom / bc1``
    (``0 - x`` is ``-x``). The moments are written in place: the state's own when the step
    donates it, else copies (the input state is never touched).
    """

    def flat(keys, g, state, params, owned=False, donated=False):
        if torch.compiler.is_compiling():
            return foreach(keys, g, state, params)
        mu, nu = _moments(state, keys, donated)
        count = state["count"] + 1
        if not g:
            return g, new_td({"count": count, "mu": {}, "nu": {}})
        out = [torch.zeros_like(t, memory_format=torch.preserve_format) for t in g]
        _fused(torch._fused_adam_, out, g, mu, nu, count, lr=-1.0, b1=b1, b2=b2, eps=eps)
        return out, _adam_state(keys, count, mu, nu, state["mu"].device)

    return flat


def applying_adamw(
    tx: GradientTransformation,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    mask: _masks.Mask | None,
    rate: Callable[[torch.Tensor], torch.Tensor],
) -> GradientTransformation:
    """``tx`` (``adamw(..., fused=True)``'s chain) with an applying bucketed form: asked to
    apply, each bucket's parameters are updated by ``torch._fused_adamw_`` in one pass.

    Args:
        tx: the chain ``scale_by_adam(fused) | add_decayed_weights | scale_by_learning_rate``
            named ``adamw``; its ``init``, whole-tree ``update`` and plain bucketed form are
            kept as they are.
        b1, b2, eps, weight_decay, mask: AdamW's settings (as given to that chain).
        rate: ``count -> learning rate`` of its ``scale_by_learning_rate``.
    """
    plain_prepare = prepare_of(tx)
    predicate = _masks.to_predicate(mask)
    decayed_cache: dict = {}
    pool = BufferPool()  # the pure step's copies, in the buffers of the state 2 steps back

    def decays(keys, params) -> list[bool]:
        if weight_decay == 0.0:
            return [False] * len(keys)
        if predicate is None:
            return [True] * len(keys)
        idx = per_structure(
            decayed_cache, tuple(keys), lambda: set(_masks.resolve(predicate, keys, params))
        )
        return [i in idx for i in range(len(keys))]

    def prepare(src: Source, state: TensorDictBase) -> Body:
        plain: list[Body] = []  # the chain's own body, made only if asked for updates
        adam, lr_state = state["scale_by_adam"], state["scale_by_learning_rate"]
        moments = [_leaves(adam, name, src.keys) for name in ("mu", "nu")]  # once, not per bucket
        lr_count = lr_state["count"]
        lr = float(rate(lr_count))  # counts live on the CPU: a Python double, as torch.optim
        copy_bytes = 3 * sum(p.numel() * p.element_size() for p in src.params or ())
        copies = pool.copies if pool.admits(copy_bytes) else unpooled
        done = {"count": lr_count + 1, "learning_rate": rate(lr_count + 1)}

        def body(idx, g, params, owned=False, donated=False, apply=False):
            if not apply:
                plain[:] = plain or [plain_prepare(src, state)]
                return call_body(plain[0], idx, g, params, owned, donated)
            keys = pick(idx, src.keys)
            bucket = (idx[0], len(idx)) if idx else ()
            if donated:
                mu, nu = (pick(idx, m) for m in moments)
                new = params
            else:
                mu, nu = (
                    copies((n, *bucket), pick(idx, m)) for n, m in zip("mv", moments, strict=True)
                )
                new = copies(("p", *bucket), params)
            count = adam["count"] + 1
            wd = decays(keys, params)
            for part, rate_wd in ((_where(wd, True), weight_decay), (_where(wd, False), 0.0)):
                if part:
                    lists = (pick(part, t) for t in (new, g, mu, nu))
                    _fused(torch._fused_adamw_, *lists, count, lr, b1, b2, eps, rate_wd)
            adam_new = _adam_state(keys, count, mu, nu, adam["mu"].device)
            return new, new_td(
                {
                    "scale_by_adam": adam_new,
                    "add_decayed_weights": empty_state(),
                    "scale_by_learning_rate": new_td(done),
                }
            )

        return applying(owning(body))

    return make_transform(
        "adamw",
        tx.init,
        tx.update.flat,
        tx.update.frozen_of,
        prepare=applying(prepare),
        refresh=tx.update.refresh,
    )


def _fused(kernel, params, grads, mu, nu, count, lr, b1, b2, eps, weight_decay=0.0) -> None:
    """``kernel`` over the leaves, one call per (device, dtype): a call takes one of each."""
    for idx in _by_device_and_dtype(grads):
        # float32, as torch.optim keeps it (exact to 2**24 steps, far past b**t == 0)
        step = count.to(device=grads[idx[0]].device, dtype=torch.float32)
        written = [pick(idx, t) for t in (params, mu, nu)]
        kernel(
            written[0],
            pick(idx, grads),
            *written[1:],
            [],
            [step] * len(idx),
            lr=lr,
            beta1=b1,
            beta2=b2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
        )
        # the fused kernels write in place without bumping version counters (torch 2.13):
        # an incremental save keys "unchanged" on (object, version), so a donated leaf
        # written here must read as changed
        for leaves in written:
            torch.autograd.graph.increment_version(leaves)


def _leaves(state: TensorDictBase, name: str, keys) -> Leaves:
    """The leaves of the moment ``name``, checked to be those of ``keys``."""
    skeys, leaves = flatten(state[name])
    check_keys(keys, skeys, f"scale_by_adam state {name!r}")
    return leaves


def _moments(state: TensorDictBase, keys, donated: bool) -> tuple[Leaves, Leaves]:
    """The state's moment leaves for ``keys``: its own buffers when donated, else copies."""
    mu, nu = (_leaves(state, name, keys) for name in ("mu", "nu"))
    return (mu, nu) if donated else (clones(mu), clones(nu))


def _adam_state(keys, count, mu: Leaves, nu: Leaves, device) -> TensorDictBase:
    return new_td(
        {
            "count": count,
            "mu": unflatten(keys, mu, device=device),
            "nu": unflatten(keys, nu, device=device),
        }
    )


def _where(flags: list[bool], value: bool) -> list[int]:
    return [i for i, f in enumerate(flags) if f is value]


def _by_device_and_dtype(leaves: Leaves) -> list[list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(leaves):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())
