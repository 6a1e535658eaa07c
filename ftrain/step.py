"""The pure training step: ``step(state, batch) -> (new_state, metrics)``.

The module object is only a *function* here: :func:`make_step` binds it to the state's
parameters for each call with ``torch.func.functional_call`` and never changes its
parameters. Gradients are taken with respect to detached views of the state's leaves,
updates are applied out of place, and a new locked state is returned, so the input
state stays bit-for-bit what it was (unless ``donate=True``, see :func:`make_step`).

Randomness (dropout) comes from a local generator seeded by
``rng.step_key(state["rng"], state["step"], STREAM_DROPOUT, rank)``: recomputing a step
from the same state gives the same result, and a resumed run draws the same keys.

The step does three things: gradients (forward + backward over the micro-batches),
``tx.update``, apply. Everything that processes gradients is a transform of ``tx``
(:mod:`ftrain.optim.processing`): clipping, fp16 loss scaling, and — as the step's one
collective hook, before the grad-norm metric — the data-parallel mean.

Mixed precision follows ``torch.amp``: ``bf16`` and ``fp16`` run the forward pass under
autocast. If the optimizer state holds a loss scale (``tx`` is wrapped in
:func:`ftrain.optim.dynamic_loss_scale`, required for ``fp16``), the loss is multiplied by
it; the wrapper unscales and skips non-finite updates as ``torch.amp.GradScaler`` does, its
counters under ``state["opt"]["loss_scale"]``. ``step`` and the data cursor advance either
way — the batch was consumed.

Donation (``donate=True``) happens at one boundary, :mod:`ftrain.apply`: the transforms
are pure, and the step runs ``tx`` one bucket of leaves at a time, writing each bucket's
new optimizer entries and parameters into the donated buffers before the next bucket
(the pure step writes them into new tensors; either way each bucket's gradients are freed
once used).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.func import functional_call

from ftrain import rng
from ftrain.apply import update_and_apply
from ftrain.grads import Bound, Grads, LossFn, kept_modes, loss_and_aux, merge_aux, named_leaves
from ftrain.optim.base import Trainable, flat_update, per_structure, pick
from ftrain.optim.bucketed import prepare_of
from ftrain.optim.partition import learning_rates, learning_rates_in
from ftrain.optim.processing import (
    clip_by_global_norm_torch,
    global_norm_of,
    mean_across_ranks,
    outermost_loss_scale,
    remembered_norms,
)
from ftrain.state.init import (
    any_pinned,
    check_model_and_tx,
    check_usable,
    is_pinned,
    mark_donated,
    shares_pinned,
)
from ftrain.state.tree import Key, Structure, flatten, new_td, structure, unflatten

__all__ = ["Step", "evaluate", "make_eval_step", "make_step"]

Step = Callable[[TensorDictBase, TensorDictBase], tuple[TensorDict, TensorDict]]

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def carry_frozen(params: list[torch.Tensor], keep: list[int] | None, new: list[torch.Tensor]):
    """The next state's params: the updated trainable ones at ``keep``, the frozen ones as
    the same tensor objects (never copied: incremental checkpoints recognise them)."""
    if keep is None:
        return new
    out = list(params)
    for i, t in zip(keep, new, strict=True):
        out[i] = t
    return out


def _collective(dp: bool):
    """The step's collective hook: the cross-rank gradient mean (a stateless transform)."""
    return flat_update(mean_across_ranks()) if dp else None


def _deprecated_clip(clip: float | None):
    """``make_step(clip=...)``: torch's rule, as it always was, now a stateless transform."""
    if clip is None:
        return None
    warnings.warn(
        "make_step(clip=...) is deprecated: clip in the optimizer, "
        f"tx = ftrain.optim.chain(ftrain.optim.clip_by_global_norm({clip}), tx)",
        DeprecationWarning,
        stacklevel=3,
    )
    return flat_update(clip_by_global_norm_torch(clip))


