"""Parameter masks: predicates over parameter paths (equinox-filter style, no param_groups).

A mask decides, per leaf, whether a transform applies to it (e.g. which parameters get weight
decay). It is either

* a predicate ``mask(path: str, tensor) -> bool`` where ``path`` is the dot-joined key path
  of the leaf (``"h.0.attn.c_attn.weight"``) and ``tensor`` the parameter, or
* a TensorDict of booleans (0-d bool tensors) with the same paths as the parameters.

Masks are resolved once per parameter tree structure (path list) and cached, so the predicate
is not re-run on every step: it must depend only on the path and the tensor's static
properties (shape, dtype), never on its values.

Example (GPT-2 style: decay matrices, not biases/norms/embeddings)::

    from ftrain.optim import adamw, masks
    tx = adamw(6e-4, weight_decay=0.1,
               mask=masks.all_of(masks.ndim_at_least(2), masks.exclude("wte", "wpe")))
"""

from __future__ import annotations

import fnmatch
import inspect
import re
from collections.abc import Callable

import torch
from tensordict import TensorDictBase

from ftrain.optim.base import Path, flatten, path_str

__all__ = ["Mask", "all_of", "exclude", "glob", "ndim_at_least", "resolve"]

Predicate = Callable[[str, torch.Tensor], bool]
Mask = Predicate | TensorDictBase


