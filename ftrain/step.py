"""The pure training step: ``step(state, batch) -> (new_state, metrics)``.

The module object is only a *function* here: :func:`make_step` binds it to the state's
parameters for each call with ``torch.func.functional_call`` and never changes its
parameters. Gradients are taken with respect to detached views of the state's leaves,
updates are applied out of place, and a new locked state is returned, so the input
state stays bit-for-bit what it was (unless ``donate=True``, see :func:`make_step`).

Randomness (dropout) comes from a local generator seeded by
``rng.step_key(state["rng"], state["step"], STREAM_DROPOUT, rank)``: recomputing a step
from the same state gives the same result, and a resumed run draws the same keys.

Mixed precision follows ``torch.amp``: ``bf16`` runs the forward pass under autocast;
``fp16`` also scales the loss dynamically with ``torch.amp.GradScaler``'s rules, its
state living in ``state["amp"]``. A step whose gradients are not finite is *skipped* as
GradScaler skips ``optimizer.step()``: params and optimizer state (so also the LR
schedule's count) stay unchanged, the loss scale backs off, ``amp.skipped`` grows, and
``step`` and the data cursor still advance — the batch was consumed.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.func import functional_call

from ftrain import rng
from ftrain.nn import use_generator
from ftrain.optim.base import FlatUpdate
from ftrain.state.init import check_usable, is_pinned, mark_donated
from ftrain.state.tree import Key, flatten, new_td, unflatten

__all__ = ["Step", "evaluate", "make_eval_step", "make_step"]

Step = Callable[[TensorDictBase, TensorDictBase], tuple[TensorDict, TensorDict]]
LossFn = Callable[[nn.Module, TensorDictBase], "torch.Tensor | tuple[torch.Tensor, Mapping]"]

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# torch.amp.GradScaler's defaults.
_GROWTH_FACTOR, _BACKOFF_FACTOR, _GROWTH_INTERVAL = 2.0, 0.5, 2000


class _Bound(nn.Module):
    """``loss_fn(model, batch)`` as a module, so ``functional_call`` can bind parameters."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: TensorDictBase):
        return self.loss_fn(self.model, batch)


def _as_tensordict(batch) -> TensorDictBase:
    if isinstance(batch, TensorDictBase):
        return batch
    if isinstance(batch, Mapping):
        return TensorDict(dict(batch), batch_size=[])
    raise TypeError(
        f"a batch must be a TensorDict or a mapping of tensors, got {type(batch).__name__}"
    )


def _split_batch(batch, k: int) -> tuple[TensorDictBase | None, list[TensorDictBase]]:
    """Pull out the loader's ``cursor`` and cut the rest into ``k`` micro-batches on dim 0."""
    batch = _as_tensordict(batch)
    cursor = batch.get("cursor", None)
    payload = batch.exclude("cursor") if cursor is not None else batch
    if k == 1:
        return cursor, [payload]
    keys, leaves = flatten(payload)
    sizes = {tuple(t.shape[:1]) for t in leaves}
    if len(sizes) != 1 or not sizes.pop() or leaves[0].shape[0] % k:
        shapes = {".".join(kk): tuple(t.shape) for kk, t in zip(keys, leaves, strict=True)}
        raise ValueError(
            f"grad_accum={k} needs every batch leaf to share a leading dim divisible by {k}; "
            f"got shapes {shapes}"
        )
    chunks = [t.chunk(k) for t in leaves]
    return cursor, [unflatten(keys, [c[i] for c in chunks]) for i in range(k)]


def _named(prefix: str, keys: list[Key], leaves: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + ".".join(k): t for k, t in zip(keys, leaves, strict=True)}


def _loss_and_aux(out) -> tuple[torch.Tensor, Mapping]:
    loss, aux = out if isinstance(out, tuple) else (out, {})
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"loss_fn must return a scalar tensor or (scalar tensor, dict), got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    return loss.reshape(()), aux


