"""Pytree helpers over nested TensorDicts: flatten, rebuild, compare, replace, cast, count.

A *tree* here is a nested ``TensorDict`` with ``batch_size=[]`` whose leaves are tensors.
:func:`flatten` lists leaves in *sorted path order*, never insertion order: a restored
checkpoint (keys in storage order) and a live state (keys in module order) must feed the
same leaves, in the same order, to order-sensitive reductions such as the global grad norm,
or a resumed run drifts from the uninterrupted one by rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase

__all__ = [
    "Key",
    "Structure",
    "cast",
    "count_params",
    "entries",
    "first_difference",
    "flatten",
    "is_node",
    "map_leaves",
    "new_td",
    "nodes_and_leaves",
    "path_str",
    "rebuild",
    "replace",
    "structure",
    "tree_equal",
    "unflatten",
]

Key = tuple[str, ...]
Path = Key


def path_str(key: str | Key) -> str:
    """Dot-joined path of a nested key: ``("h", "0", "weight") -> "h.0.weight"``."""
    return key if isinstance(key, str) else ".".join(key)


def entries(td: TensorDictBase) -> dict[str, Any]:
    """A TensorDict node's entries as a plain dict (its own dict for a plain TensorDict).

    Walks run several times per update, so they avoid TensorDict's generic iteration and
    ``get`` (~2 µs a key): a plain TensorDict keeps its entries in a dict.
    """
    found = getattr(td, "_tensordict", None) if type(td) is TensorDict else None
    return found if isinstance(found, dict) else dict(td.items())


def is_node(v: Any) -> bool:
    """True for a sub-TensorDict (exact type check first: the ABC check is slow)."""
    return type(v) is TensorDict or (
        not isinstance(v, torch.Tensor) and isinstance(v, TensorDictBase)
    )


def _walk(
    td: TensorDictBase,
    prefix: Path,
    keys: list[Path],
    leaves: list[torch.Tensor],
    empty: list[Path] | None = None,
    nodes: list[Path] | None = None,
) -> None:
    if nodes is not None:
        nodes.append(prefix)
    items = entries(td)
    for k in sorted(items):
        v = items[k]
        if is_node(v):
            n_leaves, n_empty = len(leaves), len(empty or ())
            _walk(v, (*prefix, k), keys, leaves, empty, nodes)
            if empty is not None and len(leaves) == n_leaves:  # no leaf below: one entry
                del empty[n_empty:]
                empty.append((*prefix, k))
        else:
            keys.append((*prefix, k))
            leaves.append(v)


def flatten(tree: TensorDictBase) -> tuple[list[Path], list[torch.Tensor]]:
    """Flatten a nested TensorDict into (paths, leaves), sorted by path.

    Args:
        tree: a nested TensorDict (``batch_size=[]``); empty sub-TensorDicts contribute nothing.

    Returns:
        ``(keys, leaves)``: lists of path tuples and the tensors at those paths, in
        lexicographic path order (the order does not depend on insertion order).

    Raises:
        TypeError: if ``tree`` is not a TensorDict.

    Example:
        >>> keys, leaves = flatten(TensorDict({"b": torch.ones(1), "a": {"x": torch.zeros(1)}}))
        >>> keys
        [('a', 'x'), ('b',)]
    """
    if not isinstance(tree, TensorDictBase):
        raise TypeError(
            f"ftrain works on tensordict.TensorDict pytrees, got {type(tree).__name__}; "
            "wrap a dict with TensorDict(d, batch_size=[]) or use TensorDict.from_module(model)"
        )
    keys: list[Path] = []
    leaves: list[torch.Tensor] = []
    _walk(tree, (), keys, leaves)
    return keys, leaves


def nodes_and_leaves(
    tree: TensorDictBase,
) -> tuple[list[Path], list[Path], list[torch.Tensor]]:
    """Every node's path and every leaf's path and value, in one :func:`flatten` walk.

    What a checkpoint stores (:mod:`ftrain.ckpt.store`): a group per node, empty sub-trees
    included, and an array per leaf. Nodes come parents first (the root is ``()``), leaves
    in :func:`flatten`'s order: sorted by path, whatever the insertion order.

    Example:
        >>> nodes, keys, _ = nodes_and_leaves(TensorDict({"b": {}, "a": {"x": torch.ones(1)}}))
        >>> nodes, keys
        ([(), ('a',), ('b',)], [('a', 'x')])
    """
    if not isinstance(tree, TensorDictBase):
        flatten(tree)  # raises the TypeError
    nodes: list[Path] = []
    keys: list[Path] = []
    leaves: list[torch.Tensor] = []
    _walk(tree, (), keys, leaves, nodes=nodes)
    return nodes, keys, leaves


def _nest(keys: Sequence[Path], leaves: Sequence[torch.Tensor]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for path, leaf in zip(keys, leaves, strict=True):
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = leaf
    return root


def new_td(source: dict[str, Any], device: torch.device | str | None = None) -> TensorDict:
    """Build a ``batch_size=[]`` TensorDict from a (nested) dict without re-validating leaves."""
    return TensorDict._new_unsafe(source, batch_size=torch.Size(()), device=device)


def unflatten(
    keys: Sequence[Path],
    leaves: Sequence[torch.Tensor],
    *,
    device: torch.device | str | None = None,
) -> TensorDict:
    """Inverse of :func:`flatten`: build a nested TensorDict from paths and leaves.

    Args:
        keys: path tuples, as returned by :func:`flatten`.
        leaves: one tensor per path.
        device: the TensorDict's ``device`` attribute (``None``: mixed / unspecified).

    Returns:
        A new nested TensorDict with ``batch_size=[]``.

    Raises:
        ValueError: if ``keys`` and ``leaves`` differ in length.

    Example:
        >>> td = unflatten([("a", "x"), ("b",)], [torch.zeros(1), torch.ones(1)])
        >>> td["a", "x"]
        tensor([0.])
    """
    if len(keys) != len(leaves):
        raise ValueError(f"unflatten needs one leaf per key, got {len(keys)=} and {len(leaves)=}")
    return new_td(_nest(keys, leaves), device)


class Structure(NamedTuple):
    """A tree's layout without its leaves: what :func:`rebuild` needs to make it again.

    Attributes:
        keys: the leaf paths, in :func:`flatten` order.
        empty: paths of sub-trees with no leaves (e.g. a stateless transform's ``{}``),
            which a plain :func:`unflatten` would drop.
    """

    keys: tuple[Key, ...]
    empty: tuple[Key, ...]


def structure(tree: TensorDictBase) -> tuple[Structure, list[torch.Tensor]]:
    """Flatten ``tree`` keeping its empty sub-trees: ``(structure, leaves)``.

    Example:
        >>> s, leaves = structure(TensorDict({"a": {}, "b": torch.ones(1)}))
        >>> s.empty, len(leaves)
        ((('a',),), 1)
    """
    if not isinstance(tree, TensorDictBase):
        flatten(tree)  # raises the TypeError
    keys: list[Key] = []
    leaves: list[torch.Tensor] = []
    empty: list[Key] = []
    _walk(tree, (), keys, leaves, empty)  # one walk for both (it runs every step)
    return Structure(tuple(keys), tuple(empty)), leaves


def rebuild(
    layout: Structure, leaves: Sequence[torch.Tensor], device: torch.device | str | None = None
) -> TensorDict:
    """Inverse of :func:`structure`: the tree with these leaves, empty sub-trees included.

    Example:
        >>> s, leaves = structure(TensorDict({"a": {}, "b": torch.ones(1)}))
        >>> sorted(rebuild(s, leaves).keys())
        ['a', 'b']
    """
    if len(layout.keys) != len(leaves):
        raise ValueError(f"rebuild needs {len(layout.keys)} leaves, got {len(leaves)}")
    root = _nest(layout.keys, leaves)
    for path in layout.empty:
        node = root
        for part in path:
            node = node.setdefault(part, {})
    return new_td(root, device)


def replace(tree: TensorDictBase, **subtrees: TensorDictBase | torch.Tensor) -> TensorDict:
    """A new tree equal to ``tree`` with top-level entries replaced (leaves are shared, not copied).

    Keys must already exist, and keep their kind: a state's layout is fixed (a sub-tree
    stays a sub-tree, a leaf a leaf).

    Example:
        >>> t = TensorDict(step=torch.tensor(0), x=torch.zeros(2))
        >>> int(replace(t, step=torch.tensor(5))["step"])
        5
    """
    unknown = sorted(set(subtrees) - set(tree.keys()))
    if unknown:
        raise KeyError(
            f"replace() got keys {unknown} that the tree lacks; it has {sorted(tree.keys())}"
        )
    reshaped = [
        k
        for k, v in subtrees.items()
        if isinstance(v, TensorDictBase) != isinstance(tree.get(k), TensorDictBase)
    ]
    if reshaped:  # params=torch.ones(2) turned the params sub-tree into one leaf, silently
        raise TypeError(
            f"replace() would turn {reshaped} from "
            + ", ".join(_kind(tree.get(k)) + " into " + _kind(subtrees[k]) for k in reshaped)
            + "; give a TensorDict for a sub-tree and a tensor for a leaf"
        )
    out = TensorDict({k: subtrees.get(k, tree.get(k)) for k in tree.keys()}, batch_size=[])
    return out.lock_() if tree.is_locked else out


def _kind(value: object) -> str:
    return "a sub-tree" if isinstance(value, TensorDictBase) else f"a {type(value).__name__}"


def cast(tree: TensorDictBase, dtype: torch.dtype, *, floating_only: bool = True) -> TensorDict:
    """Cast leaves to ``dtype`` (by default only floating-point leaves; ints, bools, keys
    stay), keeping the tree's structure (empty sub-trees, the lock): a cast state steps."""

    def _cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if (t.is_floating_point() or not floating_only) else t

    return map_leaves(_cast, tree)


