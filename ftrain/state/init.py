"""The training state: one immutable TensorDict holding everything a resume needs.

Top-level keys (fixed; the state is locked against adding or removing keys):

- ``step``: int64 scalar, completed optimizer steps ("step 400" = 400 steps done).
- ``params``: the model parameters, nested like the module (``h.0.attn.c_attn.weight``).
- ``buffers``: the module's persistent buffers (empty for most transformers).
- ``opt``: the optimizer state from ``tx.init(params)``; the LR schedule reads its count,
  and fp16's loss scale (``scale``, ``growth_tracker``, ``skipped``) is part of it, under
  ``opt["loss_scale"]`` (see ``ftrain.optim.dynamic_loss_scale``).
- ``data``: the data cursor (``epoch``, ``position``) of the *next* batch.
- ``rng``: the base key of the run's key chain.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from ftrain import rng
from ftrain.optim.processing import outermost_loss_scale
from ftrain.state.tree import flatten, unflatten

__all__ = [
    "STATE_KEYS",
    "check_usable",
    "init_state",
    "is_donated",
    "is_pinned",
    "mark_donated",
    "pin",
    "place",
    "unpin",
]

STATE_KEYS = ("step", "params", "buffers", "opt", "data", "rng")


def _detached_tree(named: list[tuple[str, torch.Tensor]]) -> TensorDict:
    # Clone so the state owns its memory: training the state never touches the module.
    keys = [tuple(name.split(".")) for name, _ in named]
    return unflatten(keys, [t.detach().clone() for _, t in named])


def _default_cursor() -> TensorDict:
    zero = torch.zeros((), dtype=torch.int64)
    return TensorDict(epoch=zero, position=zero.clone(), batch_size=[])


def init_state(
    model: nn.Module,
    tx,
    *,
    seed: int,
    data: TensorDictBase | None = None,
    precision: str = "fp32",
) -> TensorDict:
    """Build the initial training state for ``model`` and optimizer ``tx``.

    Args:
        model: the module whose parameters (and persistent buffers) seed the state. It is
            not modified; the state holds copies.
        tx: an ``ftrain.optim.GradientTransformation``; ``tx.init(params)`` makes ``opt``.
        seed: the run's seed; the base key of the RNG chain is ``ftrain.rng.key(seed)``.
        data: the initial data cursor (default: epoch 0, position 0).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``; fp16 needs ``tx`` wrapped in
            ``ftrain.optim.dynamic_loss_scale`` (its state starts the scale at 2**16).

    Returns:
        A locked TensorDict with keys ``step, params, buffers, opt, data, rng``.

    Raises:
        ValueError: an unknown precision, or fp16 without a loss scale in ``tx``.

    Example:
        >>> import ftrain
        >>> state = ftrain.init_state(torch.nn.Linear(2, 1), ftrain.optim.sgd(0.1), seed=0)
        >>> sorted(state.keys())
        ['buffers', 'data', 'opt', 'params', 'rng', 'step']
    """
    check_model_and_tx(model, tx, "init_state")
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
    params = _detached_tree(list(model.named_parameters()))
    persistent = [(n, b) for n, b in model.named_buffers() if _is_persistent(model, n)]
    opt = tx.init(params)
    if outermost_loss_scale(*flatten(opt)) is None and precision == "fp16":
        raise ValueError(
            "precision='fp16' needs dynamic loss scaling in the optimizer: "
            "tx = ftrain.optim.dynamic_loss_scale(tx)"
        )
    state = TensorDict(
        step=torch.zeros((), dtype=torch.int64),
        params=params,
        buffers=_detached_tree(persistent),
        opt=opt,
        data=data if data is not None else _default_cursor(),
        rng=rng.key(seed),
        batch_size=[],
    )
    return state.lock_()


def check_model_and_tx(model, tx, where: str) -> None:
    """``model`` an ``nn.Module`` and ``tx`` an optax-shaped transformation (``init`` and
    ``update``), or a ``TypeError`` naming what was given (arguments swapped, a
    ``torch.optim`` optimizer) instead of an AttributeError from deep inside."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{where}(model, tx, ...) needs a torch.nn.Module as model, got "
            f"{type(model).__module__}.{type(model).__qualname__} (arguments swapped?)"
        )
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"{where}(model, tx, ...) needs an ftrain.optim transformation as tx (init and "
            f"update), e.g. ftrain.optim.adamw(1e-3); got {type(tx).__module__}."
            f"{type(tx).__qualname__} (a torch.optim optimizer is not one: ftrain.optim has "
            "adamw, sgd, ...)"
        )


def _is_persistent(model: nn.Module, name: str) -> bool:
    owner_path, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    return leaf not in owner._non_persistent_buffers_set


# Donation is a fact about one state *object* (not its values: a clone is a new, usable
# state), so it lives on the object itself, in its __dict__ beside TensorDict's own fields.
# TensorDict.__setattr__ would store a tensor entry, hence __dict__. A pin is about memory:
# an async save of `state.exclude("data")` or `replace(state, ...)` reads the very buffers a
# donating step of `state` would overwrite, so the step also asks whether the leaves it is
# about to write share a storage with any pinned state (`shares_pinned`; only those: leaves
# it never writes, such as frozen params, are shared by every later state). The pinned
# states are held weakly: one collected without its unpin (a watchdog's pin before
# os._exit) takes its addresses along, and while it lives its storages do, so no address
# is reused under it.
_DONATED_ATTR, _PINS_ATTR, _STORAGES_ATTR = "_ftrain_donated", "_ftrain_pins", "_ftrain_storages"
_PIN_LOCK = threading.Lock()  # pin/unpin run on the async writer's thread too
_PINNED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> pinned state