def _loss_scale(opt_flat: tuple[Structure, list], precision: str, clip: float | None):
    scale = outermost_loss_scale(opt_flat[0].keys, opt_flat[1])
    if precision == "fp16" and scale is None:
        raise ValueError(
            "precision='fp16' needs dynamic loss scaling in the optimizer: "
            "tx = ftrain.optim.dynamic_loss_scale(tx), for init_state and make_step alike"
        )
    if scale is not None and clip is not None:
        raise ValueError(
            "make_step(clip=...) would clip scaled gradients; clip inside the loss scale: "
            "tx = dynamic_loss_scale(chain(clip_by_global_norm(c), optimizer))"
        )
    return scale


def _warn_requires_grad(model: nn.Module) -> None:
    """PyTorch freezes with ``requires_grad=False``; ftrain freezes through the optimizer
    (the step differentiates the state's params, not the module's flags): say so rather
    than train parameters their owner believes frozen."""
    off = [n for n, p in model.named_parameters() if not p.requires_grad]
    if off:
        shown = ", ".join(off[:4]) + (f", ... ({len(off)} in all)" if len(off) > 4 else "")
        warnings.warn(
            f"make_step: {shown} have requires_grad=False, which ftrain does not read: they "
            "train unless the optimizer freezes them (multi_transform with a frozen() label, "
            "docs/optim.md 'Parameter groups and frozen leaves')",
            UserWarning,
            stacklevel=3,
        )


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


def _sharder(shard: str, **settings):
    """The :class:`ftrain.sharding.Sharder` for ``shard="optimizer"`` (None for ``"none"``)."""
    if shard == "none":
        return None
    if shard not in ("optimizer", "full"):
        raise ValueError(f"shard must be 'none', 'optimizer' or 'full', got shard={shard!r}")
    refused = [k for k, v in settings.items() if v and (k != "precision" or v == "fp16")]
    if refused:
        raise ValueError(
            f"shard={shard!r} does not combine with {refused} yet; drop them "
            "(fp16's skip decision and donation are per-rank, compile needs one graph)"
        )
    from ftrain.sharding import Sharder

    return Sharder(full=shard == "full")


def _check_sharded(opt: TensorDictBase) -> None:
    leaves = [t for t in flatten(opt)[1] if t.ndim > 0]
    if leaves and not hasattr(leaves[0], "to_local"):
        raise ValueError(
            "make_step(shard='optimizer') needs a sharded optimizer state: "
            "state = ftrain.sharding.shard_state(state, step.sharder) before the first step"
        )


def check_params_match(model: nn.Module, pkeys: list[Key]) -> bool:
    """The state's parameter paths are the model's (once per layout): a state of a smaller
    model trained the rest from the module itself, never updated nor saved, silently; a
    larger or renamed one failed deep inside torch.func.

    Raises:
        ValueError: naming the paths that differ and the fix.
    """
    ours = {".".join(k) for k in pkeys}
    theirs = {name for name, _ in model.named_parameters()}
    if ours == theirs:
        return True
    missing, extra = sorted(theirs - ours), sorted(ours - theirs)
    first = {}  # a tied parameter's other names -> the name init_state keeps
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    aliases = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    tied = [f"{n!r} is a tied alias of {aliases[n]!r}" for n in extra if aliases.get(n, n) != n]
    raise ValueError(
        "the state's params do not match the model's parameters: "
        + "; ".join(
            [f"missing from the state {missing[:4]}"] * bool(missing)
            + ([", ".join(tied[:4]) + " (leave it out: init_state does)"] if tied else [])
            + [f"not in the model {[n for n in extra if n not in aliases][:4]}"]
            * any(n not in aliases for n in extra)
        )
        + "; make the state with ftrain.init_state(model, tx) of this model (or restore a "
        "checkpoint of it with target=)"
    )