def ndim_at_least(n: int) -> Predicate:
    """Select leaves with at least ``n`` dimensions (``ndim_at_least(2)``: weights, not biases).

    Args:
        n: the minimum number of dimensions (non-negative int).

    Returns:
        A predicate ``(path, tensor) -> bool``.

    Raises:
        ValueError: if ``n`` is not a non-negative int.

    Example:
        >>> ndim_at_least(2)("h.0.mlp.c_fc.weight", torch.zeros(4, 4))
        True
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"ndim_at_least requires a non-negative int, got {n=}")

    def predicate(path: str, tensor: torch.Tensor) -> bool:
        return tensor.ndim >= n

    predicate.__qualname__ = f"ndim_at_least({n})"
    return predicate


def exclude(*substrings: str) -> Predicate:
    """Select every leaf whose dotted path contains none of ``substrings``.

    Args:
        *substrings: path fragments to leave out, e.g. ``"ln_"``, ``"bias"``, ``"wte"``.

    Returns:
        A predicate ``(path, tensor) -> bool``.

    Raises:
        ValueError: if no substring is given or one is not a non-empty string.

    Example:
        >>> exclude("bias", "ln_")("h.0.ln_1.weight", torch.zeros(4))
        False
    """
    if not substrings or not all(isinstance(s, str) and s for s in substrings):
        raise ValueError(f"exclude requires one or more non-empty strings, got {substrings=}")

    def predicate(path: str, tensor: torch.Tensor) -> bool:
        return not any(s in path for s in substrings)

    predicate.__qualname__ = f"exclude{substrings!r}"
    return predicate


def glob(*patterns: str) -> Predicate:
    """Select leaves whose dotted path matches any of the shell-style ``patterns``.

    ``fnmatch`` rules, case-sensitive: ``*`` matches anything (dots included), ``?`` one
    character, ``[0-5]`` a character range. The config's ``optim.freeze`` uses these.

    Args:
        *patterns: e.g. ``"transformer.h.[0-5].*"``, ``"*.lora_A"``, ``"lm_head.weight"``.

    Returns:
        A predicate ``(path, tensor) -> bool``.

    Raises:
        ValueError: if no pattern is given or one is not a non-empty string.

    Example:
        >>> glob("transformer.h.[0-1].*")("transformer.h.1.attn.c_attn.weight", torch.zeros(1))
        True
    """
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"glob requires one or more non-empty pattern strings, got {patterns=}")
    compiled = [re.compile(fnmatch.translate(p)) for p in patterns]

    def predicate(path: str, tensor: torch.Tensor) -> bool:
        return any(c.match(path) for c in compiled)

    predicate.__qualname__ = f"glob{patterns!r}"
    return predicate


def all_of(*predicates: Predicate) -> Predicate:
    """Select leaves that every one of ``predicates`` selects.

    Args:
        *predicates: predicates ``(path, tensor) -> bool``.

    Returns:
        Their conjunction.

    Raises:
        ValueError: if no predicate is given or one is not callable.

    Example:
        >>> m = all_of(ndim_at_least(2), exclude("wte"))
        >>> m("wte.weight", torch.zeros(4, 4)), m("h.0.mlp.c_fc.weight", torch.zeros(4, 4))
        (False, True)
    """
    if not predicates or not all(callable(p) for p in predicates):
        raise ValueError(f"all_of requires one or more callables, got {predicates=}")

    def predicate(path: str, tensor: torch.Tensor) -> bool:
        return all(p(path, tensor) for p in predicates)

    return predicate


def _table(mask: TensorDictBase) -> dict[str, bool]:
    keys, leaves = flatten(mask)
    table = {}
    for key, leaf in zip(keys, leaves, strict=True):
        if leaf.dtype != torch.bool or leaf.numel() != 1:
            raise ValueError(
                f"a TensorDict mask must hold single booleans, got {leaf.dtype} of shape "
                f"{tuple(leaf.shape)} at {path_str(key)!r}"
            )
        table[path_str(key)] = bool(leaf.item())  # once, at construction: not on the hot path
    return table


def to_predicate(mask: Mask | None) -> Predicate | None:
    """Normalise a mask argument to a predicate (``None`` stays ``None``: everything selected).

    Raises:
        TypeError: if ``mask`` is neither callable nor a TensorDict.
    """
    if mask is None or callable(mask) and not isinstance(mask, TensorDictBase):
        return mask
    if isinstance(mask, TensorDictBase):
        table = _table(mask)

        def lookup(path: str, tensor: torch.Tensor) -> bool:
            try:
                return table[path]
            except KeyError:
                raise ValueError(
                    f"the mask TensorDict has no entry for parameter {path!r}; give it the "
                    "same paths as the parameters (e.g. params.apply(lambda t: torch.tensor(t.ndim >= 2)))"
                ) from None

        return lookup
    raise TypeError(
        f"a mask must be a predicate (path, tensor) -> bool or a TensorDict of bools, got {mask!r}"
    )


def resolve(predicate: Predicate, keys: list[Path], leaves: list[torch.Tensor]) -> list[int]:
    """Indices of the leaves a predicate selects.

    Args:
        predicate: ``(path, tensor) -> bool``.
        keys: sorted leaf paths (see :func:`ftrain.optim.base.flatten`).
        leaves: the matching parameter tensors.

    Returns:
        Sorted indices ``i`` with ``predicate(path_str(keys[i]), leaves[i])`` true.

    Example:
        >>> resolve(ndim_at_least(2), [("b",), ("w",)], [torch.zeros(2), torch.zeros(2, 2)])
        [1]
    """
    return [i for i, (k, t) in enumerate(zip(keys, leaves, strict=True)) if _picks(predicate, k, t)]


def _picks(predicate: Predicate, key: Path, leaf: torch.Tensor) -> bool:
    """One answer of a mask predicate, which must be ``(path, tensor) -> bool``: a lambda of
    one argument failed with Python's own arity error from here, and ``'no'`` selected."""
    try:  # its signature, not a TypeError from its call: one inside it keeps its traceback
        inspect.signature(predicate).bind(path_str(key), leaf)
    except TypeError as err:
        raise TypeError(
            f"a mask predicate takes (path, tensor) and returns a bool, e.g. lambda path, t: "
            f"t.ndim >= 2; {predicate!r} cannot be called so: {err}"
        ) from None
    except ValueError:  # no signature to read (a builtin): its call says
        pass
    answer = predicate(path_str(key), leaf)
    if isinstance(answer, str):  # "no" is truthy: it would select the leaf
        raise TypeError(
            f"a mask predicate must return a bool, {predicate!r} returned {answer!r} for "
            f"{path_str(key)!r}"
        )
    return bool(answer)