def _merge_aux(total: dict[str, torch.Tensor], aux: Mapping, k: int) -> None:
    """Sum integer aux metrics (counts) over micro-batches; average floating ones."""
    for name, value in aux.items():
        v = torch.as_tensor(value).detach()
        v = v if not v.is_floating_point() else v.float() / k
        total[name] = total[name] + v if name in total else v


class _Binder:
    """Puts the state's leaves into the module's parameter and buffer slots for one call.

    What ``functional_call(..., tie_weights=True)`` does, minus its per-call work: the slots
    (owner module, ``_parameters``/``_buffers`` dict, attribute; every alias of a tied
    tensor) are looked up once and again only when the module tree changes (checked by
    identity of its submodules on every call, which also gives the train-mode check).
    At GPT-2 tiny size ``functional_call`` cost ~0.5 ms a step (~3 %). A path the slots
    do not know (e.g. a parametrized module) falls back to ``functional_call``.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules: tuple[nn.Module, ...] = ()
        self.slots: dict[Key, list[tuple[dict, str]]] = {}

    def refresh(self) -> tuple[nn.Module, ...]:
        mods = tuple(self.model.modules())
        if mods != self.modules:
            self.modules, self.slots = mods, _slots(self.model)
        return mods

    @contextlib.contextmanager
    def bind(self, keys: list[Key], leaves: list[torch.Tensor]):
        saved: list[tuple[dict, str, torch.Tensor]] = []
        try:
            for key, leaf in zip(keys, leaves, strict=True):
                for table, attr in self.slots[key]:
                    saved.append((table, attr, table[attr]))
                    table[attr] = leaf
            yield
        finally:
            for table, attr, old in reversed(saved):
                table[attr] = old


def _slots(model: nn.Module) -> dict[Key, list[tuple[dict, str]]]:
    """Path of each parameter/buffer (first name of a tied tensor) -> all slots holding it."""
    if any(hasattr(m, "parametrizations") for m in model.modules()):
        return {}  # parametrized weights are properties: let functional_call handle them
    slots: dict[Key, list[tuple[dict, str]]] = {}
    first: dict[int, Key] = {}
    for owner_name, owner in model.named_modules(remove_duplicate=False):
        prefix = tuple(owner_name.split(".")) if owner_name else ()
        for table in (owner._parameters, owner._buffers):
            for attr, t in table.items():
                if t is None:
                    continue
                path = first.setdefault(id(t), (*prefix, attr))
                slots.setdefault(path, []).append((table, attr))
                if path != (*prefix, attr):  # an alias also answers to its own name
                    slots[(*prefix, attr)] = slots[path]
    return slots


class _Grads:
    """Forward + backward over the micro-batches of one step, accumulating gradients."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, autocast: torch.dtype | None) -> None:
        self.bound = _Bound(model, loss_fn)
        self.binder = _Binder(model)
        self.autocast = autocast

    def __call__(self, pkeys, params, bkeys, buffers, micro, gen, loss_scale):
        leaves = [p.detach().requires_grad_() for p in params]
        keys, values = pkeys + bkeys, leaves + buffers
        grads, loss_sum, aux_total = None, None, {}
        k = len(micro)
        with _train_mode(self.binder.refresh()):
            fast = all(key in self.binder.slots for key in keys)
            for mb in micro:
                loss, aux = self._forward(keys, values, fast, mb, gen, leaves[0].device)
                scaled = loss / k if loss_scale is None else loss * (loss_scale / k)
                g = torch.autograd.grad(scaled, leaves, allow_unused=True)
                g = [
                    torch.zeros_like(t) if gi is None else gi
                    for t, gi in zip(leaves, g, strict=True)
                ]
                grads = g if grads is None else torch._foreach_add(grads, g)
                loss_sum = (
                    loss.detach().float() if loss_sum is None else loss_sum + loss.detach().float()
                )
                _merge_aux(aux_total, aux, k)
        return grads, loss_sum / k, aux_total

    def _forward(self, keys, values, fast, mb, gen, device):
        with (
            use_generator(gen),
            torch.autocast(
                device.type, dtype=self.autocast or torch.float32, enabled=self.autocast is not None
            ),
        ):
            if fast:
                with self.binder.bind(keys, values):
                    out = self.bound(mb)
            else:
                named = _named("model.", keys, values)
                out = functional_call(self.bound, named, (mb,), tie_weights=True, strict=False)
        return _loss_and_aux(out)