def _check_layout(model: nn.Module, pkeys: list[Key], state: TensorDictBase) -> None:
    """Once per layout: the params fit the model, and ``step`` is a 0-d integer counter (a
    float step advanced to 1.0, 2.0, ... and only the first save refused it)."""
    check_params_match(model, pkeys)
    _check_param_shapes(model, pkeys, state["params"])
    s = state.get("step", None)
    if (
        not isinstance(s, torch.Tensor)
        or s.dim()
        or s.is_floating_point()
        or s.is_complex()
        or s.dtype == torch.bool
    ):
        got = f"{s.dtype}{tuple(s.shape)}" if isinstance(s, torch.Tensor) else repr(s)
        raise ValueError(
            f"state['step'] must be a 0-d integer tensor (the step counter), got {got}; make "
            "the state with ftrain.init_state(model, tx)"
        )


# a resume from such a state starts the user's data over, and nothing said so
_NO_CURSOR = (
    "the batches carry no 'cursor' (the data position after them), so the state's data "
    "position stays where it was and a resume cannot find its place in your data: it "
    "starts it over. Yield TensorDict(..., cursor=...) as ftrain.data.sample gives it, or "
    "pass an ftrain.data.Loader (docs/custom-step.md)"
)


def _check_param_shapes(model: nn.Module, pkeys: list[Key], params: TensorDictBase) -> None:
    """The state's params have the model's shapes (once per layout): a checkpoint of a
    64-wide MLP restored without ``target=`` into a 32-wide one trained the 64-wide weights
    silently; a GPT of another width failed deep inside torch ("Expected weight to be of
    same shape as normalized_shape").

    Raises:
        ValueError: naming the params whose shapes differ and the fix.
    """
    want = {name: tuple(p.shape) for name, p in model.named_parameters()}
    wrong = [
        f"{'.'.join(k)}: state {tuple(params[k].shape)}, model {want['.'.join(k)]}"
        for k in pkeys
        if tuple(params[k].shape) != want.get(".".join(k), tuple(params[k].shape))
    ]
    if wrong:
        more = f" and {len(wrong) - 4} more" if len(wrong) > 4 else ""
        raise ValueError(
            f"the state's params do not have the model's shapes: {'; '.join(wrong[:4])}{more}; "
            "build the model the state was saved from, or restore with target= (a state of "
            "this model) to have every difference named"
        )


def check_opt_matches(
    tx, params: TensorDictBase, opt: Structure, leaves: list[torch.Tensor] | None = None
) -> bool:
    """The state's optimizer entries are those ``tx`` makes (once per layout): an AdamW
    state given to an SGD step failed inside the bucketed update, saying a transform "left
    out state entries" — a bug of the transform's, it read, not a state of another optimizer.
    With ``leaves`` (the state's, in ``opt.keys`` order; not for a sharded state, whose
    entries hold rows), their shapes and dtypes too: a moment of shape (1, 3) for a (4, 3)
    weight was broadcast into it without a word.

    Raises:
        ValueError: naming the entries that differ and the fix.
    """
    try:  # on the meta device: the layout without allocating a single moment
        made, made_leaves = structure(tx.init(params.to("meta")))
    except Exception:  # a transform that cannot start on meta: the update checks as before
        return True
    theirs, ours = set(made.keys), set(opt.keys)
    if theirs == ours:
        if leaves is not None:
            _check_opt_leaves(dict(zip(made.keys, made_leaves, strict=True)), opt.keys, leaves)
        return True
    missing, extra = sorted(theirs - ours), sorted(ours - theirs)
    raise ValueError(
        "the state's optimizer state is not this step's optimizer's: "
        + "; ".join(
            [f"missing {_dotted(missing)}"] * bool(missing)
            + [f"not this optimizer's {_dotted(extra)}"] * bool(extra)
        )
        + "; make the state with ftrain.init_state(model, tx) for the tx given to make_step "
        "(or restore a checkpoint of it with target=)"
    )


def _check_opt_leaves(made: dict, keys: tuple[Key, ...], leaves: list[torch.Tensor]) -> None:
    wrong = [
        f"{'.'.join(k)} is {t.dtype}{tuple(t.shape)}, not {made[k].dtype}{tuple(made[k].shape)}"
        for k, t in zip(keys, leaves, strict=True)
        if t.shape != made[k].shape or t.dtype != made[k].dtype
    ]
    if wrong:
        raise ValueError(
            "the state's optimizer state does not fit its params: "
            + "; ".join(wrong[:4])
            + (f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else "")
            + "; make it with ftrain.init_state(model, tx) or tx.init(params) of these params "
            "(or restore a checkpoint of it with target=)"
        )


