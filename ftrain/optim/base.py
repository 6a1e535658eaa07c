"""Core types of ``ftrain.optim``: ``GradientTransformation``, ``chain``, ``tree_get``.

An optimizer is a pair of pure functions over nested ``TensorDict`` pytrees (optax's shape):

* ``init(params) -> state``
* ``update(updates, state, params=None) -> (new_updates, new_state)``

Nothing else: hyper-parameters that change during training are *in the state*, where
:func:`tree_get` finds them (``tree_get(opt_state, "learning_rate")`` is the rate the next
update applies), as optax's ``inject_hyperparams`` does.

Purity. ``update`` never writes to anything reachable from its inputs. Outputs may share
storage with inputs or with each other (e.g. ``trace`` returns its new momentum buffer as
the update), which is invisible as long as nobody mutates them. Reusing the input buffers
(JAX's donation) is not the transforms' business: the step does it at one boundary.

Hot path. Built-in transforms are written once, on *flat, sorted lists of leaves*
(``flat(keys, updates, state, params) -> (updates, state)``): a :class:`FlatUpdate` is their
``update``, callable on TensorDicts like any update function, and ``chain`` (and the step)
call its ``.flat`` form directly so a chain flattens the tree once, not once per member.
A user transform with a plain TensorDict ``update`` works everywhere; ``chain`` adapts it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch
from tensordict import TensorDict, TensorDictBase

# One pytree implementation for the whole library (sorted, insertion-order independent).
from ftrain.optim.bucketed import (
    Body,
    Prepare,
    Source,
    applies,
    applying,
    call_body,
    handed_on,
    hands_on,
    owning,
    prepare_of,
)
from ftrain.state.tree import Key as Path
from ftrain.state.tree import entries, flatten, is_node, new_td, path_str, unflatten

__all__ = [
    "FlatUpdate",
    "FrozenFn",
    "GradientTransformation",
    "Path",
    "chain",
    "flatten",
    "make_transform",
    "path_str",
    "refresh_hyperparams",
    "tree_get",
    "unflatten",
]


class GradientTransformation(NamedTuple):
    """An optimizer or a piece of one: a pair of pure functions over TensorDicts.

    Attributes:
        init: ``init(params) -> state``; the state is a nested TensorDict with tensor leaves
            only (empty for stateless transforms).
        update: ``update(updates, state, params=None) -> (updates, state)``; never mutates
            its inputs.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from ftrain.optim import adamw
        >>> tx = adamw(1e-3)
        >>> params = TensorDict({"w": torch.ones(2)}, batch_size=[])
        >>> state = tx.init(params)
        >>> updates, state = tx.update(params.clone(), state, params)
        >>> new_params = params + updates
    """

    init: Callable[[TensorDictBase], TensorDictBase]
    update: Callable[..., tuple[TensorDictBase, TensorDictBase]]


FrozenFn = Callable[[list[Path], list[torch.Tensor]], list[int]]
# ``refresh(state) -> state``: the state with its derived hyper-parameter leaves recomputed
Refresh = Callable[[TensorDictBase], TensorDictBase]


class FlatFn(Protocol):
    def __call__(
        self,
        keys: list[Path],
        updates: list[torch.Tensor],
        state: TensorDictBase,
        params: list[torch.Tensor] | None,
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


def check_shapes(keys: list[Path], updates: list[torch.Tensor], params: list[torch.Tensor]):
    """Raise ``ValueError`` naming the first leaf whose update is not its parameter's shape
    or dtype (a 0-d or ``(1, n)`` gradient would otherwise broadcast into the moments and
    params; a float16 gradient of a float32 parameter failed deep in a kernel)."""
    for k, u, p in zip(keys, updates, params, strict=True):
        if u.shape != p.shape or u.dtype != p.dtype:
            raise ValueError(
                f"the update of {path_str(k)!r} is {_kind(u)}, its parameter {_kind(p)}; "
                "pass gradients of the same tree, shapes and dtypes as params (e.g. "
                "torch.func.grad of the loss over params)"
            )


def _kind(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"


def empty_state() -> TensorDict:
    """A fresh, empty state TensorDict (the state of a stateless transform)."""
    return TensorDict(batch_size=[])


_STRUCTURES = 64  # a bucketed update sees one key structure per bucket


def per_structure(cache: dict, key: tuple, make: Callable[[], object]):
    """``cache[key]``, made by ``make()`` on a miss; at most a few dozen structures are kept
    (one per bucket of a bucketed update, plus the whole tree), the oldest dropped first."""
    if key not in cache:
        if len(cache) >= _STRUCTURES:
            cache.pop(next(iter(cache)))
        cache[key] = make()
    return cache[key]


_MISSING = object()


def tree_get(tree: TensorDictBase, name: str | Path, default=_MISSING):
    """The one entry of ``tree`` whose path ends with ``name`` (optax ``tree_utils.tree_get``).

    This is how hyper-parameters and counters kept in an optimizer state are read without
    knowing how the optimizer is nested: ``tree_get(opt, "learning_rate")``,
    ``tree_get(opt, ("loss_scale", "skipped"))``.

    Args:
        tree: a nested TensorDict (e.g. ``state["opt"]``).
        name: a key, or a tuple of trailing keys.
        default: returned when nothing matches (without it, ``KeyError``).

    Returns:
        The tensor or sub-TensorDict found.

    Raises:
        KeyError: nothing matches and no ``default`` was given.
        ValueError: more than one entry matches (the message lists them).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from ftrain.optim import adamw, tree_get
        >>> tx = adamw(1e-3)
        >>> float(tree_get(tx.init(TensorDict({"w": torch.ones(2)})), "learning_rate"))
        0.001
    """
    suffix = (name,) if isinstance(name, str) else tuple(name)
    found: list[Path] = []
    _find(tree, (), suffix, found)
    at = _the_one(found, suffix, default)
    return default if at is None else tree.get(at)


def leaf_get(
    keys: Sequence[Path], leaves: Sequence[torch.Tensor], name: str | Path, default=_MISSING
):
    """:func:`tree_get` for a leaf of a tree already flattened (``keys``, ``leaves``): the
    same match, errors and default, without walking the tree again.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from ftrain.optim import adamw, flatten
        >>> from ftrain.optim.base import leaf_get
        >>> keys, leaves = flatten(adamw(1e-3).init(TensorDict({"w": torch.ones(2)})))
        >>> float(leaf_get(keys, leaves, "learning_rate"))
        0.001
    """
    suffix = (name,) if isinstance(name, str) else tuple(name)
    n = len(suffix)
    found = [i for i, k in enumerate(keys) if k[-n:] == suffix]
    at = _the_one([keys[i] for i in found], suffix, default)
    return default if at is None else leaves[found[0]]


def _the_one(found: list[Path], suffix: Path, default) -> Path | None:
    """The one path found (None: nothing, and a default was given)."""
    if len(found) > 1:
        shown = [path_str(p) for p in found]
        raise ValueError(f"tree_get: {path_str(suffix)!r} is ambiguous, it matches {shown}")
    if found:
        return found[0]
    if default is _MISSING:
        raise KeyError(f"tree_get: no entry ending with {path_str(suffix)!r}")
    return None


def _find(td: TensorDictBase, prefix: Path, suffix: Path, found: list[Path]) -> None:
    items = entries(td)  # the step asks every update (the loss scale): no TensorDict.get
    for k in sorted(items):
        path = (*prefix, k)
        if path[-len(suffix) :] == suffix:
            found.append(path)
        elif is_node(items[k]):
            _find(items[k], path, suffix, found)


# ----------------------------------------------------------------------------- transforms


class FlatUpdate:
    """An ``update`` function implemented on flat leaf lists, callable on TensorDicts.

    ``FlatUpdate(name, flat)`` behaves like ``update(updates, state, params=None)``;
    ``flat(keys, updates, state, params)`` receives sorted leaf lists (``params`` may be
    ``None``) and the transform's own state TensorDict, and returns new leaf lists and state.
    """

    __slots__ = ("flat", "frozen_of", "name", "prepare", "refresh")

    def __init__(
        self,
        name: str,
        flat: FlatFn,
        frozen_of: FrozenFn | None = None,
        prepare: Prepare | None = None,
        refresh: Refresh | None = None,
    ) -> None:
        self.name = name
        self.flat = flat
        # ``frozen_of(keys, leaves) -> indices`` this transform never updates (see
        # :func:`frozen_indices`); None: it may update every leaf
        self.frozen_of = frozen_of
        # the bucketed form of ``flat`` (:mod:`ftrain.optim.bucketed`); None: whole tree only
        self.prepare = prepare
        # recomputes the state's derived leaves (see refresh_hyperparams); None: it has none
        self.refresh = refresh

    def __call__(
        self,
        updates: TensorDictBase,
        state: TensorDictBase,
        params: TensorDictBase | None = None,
    ) -> tuple[TensorDictBase, TensorDictBase]:
        if not isinstance(state, TensorDictBase):
            raise TypeError(
                f"{self.name}.update needs the optimizer state as its second argument, got "
                f"{type(state).__name__}; pass the TensorDict that init(params) returned"
            )
        keys, leaves = flatten(updates)
        plist = None
        if params is not None:
            pkeys, plist = flatten(params)
            check_keys(keys, pkeys, "params")
            check_shapes(keys, leaves, plist)
        with torch.no_grad():
            out, new_state = self.flat(keys, leaves, state, plist)
        return unflatten(keys, out, device=updates.device), new_state

    def __repr__(self) -> str:
        return f"FlatUpdate({self.name!r})"


def make_transform(
    name: str,
    init: Callable[[TensorDictBase], TensorDictBase],
    flat: FlatFn,
    frozen_of: FrozenFn | None = None,
    prepare: Prepare | None = None,
    refresh: Refresh | None = None,
) -> GradientTransformation:
    """Build a :class:`GradientTransformation` from an ``init`` and a flat update function.

    Args:
        name: the transform's name; ``chain`` keys this transform's state by it.
        init: ``init(params) -> state TensorDict``.
        flat: ``flat(keys, updates, state, params) -> (updates, state)`` over sorted leaf
            lists (see :class:`FlatUpdate`); pure.
        frozen_of: ``frozen_of(keys, leaves) -> sorted indices`` of the leaves this
            transform leaves unchanged whatever their gradients (``frozen`` ones); the step
            does not differentiate them (:func:`frozen_indices`). Only for transforms that
            give them zero updates and no state.
        prepare: the bucketed form of ``flat`` (:mod:`ftrain.optim.bucketed`), which lets
            the step update one bucket of leaves at a time; e.g. ``leafwise(flat, name)``
            for a ``flat`` whose results for a leaf depend on that leaf alone. None: the
            step runs ``flat`` on the whole tree.
        refresh: ``refresh(state) -> state`` recomputing the leaves of the state that only
            show a hyper-parameter (e.g. ``learning_rate`` from ``count``), for
            :func:`refresh_hyperparams`; None: the state has none.

    Returns:
        The transform; its ``update`` is a :class:`FlatUpdate`.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from ftrain.optim import make_transform
        >>> def flat(keys, u, state, params):
        ...     return torch._foreach_neg(u), state
        >>> negate = make_transform("negate", lambda params: TensorDict(), flat)
    """
    return GradientTransformation(init, FlatUpdate(name, flat, frozen_of, prepare, refresh))


def refresh_hyperparams(tx: GradientTransformation, state: TensorDictBase) -> TensorDictBase:
    """``state`` with the leaves that only *show* a hyper-parameter recomputed by ``tx``.

    ``scale_by_learning_rate`` keeps ``learning_rate`` (the rate the next update applies)
    beside ``count``; updates always compute the rate from ``count`` and the schedule, but
    that shown value was computed by the schedule of the run that saved the state. After a
    restore with another schedule (``schedule.decay_steps`` or the peak rate changed on a
    resume), this makes it the current schedule's, so what is reported (the resume's next
    rate, the first step's ``lr`` metric) is what is applied. Nothing else changes: with
    the same schedule the values are bit-identical.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from ftrain.optim import adamw, refresh_hyperparams, schedule, tree_get
        >>> params = TensorDict({"w": torch.ones(2)}, batch_size=[])
        >>> old = adamw(schedule.warmup_cosine(1e-3, 10, 100)).init(params)
        >>> new_tx = adamw(schedule.warmup_cosine(1e-3, 0, 100))
        >>> float(tree_get(refresh_hyperparams(new_tx, old), "learning_rate"))
        0.001
    """
    refresh = getattr(tx.update, "refresh", None)
    return state if refresh is None else refresh(state)


def refreshing_members(members, owner: str) -> Refresh | None:
    """The refresh of a state keyed by member (``[(key, transform)]``): each member's own on
    its entry, every other entry kept as it is; None when no member has one."""
    fns = {n: getattr(tx.update, "refresh", None) for n, tx in members}
    fns = {n: fn for n, fn in fns.items() if fn is not None}
    if not fns:
        return None

    def refresh(state: TensorDictBase) -> TensorDictBase:
        for n in fns:
            member_state(state, n, owner)  # a clear error for a state of another optimizer
        return new_td({k: fns[k](v) if k in fns else v for k, v in entries(state).items()})

    return refresh


def frozen_indices(
    tx: GradientTransformation, keys: list[Path], leaves: list[torch.Tensor]
) -> list[int]:
    """Sorted indices of the leaves ``tx`` freezes (:func:`ftrain.optim.frozen` labels).

    A frozen leaf gets a zero update and no optimizer state, so the step neither
    differentiates it nor passes it to ``tx``: it is carried into the next state as the
    same tensor object. A user transform with a plain ``update`` freezes nothing.
    """
    fn = getattr(tx.update, "frozen_of", None)
    return [] if fn is None else list(fn(keys, leaves))


def union_frozen(transforms: Sequence[GradientTransformation]) -> FrozenFn | None:
    """``frozen_of`` of a composition: a leaf is frozen if any member freezes it."""
    fns = [f for tx in transforms if (f := getattr(tx.update, "frozen_of", None)) is not None]
    if not fns:
        return None

    def frozen_of(keys: list[Path], leaves: list[torch.Tensor]) -> list[int]:
        return sorted({i for f in fns for i in f(keys, leaves)})

    return frozen_of


class Trainable:
    """Which leaves of a key list are trainable under ``frozen_of``, cached per structure.

    Frozen-aware compositions (``chain``, ``multi_transform``) run their members on the
    trainable leaves only: the step passes just those, while a caller with the whole tree
    (optax style) gets zero updates back for the frozen ones.
    """

    __slots__ = ("cache", "frozen_of")

    def __init__(self, frozen_of: FrozenFn | None) -> None:
        self.frozen_of = frozen_of
        self.cache: dict[tuple[Path, ...], list[int] | None] = {}

    def indices(self, keys: list[Path], leaves: list[torch.Tensor]) -> list[int] | None:
        """Trainable indices, or None when every leaf is trainable."""
        if self.frozen_of is None:
            return None
        return per_structure(self.cache, tuple(keys), lambda: self._indices(keys, leaves))

    def _indices(self, keys: list[Path], leaves: list[torch.Tensor]) -> list[int] | None:
        frozen = set(self.frozen_of(keys, leaves))
        return [i for i in range(len(keys)) if i not in frozen] if frozen else None

    def params(self, params: TensorDictBase) -> TensorDictBase:
        """The trainable part of a parameter tree (what members' ``init`` sees)."""
        keys, leaves = flatten(params)
        keep = self.indices(keys, leaves)
        if keep is None:
            return params
        return unflatten([keys[i] for i in keep], [leaves[i] for i in keep], device=params.device)


def pick(idx: list[int], items: list | None) -> list | None:
    """``[items[i] for i in idx]`` (None stays None)."""
    return None if items is None else [items[i] for i in idx]


def with_zeros(updates: list[torch.Tensor], idx: list[int], values: list) -> list:
    """``values`` at positions ``idx`` of ``updates``, zero updates at the other (frozen) ones."""
    out: list = [None] * len(updates)
    for i, v in zip(idx, values, strict=True):
        out[i] = v
    return [torch.zeros_like(u) if o is None else o for u, o in zip(updates, out, strict=True)]


def flat_update(tx: GradientTransformation) -> FlatFn:
    """``tx.update`` on flat leaf lists: a built-in's own ``.flat``, or an adapter around a
    user's TensorDict ``update`` (it rebuilds the trees for that member only)."""
    if isinstance(tx.update, FlatUpdate):
        return tx.update.flat
    update = tx.update

    def flat(keys, u, state, params):
        ptree = unflatten(keys, params) if params is not None else None
        out, new_state = update(unflatten(keys, u), state, ptree)
        okeys, leaves = flatten(out)
        check_keys(keys, okeys, f"the updates returned by {_transform_name(tx)}")
        return leaves, new_state

    return flat


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


def member_state(state: TensorDictBase, name: str, owner: str = "chain") -> TensorDictBase:
    """``state[name]``, or a ``ValueError`` that says the state is not this optimizer's."""
    try:
        return state[name]
    except KeyError:
        raise ValueError(
            f"{owner} state has no entry {name!r} (it has {sorted(state.keys())}); "
            "create the state with this optimizer's init(params)"
        ) from None


def chain(*transforms: GradientTransformation, name: str = "chain") -> GradientTransformation:
    """Compose transforms left to right: each member's output updates feed the next.

    The state is a TensorDict keyed by member name (``scale_by_adam``, ``trace``, ...); a
    repeated name gets a suffix (``scale``, ``scale_1``). A chain nested in another is one
    member, keyed by its ``name``.

    Args:
        *transforms: the members, applied in order.
        name: this chain's name as a member of another chain (``adamw`` names its chain
            ``"adamw"``).

    Returns:
        A :class:`GradientTransformation`.

    Raises:
        TypeError: if a member is not a GradientTransformation.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from ftrain.optim import chain, clip_by_global_norm, scale_by_adam
        >>> from ftrain.optim import scale_by_learning_rate
        >>> tx = chain(clip_by_global_norm(1.0), scale_by_adam(), scale_by_learning_rate(1e-3))
        >>> list(tx.init(TensorDict({"w": torch.ones(2)})).keys())
        ['clip_by_global_norm', 'scale_by_adam', 'scale_by_learning_rate']
    """
    for i, tx in enumerate(transforms):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"chain member {i} must be a GradientTransformation, got {type(tx).__name__}"
            )
    names = _unique_names(transforms)
    members = [(n, tx, flat_update(tx)) for n, tx in zip(names, transforms, strict=True)]
    frozen_of = union_frozen(transforms)
    trainable = Trainable(frozen_of)

    def init(params: TensorDictBase) -> TensorDict:
        params = trainable.params(params)  # members hold state for trainable leaves only
        return new_td({n: tx.init(params) for n, tx, _ in members})

    def run(keys, updates, state, params):
        new_states = {}
        for n, _, fn in members:
            updates, new_states[n] = fn(keys, updates, member_state(state, n), params)
        return updates, new_td(new_states)

    def flat(keys, updates, state, params):
        keep = trainable.indices(keys, params if params is not None else updates)
        if keep is None:
            return run(keys, updates, state, params)
        out, new_state = run(pick(keep, keys), pick(keep, updates), state, pick(keep, params))
        return with_zeros(updates, keep, out), new_state  # frozen leaves passed in: no update

    preps = [(n, prepare_of(tx)) for n, tx, _ in members]
    prepare = None
    if all(p is not None for _, p in preps):

        def prepare(src: Source, state: TensorDictBase) -> Body:
            trainable_only(trainable, src, name)
            bodies = []
            for n, prep in preps:  # each member's globals are fixed on its own input
                bodies.append((n, prep(src, member_state(state, n))))
                src = src.then(bodies[-1][1])

            def body(idx, updates, params, owned=False, donated=False, apply=False):
                new_states = {}
                for i, (n, member) in enumerate(bodies):
                    last = apply and i == len(bodies) - 1  # the last member applies
                    out, new_states[n] = call_body(
                        member, idx, updates, params, owned, donated, apply=last
                    )
                    owned = handed_on(member, out, updates, owned)
                    updates = out
                if apply and not bodies:  # nothing to apply: the parameters as they are
                    updates = params if donated else [p.clone() for p in params]
                return updates, new_td(new_states)

            # its output is the last member's: handed on owned only if that one's is
            out = owning(body, hands_on=not bodies or hands_on(bodies[-1][1]))
            return applying(out) if applies(prepare) else out

        if preps and applies(preps[-1][1]):  # the last member applies its updates itself
            applying(prepare)

    refresh = refreshing_members([(n, tx) for n, tx, _ in members], name)
    return make_transform(name, init, flat, frozen_of, prepare, refresh)


def trainable_only(trainable: Trainable, src: Source, owner: str) -> None:
    """A bucketed update sees trainable leaves only (as the step passes them)."""
    if trainable.indices(src.keys, src.params) is not None:
        raise ValueError(
            f"{owner}: a bucketed update (prepare) takes the trainable leaves only, as "
            "make_step passes them; call update on the whole tree to include frozen ones"
        )
