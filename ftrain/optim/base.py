"""Core types of ``ftrain.optim``: ``GradientTransformation``, ``chain`` and the flat-leaf helpers.

An optimizer is a pair of pure functions over nested ``TensorDict`` pytrees (optax style):

* ``init(params) -> state``
* ``update(updates, state, params=None, *, donate=False) -> (new_updates, new_state)``

plus an optional ``lr(state) -> 0-d tensor`` that reports the learning rate the *next* update
will apply, computed from the state's count alone.

Hot path. Built-in transforms are written against *flat, sorted lists of leaves*: the tree is
flattened once per ``update`` call (keys in lexicographic path order), every member of a
``chain`` works on those lists with ``torch._foreach_*`` kernels, and the result is rebuilt into
a TensorDict once at the end. A built-in transform's ``update`` is a :class:`FlatUpdate`: it is
callable on TensorDicts like any update function and also exposes ``.flat`` so that ``chain``
can skip the per-member flatten/rebuild. User-defined transforms with a plain ``update``
function work too (``chain`` then falls back to calling them on TensorDicts).

Purity. With ``donate=False`` (the default) nothing reachable from the inputs is written to;
outputs may share storage with inputs or with each other (e.g. ``trace`` returns its new
momentum buffer as the update), which is invisible as long as nobody mutates them.
With ``donate=True`` the state buffers and the update leaves are overwritten in place and the
same objects are returned (memory parity with ``torch.optim``); the donated state, the
donated updates, and anything sharing storage with them must not be used afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch
from tensordict import TensorDict, TensorDictBase

# One pytree implementation for the whole library (sorted, insertion-order independent).
from ftrain.state.tree import Key as Path
from ftrain.state.tree import flatten, new_td, path_str, unflatten

__all__ = [
    "FlatUpdate",
    "GradientTransformation",
    "Path",
    "chain",
    "flatten",
    "make_transform",
    "path_str",
    "unflatten",
]

"""A leaf's position in a nested TensorDict, e.g. ``("h", "0", "attn", "c_attn", "weight")``."""

LrFn = Callable[[TensorDictBase], torch.Tensor]


class GradientTransformation(NamedTuple):
    """An optimizer or a piece of one: a pair of pure functions over TensorDicts.

    Attributes:
        init: ``init(params) -> state``; the state is a nested TensorDict with tensor leaves
            only (empty for stateless transforms).
        update: ``update(updates, state, params=None, *, donate=False) -> (updates, state)``.
            Never mutates its inputs unless ``donate=True``.
        lr: ``lr(state) -> 0-d float tensor``: the learning rate the next ``update`` applies,
            computed from the state's count alone; ``None`` if the transform has no rate.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> tx = adamw(1e-3)
        >>> params = TensorDict({"w": torch.ones(2)}, batch_size=[])
        >>> state = tx.init(params)
        >>> updates, state = tx.update(params.clone(), state, params)
        >>> new_params = params + updates
    """

    init: Callable[[TensorDictBase], TensorDictBase]
    update: Callable[..., tuple[TensorDictBase, TensorDictBase]]
    lr: LrFn | None = None


class FlatFn(Protocol):
    def __call__(
        self,
        keys: list[Path],
        updates: list[torch.Tensor],
        state: TensorDictBase,
        params: list[torch.Tensor] | None,
        donate: bool,
    ) -> tuple[list[torch.Tensor], TensorDictBase]: ...


# ----------------------------------------------------------------------------- tree helpers


def check_keys(expected: list[Path], got: list[Path], what: str) -> None:
    """Raise ``ValueError`` naming the first path where two flattened trees differ."""
    if got == expected:
        return
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            raise ValueError(
                f"{what} does not match the updates tree: at leaf {i} expected "
                f"{path_str(a)!r}, got {path_str(b)!r}; build the state with init(params) "
                "from the same parameter tree"
            )
    raise ValueError(
        f"{what} does not match the updates tree: {len(expected)} leaves expected, got "
        f"{len(got)}; build the state with init(params) from the same parameter tree"
    )


def empty_state() -> TensorDict:
    """A fresh, empty state TensorDict (the state of a stateless transform)."""
    return TensorDict(batch_size=[])


# ----------------------------------------------------------------------------- transforms


class FlatUpdate:
    """An ``update`` function implemented on flat leaf lists, callable on TensorDicts.

    ``FlatUpdate(name, flat)`` behaves like ``update(updates, state, params=None, *,
    donate=False)``; ``flat(keys, updates, state, params, donate)`` receives sorted leaf lists
    (``params`` may be ``None``) and the transform's own state TensorDict. In donate mode a
    flat function must overwrite the ``updates`` list's tensors in place and return the very
    same list object; that is how callers know no rebuild is needed.
    """

    __slots__ = ("flat", "name")

    def __init__(self, name: str, flat: FlatFn) -> None:
        self.name = name
        self.flat = flat

    def __call__(
        self,
        updates: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase | None = None,
        *,
        donate: bool = False,
    ) -> tuple[TensorDictBase, TensorDictBase]:
        keys, leaves = flatten(updates)
        plist = None
        if params is not None:
            pkeys, plist = flatten(params)
            check_keys(keys, pkeys, "params")
        with torch.no_grad():
            out, new_state = self.flat(keys, leaves, state, plist, donate)
        if out is leaves:
            return updates, new_state
        return unflatten(keys, out, device=updates.device), new_state

    def __repr__(self) -> str:
        return f"FlatUpdate({self.name!r})"