def _all_reduce_mean(grads: list[torch.Tensor]) -> None:
    """Average gradients over data-parallel ranks in one flat bucket."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    torch._foreach_copy_(grads, list(_unflatten_dense_tensors(flat, grads)))


def _unscale(grads: list[torch.Tensor], amp: TensorDictBase) -> tuple[TensorDict, torch.Tensor]:
    """GradScaler.unscale_ + update: unscale grads in place, back off or grow the scale."""
    scale = amp["scale"].to(grads[0].device).clone()
    tracker = amp["growth_tracker"].to(grads[0].device).clone()
    found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
    torch._amp_foreach_non_finite_check_and_unscale_(
        grads, found_inf, scale.double().reciprocal().float()
    )
    torch._amp_update_scale_(
        scale, tracker, found_inf, _GROWTH_FACTOR, _BACKOFF_FACTOR, _GROWTH_INTERVAL
    )
    skipped = amp["skipped"] + (found_inf > 0).to(amp["skipped"].device, torch.int64)
    new_amp = TensorDict(
        scale=scale.to(amp["scale"].device),
        growth_tracker=tracker.to(amp["growth_tracker"].device),
        skipped=skipped,
        batch_size=[],
    )
    return new_amp, found_inf


def _global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)).float())


def _clip_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    # torch.nn.utils.clip_grad_norm_'s rule; a tensor coefficient keeps it free of host syncs.
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].dtype))


def _apply(state, tx, pkeys, params, grads, donate: bool):
    """Run the optimizer and add its updates to the params (in place only when donating).

    A built-in optimizer (a :class:`FlatUpdate`) runs on the flat, sorted leaf lists the step
    already holds: no TensorDict is built for the gradients or the updates, and the params
    are not flattened again (at GPT-2 tiny size that rebuilding was ~5 % of a CPU step).
    """
    if isinstance(tx.update, FlatUpdate):
        with torch.no_grad():
            upd, opt = tx.update.flat(pkeys, grads, state["opt"], params, donate)
    else:  # a user-written update over TensorDicts
        updates, opt = tx.update(
            unflatten(pkeys, grads), state["opt"], state["params"], donate=donate
        )
        upd = [updates.get(k) for k in pkeys]
    with torch.no_grad():
        if donate:
            torch._foreach_add_(params, upd)
            return unflatten(pkeys, params), opt
        return unflatten(pkeys, torch._foreach_add(params, upd)), opt


def _check_args(grad_accum: int, precision: str, clip: float | None) -> None:
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be a positive int, got {grad_accum=}")
    if precision not in _AUTOCAST:
        raise ValueError(f"precision must be one of {sorted(_AUTOCAST)}, got {precision=}")
    if clip is not None and not (isinstance(clip, int | float) and clip > 0):
        raise ValueError(f"clip must be a positive max grad norm or None, got {clip=}")


def _default_rank_world(dp: bool | None) -> tuple[int, bool]:
    active = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if active else 0
    if dp is None:
        dp = active and dist.get_world_size() > 1
    elif dp and not active:
        raise RuntimeError("dp=True needs torch.distributed initialised (launch with torchrun)")
    return rank, dp


def _metrics(loss, grad_norm, lr, micro, aux) -> TensorDict:
    samples = sum(_leading(mb) for mb in micro)
    out = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "samples": torch.tensor(samples)}
    out = {k: v for k, v in out.items() if v is not None}
    out.setdefault("tokens", aux.get("tokens", torch.tensor(samples)))
    out.update({k: v for k, v in aux.items() if k not in out})
    return new_td(out)


def _leading(mb: TensorDictBase) -> int:
    leaves = flatten(mb)[1]
    return int(leaves[0].shape[0]) if leaves and leaves[0].dim() else 1


def make_step(
    model: nn.Module,
    loss_fn: LossFn,
    tx,
    *,
    grad_accum: int = 1,
    precision: str = "fp32",
    clip: float | None = None,
    donate: bool = False,
    dp: bool | None = None,
) -> Step:
    """Build the pure training step for ``model`` trained with ``loss_fn`` and optimizer ``tx``.

    Args:
        model: the module used as a function; its own parameters are never changed.
        loss_fn: ``loss_fn(model, batch) -> loss`` or ``(loss, aux_metrics)``, ordinary PyTorch;
            during the call ``model`` is bound to the state's params.
        tx: an ``ftrain.optim.GradientTransformation``.
        grad_accum: micro-batches per step; the batch's leading dim is cut into this many,
            gradients are averaged, and one optimizer update is made (a step is a whole update).
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + dynamic loss scale).
        clip: clip gradients to this global norm before the optimizer (``None``: no clipping).
        donate: update params and optimizer buffers in place (memory parity with torch.optim);
            the input state is then unusable and passing it again raises. A state pinned by
            an in-flight async checkpoint save (:func:`ftrain.state.pin`) is updated out of
            place instead, so the save never sees a later step's values.
        dp: all-reduce gradients over ``torch.distributed`` ranks (default: when initialised
            with more than one rank).

    Returns:
        ``step(state, batch) -> (new_state, metrics)``. ``batch`` is a TensorDict (or mapping);
        its optional ``cursor`` entry (from ``ftrain.data``) becomes ``new_state["data"]``.
        ``metrics`` holds ``loss``, ``grad_norm`` (before clipping), ``lr`` (of this update),
        ``samples``, ``tokens`` and ``loss_fn``'s aux metrics, as tensors (no host sync).

    Example:
        >>> import ftrain, torch
        >>> model = torch.nn.Linear(3, 1)
        >>> def mse(m, b):
        ...     return ((m(b["x"]) - b["y"]) ** 2).mean()
        >>> tx = ftrain.optim.sgd(0.1)
        >>> state = ftrain.init_state(model, tx, seed=0)
        >>> step = make_step(model, mse, tx)
        >>> new, metrics = step(state, {"x": torch.ones(4, 3), "y": torch.zeros(4, 1)})
        >>> int(new["step"]), int(state["step"])
        (1, 0)
    """
    _check_args(grad_accum, precision, clip)
    rank, dp = _default_rank_world(dp)
    grads_of = _Grads(model, loss_fn, _AUTOCAST[precision])
    fp16 = precision == "fp16"

    def step(state: TensorDictBase, batch) -> tuple[TensorDict, TensorDict]:
        check_usable(state, "step")
        cursor, micro = _split_batch(batch, grad_accum)
        pkeys, params = flatten(state["params"])
        bkeys, buffers = flatten(state["buffers"])
        buffers = [b.clone() for b in buffers]  # a forward may update buffers in place
        gen = rng.generator(_dropout_key(state, rank), params[0].device)
        scale = state["amp"]["scale"].to(params[0].device) if fp16 else None
        grads, loss, aux = grads_of(pkeys, params, bkeys, buffers, micro, gen, scale)
        if dp:
            _all_reduce_mean(grads)
        amp, found_inf = _unscale(grads, state["amp"]) if fp16 else (state["amp"], None)
        grad_norm = _global_norm(grads)
        if clip is not None:
            _clip_(grads, grad_norm, clip)
        lr = tx.lr(state["opt"]) if tx.lr is not None else torch.tensor(math.nan)
        # A state an in-flight async save still reads must not be overwritten: update it
        # out of place this once (a checkpoint never mixes two steps).
        in_place = donate and not is_pinned(state)
        if found_inf is not None and bool(found_inf):  # skipped, as GradScaler skips step()
            new_params, opt = state["params"], state["opt"]
        else:
            new_params, opt = _apply(state, tx, pkeys, params, grads, in_place)
        new_state = _new_state(
            step=state["step"] + 1,
            params=new_params,
            buffers=unflatten(bkeys, buffers),
            opt=opt,
            amp=amp,
            data=cursor if cursor is not None else state["data"],
            rng=state["rng"],
        )
        if in_place:
            mark_donated(state)
        return new_state, _metrics(loss, grad_norm, lr, micro, aux)

    return step


def _new_state(**parts) -> TensorDict:
    """The locked state of the next step, with TensorDict nodes of its own.

    Subtrees carried over unchanged (``amp``, ``data``, a donated ``opt``) get fresh nodes
    via a shallow ``copy()`` (leaves shared, nothing copied): locking a subtree that an
    earlier state already locked appends that state to its lock-parent list, so a shared
    node's list (and every step's ``lock_()``) grew with the number of steps run.
    """
    for name, part in parts.items():
        if isinstance(part, TensorDictBase) and part.is_locked:
            parts[name] = part.copy()
    return new_td(parts).lock_()


@contextlib.contextmanager
def _train_mode(modules: tuple[nn.Module, ...]):
    """Train mode for the block, then the modes as they were (``modules[0]`` is the root).

    ``Module.train`` walks and sets every submodule (~0.2 ms at GPT-2 tiny size, twice per
    step), so it only runs when some submodule is not already training.
    """
    if all(m.training for m in modules):
        yield
        return
    was_training = modules[0].training
    modules[0].train()
    try:
        yield
    finally:
        modules[0].train(was_training)


def _dropout_key(state: TensorDictBase, rank: int) -> torch.Tensor:
    return rng.step_key(state["rng"], int(state["step"]), rng.STREAM_DROPOUT, rank)


def make_eval_step(model: nn.Module, loss_fn: LossFn, *, precision: str = "fp32"):
    """``eval_step(state, batch) -> metrics``: the loss with the state's params in eval mode.

    Runs under ``torch.no_grad`` with ``model.eval()`` (no dropout); it reads neither the data
    cursor nor the RNG chain, so evaluating never changes what training does next.

    Example:
        >>> import ftrain, torch
        >>> model = torch.nn.Linear(3, 1)
        >>> state = ftrain.init_state(model, ftrain.optim.sgd(0.1), seed=0)
        >>> ev = make_eval_step(model, lambda m, b: m(b["x"]).pow(2).mean())
        >>> sorted(ev(state, {"x": torch.ones(2, 3)}).keys())
        ['loss', 'samples', 'tokens']
    """
    _check_args(1, precision, None)
    bound = _Bound(model, loss_fn)
    autocast = _AUTOCAST[precision]

    def eval_step(state: TensorDictBase, batch) -> TensorDict:
        check_usable(state, "eval_step")
        _, micro = _split_batch(batch, 1)
        pkeys, params = flatten(state["params"])
        bkeys, buffers = flatten(state["buffers"])
        named = _named("model.", pkeys, params) | _named("model.", bkeys, buffers)
        was_training = model.training
        model.eval()
        try:
            with (
                torch.no_grad(),
                torch.autocast(
                    params[0].device.type,
                    dtype=autocast or torch.float32,
                    enabled=autocast is not None,
                ),
            ):
                loss, aux = _loss_and_aux(
                    functional_call(bound, named, (micro[0],), tie_weights=True, strict=False)
                )
        finally:
            model.train(was_training)
        aux_total: dict[str, torch.Tensor] = {}
        _merge_aux(aux_total, aux, 1)
        return _metrics(loss.float(), None, None, micro, aux_total)

    return eval_step


def evaluate(eval_step, state: TensorDictBase, batches) -> dict[str, float]:
    """Average ``eval_step`` metrics over ``batches`` (weighted by samples); returns floats.

    The training cursor and RNG are untouched: pass a fixed validation iterable.
    """
    total: dict[str, float] = {}
    n = 0
    for batch in batches:
        m = eval_step(state, batch)
        k = int(m["samples"])
        n += k
        for name, v in m.items():
            total[name] = total.get(name, 0.0) + float(v) * (
                1 if name in ("samples", "tokens") else k
            )
    if n == 0:
        raise ValueError("evaluate got no batches; pass a non-empty validation iterable")
    return {k: (v if k in ("samples", "tokens") else v / n) for k, v in total.items()}