def _dotted(keys: list[Key]) -> list[str]:
    return [".".join(k) for k in keys[:4]]


def _read_elsewhere(state: TensorDictBase, trainable: Trainable) -> bool:
    """:func:`_written_elsewhere` of a state not flattened yet (the walk only while
    something is pinned)."""
    if is_pinned(state) or not any_pinned():
        return is_pinned(state)
    pkeys, params = flatten(state["params"])
    return _written_elsewhere(
        state, params, trainable.indices(pkeys, params), flatten(state["opt"])[1]
    )


def _written_elsewhere(state: TensorDictBase, params: list, keep, opt_leaves: list) -> bool:
    """A save still reads ``state`` or, through a view of it (``exclude``, ``replace``),
    a buffer a donating step would write: its trained params (``keep``: their indices,
    ``None``: all) or its optimizer state."""
    if is_pinned(state):
        return True
    if not any_pinned():  # nothing pinned anywhere (the common case): no lookups
        return False
    written = params if keep is None else [params[i] for i in keep]
    return shares_pinned([*written, *opt_leaves])


def _trainable(trainable: Trainable, pkeys: list[Key], params: list[torch.Tensor]):
    keep = trainable.indices(pkeys, params)
    if keep == []:
        raise ValueError(
            "every parameter is frozen by the optimizer (multi_transform/frozen labels): "
            "there is nothing to train; leave at least one parameter unfrozen"
        )
    return keep


def learning_rate_metrics(opt: TensorDictBase) -> dict[str, torch.Tensor]:
    """``{"lr": ...}`` of this update; with several parameter groups (``multi_transform``)
    also ``lr_<label>`` per group, and ``lr`` is the group ``default``'s (else the first
    label's in sorted order)."""
    return _rate_metrics(learning_rates(opt))


