"""Pytree helpers over nested TensorDicts: flatten, rebuild, compare, replace, cast, count.

A *tree* here is a nested ``TensorDict`` with ``batch_size=[]`` whose leaves are tensors.
Leaf order is the TensorDict's insertion order, which is stable for trees built the same
way; :func:`flatten` returns the keys so a tree can be rebuilt from new leaves cheaply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

__all__ = [
    "cast",
    "count_params",
    "first_difference",
    "flatten",
    "path_str",
    "replace",
    "tree_equal",
    "unflatten",
]

Key = tuple[str, ...]


def path_str(key: str | Key) -> str:
    """Dot-joined path of a nested key: ``("h", "0", "weight") -> "h.0.weight"``."""
    return key if isinstance(key, str) else ".".join(key)


def flatten(tree: TensorDictBase) -> tuple[list[Key], list[torch.Tensor]]:
    """Leaf keys (as tuples) and leaves of ``tree``, in a stable order.

    Example:
        >>> keys, leaves = flatten(TensorDict(a=torch.zeros(1), b={"c": torch.ones(2)}))
        >>> keys
        [('a',), ('b', 'c')]
    """
    keys = [k if isinstance(k, tuple) else (k,) for k in tree.keys(True, True)]
    return keys, [tree.get(k) for k in keys]


def unflatten(keys: Sequence[Key], leaves: Sequence[torch.Tensor]) -> TensorDict:
    """Rebuild a tree from :func:`flatten`'s keys and (new) leaves, without copying."""
    if len(keys) != len(leaves):
        raise ValueError(f"unflatten got {len(keys)} keys but {len(leaves)} leaves")
    return TensorDict(dict(zip(keys, leaves, strict=True)), batch_size=[])


def replace(tree: TensorDictBase, **subtrees: TensorDictBase | torch.Tensor) -> TensorDict:
    """A new tree equal to ``tree`` with top-level entries replaced (leaves are shared, not copied).

    Keys must already exist: a state's key set is fixed.

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
    out = TensorDict({k: subtrees.get(k, tree.get(k)) for k in tree.keys()}, batch_size=[])
    return out.lock_() if tree.is_locked else out


def cast(tree: TensorDictBase, dtype: torch.dtype, *, floating_only: bool = True) -> TensorDict:
    """Cast leaves to ``dtype`` (by default only floating-point leaves; ints, bools, keys stay)."""

    def _cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if (t.is_floating_point() or not floating_only) else t

    keys, leaves = flatten(tree)
    return unflatten(keys, [_cast(t) for t in leaves])


def count_params(tree: TensorDictBase) -> int:
    """Number of scalar elements in all leaves (pass ``state["params"]`` for the parameter count)."""
    return sum(t.numel() for t in flatten(tree)[1])


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"


def _leaf_difference(path: str, a: torch.Tensor, b: torch.Tensor) -> str | None:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{path}: {_describe(a)} != {_describe(b)}"
    a_c, b_c = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    if torch.equal(_bits(a_c), _bits(b_c)):
        return None
    diff = (_bits(a_c) != _bits(b_c)).reshape(a_c.numel(), -1).any(dim=1).nonzero()
    idx = int(diff[0])
    return f"{path}: values differ at flat index {idx} ({a_c[idx].item()} vs {b_c[idx].item()})"


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a 1-d tensor, so comparisons are bitwise (NaN == NaN, -0.0 != 0.0)."""
    return flat.contiguous().view(torch.uint8)


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
        return (
            f"keys differ: only in first {sorted(map(path_str, only_a))}, "
            f"only in second {sorted(map(path_str, only_b))}"
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
    """Apply ``fn`` to every leaf, returning a new tree."""
    keys, leaves = flatten(tree)
    return unflatten(keys, [fn(t) for t in leaves])