def make_transform(
    name: str,
    init: Callable[[TensorDictBase], TensorDictBase],
    flat: FlatFn,
    lr: LrFn | None = None,
) -> GradientTransformation:
    """Build a :class:`GradientTransformation` from an ``init`` and a flat update function.

    Args:
        name: the transform's name; ``chain`` keys this transform's state by it.
        init: ``init(params) -> state TensorDict``.
        flat: ``flat(keys, updates, state, params, donate) -> (updates, state)`` over sorted
            leaf lists (see :class:`FlatUpdate`).
        lr: optional ``lr(state) -> 0-d tensor``.

    Returns:
        The transform; its ``update`` is a :class:`FlatUpdate`.

    Example:
        >>> def flat(keys, u, state, params, donate):
        ...     if donate:
        ...         torch._foreach_neg_(u)
        ...         return u, state  # donate: the same list, updated in place
        ...     return torch._foreach_neg(u), TensorDict()
        >>> negate = make_transform("negate", lambda params: TensorDict(), flat)
    """
    return GradientTransformation(init, FlatUpdate(name, flat), lr)


def _transform_name(tx: GradientTransformation) -> str:
    name = getattr(tx.update, "name", None)
    if not name:
        qual = getattr(tx.update, "__qualname__", "") or getattr(tx.init, "__qualname__", "")
        name = qual.split(".<locals>", 1)[0].rsplit(".", 1)[-1]
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in str(name)).strip("_")
    return name or "transform"


def _unique_names(transforms: Sequence[GradientTransformation]) -> list[str]:
    seen: dict[str, int] = {}
    names = []
    for tx in transforms:
        base = _transform_name(tx)
        n = seen.get(base, 0)
        seen[base] = n + 1
        names.append(base if n == 0 else f"{base}_{n}")
    return names


def _member_state(state: TensorDictBase, name: str) -> TensorDictBase:
    try:
        return state[name]
    except KeyError:
        raise ValueError(
            f"chain state has no entry {name!r} (it has {sorted(state.keys())}); "
            "create the state with this optimizer's init(params)"
        ) from None


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transforms left to right: each member's output updates feed the next.

    The state is a TensorDict keyed by member name (``scale_by_adam``, ``trace``, ...); a
    repeated name gets a suffix (``scale``, ``scale_1``). The chain's ``lr`` is the ``lr`` of
    the first member that has one.

    Args:
        *transforms: the members, applied in order.

    Returns:
        A :class:`GradientTransformation`.

    Raises:
        TypeError: if a member is not a GradientTransformation.

    Example:
        >>> tx = chain(clip_by_global_norm(1.0), scale_by_adam(), scale_by_learning_rate(1e-3))
        >>> list(tx.init(TensorDict({"w": torch.ones(2)})).keys())
        ['clip_by_global_norm', 'scale_by_adam', 'scale_by_learning_rate']
    """
    for i, tx in enumerate(transforms):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"chain member {i} must be a GradientTransformation, got {type(tx).__name__}"
            )
    members = tuple(transforms)
    names = _unique_names(members)

    def init(params: TensorDictBase) -> TensorDict:
        return new_td({n: tx.init(params) for n, tx in zip(names, members, strict=True)})

    lr = None
    for n, tx in zip(names, members, strict=True):
        if tx.lr is not None:
            lr = _forward_lr(tx.lr, n)
            break

    if all(isinstance(tx.update, FlatUpdate) for tx in members):
        flats = [(n, tx.update.flat) for n, tx in zip(names, members, strict=True)]

        def flat(keys, updates, state, params, donate):
            new_states = {}
            unchanged = True
            for n, fn in flats:
                sub = _member_state(state, n)
                updates, new_sub = fn(keys, updates, sub, params, donate)
                new_states[n] = new_sub
                unchanged = unchanged and new_sub is sub
            if donate and unchanged:
                return updates, state
            return updates, new_td(new_states)

        return GradientTransformation(init, FlatUpdate("chain", flat), lr)

    def update(updates, state, params=None, *, donate=False):
        new_states = {}
        for n, tx in zip(names, members, strict=True):
            updates, new_states[n] = tx.update(
                updates, _member_state(state, n), params, donate=donate
            )
        return updates, new_td(new_states)

    update.name = "chain"  # type: ignore[attr-defined]
    return GradientTransformation(init, update, lr)


def _forward_lr(fn: LrFn, name: str) -> LrFn:
    def lr(state: TensorDictBase) -> torch.Tensor:
        return fn(_member_state(state, name))

    return lr