def mark_donated(state: TensorDictBase) -> Callable[[], None]:
    """Record that ``state``'s buffers are about to be reused in place; using it again is
    an error. Returns the undo, for a step that failed before writing anything after all
    (a compile that failed inside the call that was to write)."""
    state.__dict__[_DONATED_ATTR] = True
    return lambda: state.__dict__.pop(_DONATED_ATTR, None)


def is_donated(state: TensorDictBase) -> bool:
    """Whether a ``donate=True`` step has begun writing ``state``'s buffers in place (its
    tensors may hold a later step, or part of one). ftrain's step marks a state just
    before its first in-place write, so a step that failed before it (an out-of-memory
    error in the backward, a bad batch) leaves a state that is still whole."""
    return state.__dict__.get(_DONATED_ATTR, False)


def pin(state: TensorDictBase) -> None:
    """Mark ``state`` as read by someone else (e.g. an async save) until :func:`unpin`.

    A ``donate=True`` step will not update a pinned state in place; pins nest.

    Example:
        >>> import ftrain
        >>> s = ftrain.init_state(torch.nn.Linear(2, 1), ftrain.optim.sgd(0.1), seed=0)
        >>> pin(s); is_pinned(s)
        True
        >>> unpin(s); is_pinned(s)
        False
    """
    storages = _storages(state)
    with _PIN_LOCK:
        state.__dict__[_PINS_ATTR] = state.__dict__.get(_PINS_ATTR, 0) + 1
        state.__dict__[_STORAGES_ATTR] = storages
        _PINNED[id(state)] = state


def unpin(state: TensorDictBase) -> None:
    """Release one :func:`pin` of ``state`` (no-op if it holds none)."""
    with _PIN_LOCK:
        count = state.__dict__.get(_PINS_ATTR, 0)
        if count == 0:
            return
        state.__dict__[_PINS_ATTR] = count - 1
        if count == 1 and _PINNED.get(id(state)) is state:
            del _PINNED[id(state)]


def is_pinned(state: TensorDictBase) -> bool:
    """True while some :func:`pin` of ``state`` itself is unreleased (for a view of a
    pinned state that shares its buffers, see :func:`shares_pinned`)."""
    return state.__dict__.get(_PINS_ATTR, 0) > 0


def any_pinned() -> bool:
    """Whether any state is pinned now (an async save or a hang save is in flight)."""
    return bool(_PINNED)


def shares_pinned(leaves: list[torch.Tensor]) -> bool:
    """Whether any of ``leaves`` shares a storage with a pinned state: e.g. the params of a
    state whose ``exclude("data")`` or ``replace(...)`` an async save still reads."""
    if not _PINNED:  # the common case: no save in flight, nothing to look up
        return False
    with _PIN_LOCK:
        pinned = [s.__dict__.get(_STORAGES_ATTR, set()) for s in _PINNED.values()]
    mine = _addresses(leaves)
    return any(not mine.isdisjoint(theirs) for theirs in pinned)


def _storages(state: TensorDictBase) -> set[int]:
    return _addresses(flatten(state)[1])


def _addresses(leaves) -> set[int]:
    """The data addresses of ``leaves`` (a DTensor's: its local shard's); a view of a whole
    leaf (``exclude``, ``replace``, ``view``) has its leaf's. ``data_ptr``, not the storage:
    this runs at every step while a save is in flight."""
    out = set()
    for leaf in leaves:
        if type(leaf) is torch.Tensor and not leaf.is_meta:  # the common case, first
            out.add(leaf.data_ptr())
            continue
        local = getattr(leaf, "_local_tensor", leaf)  # a DTensor has no data of its own
        if isinstance(local, torch.Tensor) and not local.is_meta:
            try:
                out.add(local.data_ptr())
            except RuntimeError:  # a tensor without plain data: nothing to share
                continue
    out.discard(0)
    return out


def check_usable(state: TensorDictBase, what: str = "step") -> None:
    """Raise if ``state`` was donated to a ``donate=True`` step (its tensors now hold later values)."""
    if not isinstance(state, TensorDictBase):
        raise TypeError(
            f"{what} expects a TensorDict state from ftrain.init_state, got {type(state).__name__}"
        )
    if is_donated(state):
        raise RuntimeError(
            f"this state was donated to a donate=True step and its tensors were updated in place; "
            f"{what} needs the state that step returned (or make the step with donate=False)"
        )


def place(state: TensorDictBase, device: str | torch.device) -> TensorDict:
    """Move the state's floating-point leaves to ``device``; keep integer bookkeeping on the host.

    ``step``, the key chain, the data cursor and optimizer counts are small integers the step
    reads on the host (to derive keys and learning rates); keeping them on the CPU means a
    CUDA step never waits on a device-to-host copy for them.

    Example:
        >>> import ftrain
        >>> s = ftrain.init_state(torch.nn.Linear(2, 1), ftrain.optim.sgd(0.1), seed=0)
        >>> place(s, "cpu")["step"].device.type
        'cpu'
    """
    device = torch.device(device)
    # apply (not flatten/unflatten) keeps empty sub-trees such as buffers={} in place
    moved = state.apply(lambda t: t.to(device) if t.is_floating_point() else t)
    return moved.lock_()