def _rate_metrics(rates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if len(rates) <= 1:
        return {"lr": next(iter(rates.values()), _NAN)}
    by_label = dict(zip(_group_labels(list(rates)), rates.values(), strict=True))
    main = by_label.get("default", next(iter(by_label.values())))
    return {"lr": main} | {f"lr_{label}": v for label, v in by_label.items()}


def _group_labels(paths: list[str]) -> list[str]:
    """Name each ``learning_rate`` path by the first path component where they differ:
    the ``multi_transform`` label, wherever the multi_transform is nested."""
    parts = [p.split(".") for p in paths]
    depth = min(len(p) for p in parts)
    at = next((i for i in range(depth) if len({p[i] for p in parts}) > 1), depth - 1)
    return [p[at] for p in parts]


def _metrics(loss, grad_norm, lrs, micro, aux) -> TensorDict:
    samples = aux.get("samples")  # the loss's own count wins (a batch of its own shape)
    if samples is None:
        samples = torch.tensor(sum(_leading(mb) for mb in micro))
    out = {"loss": loss, "grad_norm": grad_norm, "samples": samples}
    out = {k: v for k, v in out.items() if v is not None} | (lrs or {})
    out.update({k: v for k, v in aux.items() if k not in out})
    return new_td(out)


def _leading(mb: TensorDictBase) -> int:
    """Samples in a batch: the leading dim its tensors share, 0-d leaves (a temperature, a
    flag) left out; where they disagree, the most common (then the largest). The first
    leaf in key order was taken: a 0-d ``alpha`` made every batch one sample, and
    ``evaluate`` weighted its batches by that."""
    dims = [int(t.shape[0]) for t in flatten(mb)[1] if t.dim()]
    if not dims:
        return 1
    return max(set(dims), key=lambda d: (dims.count(d), d))


def make_step(
    model: nn.Module,
    loss_fn: LossFn,
    tx,
    *,
    grad_accum: int = 1,
    precision: str = "fp32",
    donate: bool = False,
    dp: bool | None = None,
    compile: bool = False,
    clip: float | None = None,
    shard: str = "none",
) -> Step:
    """Build the pure training step for ``model`` trained with ``loss_fn`` and optimizer ``tx``.

    Args:
        model: the module used as a function; its own parameters are never changed.
        loss_fn: ``loss_fn(model, batch) -> loss`` or ``(loss, aux_metrics)``, ordinary PyTorch;
            during the call ``model`` is bound to the state's params.
        tx: an ``ftrain.optim.GradientTransformation``: the optimizer with all gradient
            processing (``chain(clip_by_global_norm(1.0), adamw(...))``; for ``fp16``
            wrapped in ``dynamic_loss_scale``).
        grad_accum: micro-batches per step; the batch's leading dim is cut into this many,
            gradients are averaged, and one optimizer update is made (a step is a whole update).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (autocast; fp16 needs a loss scale).
        donate: reuse the input state's buffers (JAX's ``donate_argnums``): ``tx`` runs one
            bucket of leaves at a time and writes each bucket's new optimizer entries and
            params into them (:mod:`ftrain.apply`; bit for bit the pure step's results;
            a ``tx`` that is not bucketable only adds its updates in place); the input
            state is then unusable and passing it again raises. A state pinned by an
            in-flight async checkpoint save (:func:`ftrain.state.pin`) is updated out of
            place instead, so the save never sees a later step's values.
        dp: average gradients over ``torch.distributed`` ranks (the step's collective hook,
            :func:`ftrain.optim.mean_across_ranks`; default: when initialised with > 1 rank).
        compile: run the step's tensor core (forward, backward, ``tx``, apply) as one
            ``torch.compile`` graph per batch shape (:mod:`ftrain.compiled`); the first call
            of each shape compiles (logged once, and ``step.core.compile_seconds``); results
            match the eager step to ~1e-6 (fp32; ~1e-4 with fp16/bf16, whose fused intermediates
            Inductor keeps in fp32). Not with ``dp`` or ``clip=``.
        clip: deprecated; put ``clip_by_global_norm`` in ``tx`` instead.
        shard: ``"none"``, ``"optimizer"`` (each rank keeps only its dim-0 shard of the
            optimizer state: ZeRO-1) or ``"full"`` (of the params too: ZeRO-3, whole params
            gathered for the step's forward and backward); :mod:`ftrain.sharding`. Shard
            the state with ``ftrain.sharding.shard_state(state, step.sharder)`` first.
            Needs ``torch.distributed``; not with ``compile``, ``donate``, ``fp16``, ``clip=``.

    Returns:
        ``step(state, batch) -> (new_state, metrics)``. ``batch`` is a TensorDict (or mapping);
        its optional ``cursor`` entry (from ``ftrain.data``) becomes ``new_state["data"]``.
        ``metrics`` holds ``loss``, ``grad_norm`` (of the unscaled, averaged gradients, before
        ``tx``), ``lr`` (of this update), ``samples`` and ``loss_fn``'s aux metrics (e.g.
        ``tokens``, when the loss counts them), as tensors (no host sync).

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
    check_model_and_tx(model, tx, "make_step")
    if not callable(loss_fn):
        raise TypeError(f"make_step(model, loss_fn, tx): loss_fn must be callable, got {loss_fn!r}")
    _check_args(grad_accum, precision, clip)
    if next(iter(model.parameters()), None) is None:  # an IndexError at the first step
        raise ValueError(
            f"make_step: the model ({type(model).__name__}) has no parameters, so there is "
            "nothing to train; pass the module that holds them"
        )
    _warn_requires_grad(model)
    rank, dp = _default_rank_world(dp)
    sharder = _sharder(shard, compile=compile, donate=donate, precision=precision, clip=clip)
    if compile:
        from ftrain.compiled import CompiledCore

        if dp or clip is not None:
            raise ValueError(
                "make_step(compile=True) compiles one graph per step: use it without dp and "
                "with clipping in tx (clip_by_global_norm), not clip="
            )
        core = CompiledCore(model, loss_fn, flat_update(tx), _AUTOCAST[precision])
    else:
        core = _EagerCore(model, loss_fn, tx, _AUTOCAST[precision], dp, clip, sharder)
    trainable = Trainable(getattr(tx.update, "frozen_of", None))
    matched: dict = {}  # parameter layouts checked against the model's
    matched_opt: dict = {}  # optimizer-state layouts checked against the tx's
    said_no_cursor: list = []  # the batches carry no data position: said once

    def step(state: TensorDictBase, batch) -> tuple[TensorDict, TensorDict]:
        check_usable(state, "step")
        if donate and compile and _read_elsewhere(state, trainable):
            # a save still reads this state: the in-place graph gets a copy to write, not a
            # second (out-of-place) graph compiled mid-run, tens of seconds into a step
            state = state.clone()
        cursor, micro = _split_batch(batch, grad_accum)
        if cursor is None and not said_no_cursor:
            said_no_cursor.append(True)
            warnings.warn(_NO_CURSOR, UserWarning, stacklevel=2)
        pkeys, params = flatten(state["params"])
        per_structure(matched, tuple(pkeys), lambda: _check_layout(model, pkeys, state))
        bkeys, buffers = flatten(state["buffers"])
        gen = rng.generator(_dropout_key(state, rank), params[0].device)
        opt = state["opt"]
        opt_flat = structure(opt)  # the optimizer state, walked once per step for all below
        keys = opt_flat[0].keys  # a cheap key (the structure's hash is ~20 us a step)
        per_structure(
            matched_opt,
            (len(keys), keys[:1], keys[-1:]),
            lambda: check_opt_matches(
                tx, state["params"], opt_flat[0], opt_flat[1] if sharder is None else None
            ),
        )
        if sharder is not None:
            _check_sharded(opt if not sharder.full else state["params"])
        scale = _loss_scale(opt_flat, precision, clip)
        keep = _trainable(trainable, pkeys, params)
        # a state an in-flight async save still reads is never overwritten
        in_place = donate and not _written_elsewhere(state, params, keep, opt_flat[1])
        new_params, new_buffers, new_opt, loss, grad_norm, aux = core(
            (pkeys, params),
            (bkeys, buffers),
            opt,
            micro,
            gen,
            scale,
            in_place,
            keep,
            opt_flat,
            before_write=(lambda: mark_donated(state)) if in_place else None,
        )
        new_state = _new_state(
            step=state["step"] + 1,
            params=unflatten(pkeys, new_params),
            buffers=unflatten(bkeys, new_buffers),
            opt=new_opt,
            data=cursor if cursor is not None else state["data"],
            rng=state["rng"],
        )
        lrs = _rate_metrics(learning_rates_in(opt_flat[0].keys, opt_flat[1]))
        return new_state, _metrics(loss, grad_norm, lrs, micro, aux)

    step.core = core  # type: ignore[attr-defined]  # e.g. compile_seconds of a compiled step
    # a donated state is marked before its first in-place write (the loop's emergency save
    # after a failure inside the step trusts the mark)
    step.marks_donation = True  # type: ignore[attr-defined]
    step.sharder = sharder  # type: ignore[attr-defined]  # for shard_state / gather_state
    return step


class _EagerCore:
    """Gradients, the collective hook, the grad-norm metric, ``tx.update``, apply: eagerly.

    With a :class:`ftrain.sharding.Sharder` (``shard="optimizer"``) the collective hook is a
    reduce-scatter, ``tx`` runs on this rank's rows and the new rows are all-gathered.
    """

    def __init__(self, model, loss_fn, tx, autocast, dp: bool, clip: float | None, sharder=None):
        self.grads_of = Grads(model, loss_fn, autocast)
        self.update, self.prepare = flat_update(tx), prepare_of(tx)
        self.collective, self.old_clip = _collective(dp and sharder is None), _deprecated_clip(clip)
        self.sharder = sharder

    def __call__(
        self, p, b, opt, micro, gen, scale, in_place, keep, opt_flat=None, before_write=None
    ):
        (pkeys, params), (bkeys, buffers) = p, b
        buffers = [t.clone() for t in buffers]  # a forward may update buffers in place
        # shard="full": the state holds rows; the forward and backward need whole params
        held = params
        if self.sharder is not None and self.sharder.full:
            with torch.no_grad():
                params = self.sharder.all_gather(held)
        grads, loss, aux = self.grads_of(pkeys, params, keep, bkeys, buffers, micro, gen, scale)
        tkeys, tparams = (
            (pkeys, params) if keep is None else (pick(keep, pkeys), pick(keep, params))
        )
        with torch.no_grad(), remembered_norms():  # the metric's norm is the clip's
            if self.sharder is not None:
                grads = self.sharder.reduce_scatter_mean(grads)
                own = held if keep is None else pick(keep, held)
                tparams = [self.sharder.shard(t, copy=False) for t in own]
            elif self.collective is not None:
                grads, _ = self.collective(tkeys, grads, _EMPTY, None)
            grad_norm = _local(global_norm_of(grads))
            grad_norm = grad_norm if scale is None else grad_norm / scale.to(grad_norm.device)
            if self.old_clip is not None:
                grads, _ = self.old_clip(tkeys, grads, _EMPTY, None)
            if before_write is not None:  # the first write into the state's own buffers
                before_write()
            if self.sharder is None:  # bucket by bucket, grads freed as they are used
                grads = list(grads)  # the only reference to them, which it consumes
                new, new_opt = update_and_apply(
                    self.update, self.prepare, tkeys, grads, opt, tparams, in_place, opt_flat
                )
            else:
                new, new_opt = self._sharded_update(tkeys, grads, opt, tparams)
            new_params = carry_frozen(held, keep, new)
        return new_params, buffers, new_opt, loss, grad_norm, aux

    def _sharded_update(self, tkeys, grads, opt, rows):
        updates, new_opt = self.update(tkeys, grads, opt, rows)
        new = torch._foreach_add(rows, updates)
        if self.sharder.full:  # the new rows are the state: nothing to gather
            return new, new_opt
        return self.sharder.all_gather(new), new_opt


def _local(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor result (the sharded step's norm) as a plain tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


_EMPTY = TensorDict(batch_size=[])
_NAN = torch.tensor(math.nan)


def _new_state(**parts) -> TensorDict:
    """The locked state of the next step, with TensorDict nodes of its own.

    Subtrees carried over unchanged (``data``, parts of ``opt``) get fresh nodes
    via a shallow ``copy()`` (leaves shared, nothing copied): locking a subtree that an
    earlier state already locked appends that state to its lock-parent list, so a shared
    node's list (and every step's ``lock_()``) grew with the number of steps run.
    """
    for name, part in parts.items():
        if isinstance(part, TensorDictBase) and part.is_locked:
            parts[name] = part.copy()
    return new_td(parts).lock_()


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
        ['loss', 'samples']
    """
    _check_args(1, precision, None)
    bound = Bound(model, loss_fn)
    autocast = _AUTOCAST[precision]

    def eval_step(state: TensorDictBase, batch) -> TensorDict:
        check_usable(state, "eval_step")
        _, micro = _split_batch(batch, 1)
        pkeys, params = flatten(state["params"])
        bkeys, buffers = flatten(state["buffers"])
        named = named_leaves("model.", pkeys, params) | named_leaves("model.", bkeys, buffers)
        with (
            kept_modes(tuple(model.modules())),  # a frozen submodule stays as the user set it
            torch.no_grad(),
            torch.autocast(
                params[0].device.type,
                dtype=autocast or torch.float32,
                enabled=autocast is not None,
            ),
        ):
            model.eval()
            loss, aux = loss_and_aux(
                functional_call(bound, named, (micro[0],), tie_weights=True, strict=False)
            )
        aux_total: dict[str, torch.Tensor] = {}
        merge_aux(aux_total, aux, 1)
        return _metrics(loss.float(), None, {}, micro, aux_total)

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