def count_params(tree: TensorDictBase) -> int:
    """Number of scalar elements in all leaves (pass ``state["params"]`` for the parameter count)."""
    return sum(t.numel() for t in flatten(tree)[1])


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"


def _leaf_difference(path: str, a: torch.Tensor, b: torch.Tensor) -> str | None:
    for t in (a, b):  # torch's "Cannot copy out of meta tensor" / resolve_conj errors
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{path}: a {type(t).__name__} leaf, not a tensor: nothing to compare")
        if t.is_meta:
            raise ValueError(f"{path}: a meta tensor has a shape and no values to compare")
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{path}: {_describe(a)} != {_describe(b)}"
    a_c, b_c = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    if torch.equal(_bits(a_c), _bits(b_c)):
        return None
    diff = (_bits(a_c) != _bits(b_c)).reshape(a_c.numel(), -1).any(dim=1).nonzero()
    idx = int(diff[0])
    return f"{path}: values differ at flat index {idx} ({a_c[idx].item()} vs {b_c[idx].item()})"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits on any devices (NaN equals an identical NaN; -0.0 is not
    0.0): what "the same tensor" means for tied weights and checkpoints."""
    return _leaf_difference("", a, b) is None


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a 1-d tensor, so comparisons are bitwise (NaN == NaN, -0.0 != 0.0);
    a conjugate or negative view is resolved first (``view`` refuses those)."""
    return flat.resolve_conj().resolve_neg().contiguous().view(torch.uint8)


def first_difference(a: TensorDictBase, b: TensorDictBase) -> str | None:
    """Describe the first difference between two trees (keys, dtype, shape, bits), or ``None``.

    Bit-level: ``-0.0`` differs from ``0.0`` and NaNs with equal bits are equal, which is what
    "resumed run is bit-identical" means.

    Example:
        >>> first_difference(TensorDict(a=torch.zeros(2)), TensorDict(a=torch.ones(2)))
        'a: values differ at flat index 0 (0.0 vs 1.0)'
    """
    ka, la = flatten(a)
    kb, lb = flatten(b)
    only_a, only_b = set(ka) - set(kb), set(kb) - set(ka)
    if only_a or only_b:
        name = path_str  # dotted, unless that reads the same for both ("a.b" vs a/b)
        if {path_str(k) for k in only_a} & {path_str(k) for k in only_b}:
            name = "/".join
        return (
            f"keys differ: only in first {sorted(map(name, only_a))}, "
            f"only in second {sorted(map(name, only_b))}"
        )
    b_by_key = dict(zip(kb, lb, strict=True))
    for k, t in zip(ka, la, strict=True):
        msg = _leaf_difference(path_str(k), t, b_by_key[k])
        if msg is not None:
            return msg
    return None


def tree_equal(a: TensorDictBase, b: TensorDictBase) -> bool:
    """True when both trees have the same keys, dtypes, shapes and bit-identical leaves."""
    return first_difference(a, b) is None


def map_leaves(fn: Callable[[torch.Tensor], torch.Tensor], tree: TensorDictBase) -> TensorDict:
    """Apply ``fn`` to every leaf, returning a new tree of the same structure: empty
    sub-trees kept (a state's ``buffers: {}``, a stateless transform's ``{}``: the step
    needs them) and locked if ``tree`` was."""
    layout, leaves = structure(tree)
    out = rebuild(layout, [fn(t) for t in leaves])
    return out.lock_() if tree.is_locked else out
