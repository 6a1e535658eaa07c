"""Copy a state's params back into an ``nn.Module``, keeping its tied weights tied.

``TensorDict.to_module`` *replaces* each Parameter by the TensorDict's tensor. For a
module whose weights are aliased — HF ``GPT2LMHeadModel.lm_head.weight`` *is*
``transformer.wte.weight`` — it sets the two names one after the other, so a state whose
two leaves are different tensors (any out-of-place update makes them so) unties the
model. :func:`load_params` copies into the Parameters the module already has, under
``torch.no_grad``, so the objects (and every alias of them, and an optimizer's references)
stay; names, shapes and dtypes are checked first, all problems reported at once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from tensordict import TensorDictBase
from torch import nn

from ftrain.state.tree import same_bits

__all__ = ["load_params"]


def _flat(params) -> dict[str, torch.Tensor]:
    if isinstance(params, TensorDictBase):
        return dict(params.flatten_keys(".").items())
    if isinstance(params, Mapping):
        return dict(params)
    raise TypeError(
        f"load_params takes a TensorDict or {{name: tensor}}, got {type(params).__name__}"
    )


def _aliases(module: nn.Module) -> dict[int, list[str]]:
    """``{id(parameter): every name it has}`` in registration order."""
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return groups


def _problems(module: nn.Module, given: dict, strict: bool) -> tuple[list[str], list]:
    """(problems, [(parameter, source tensor)]) for ``given`` against ``module``."""
    by_name = dict(module.named_parameters(remove_duplicate=False))
    problems = [f"not a parameter of the module: {k}" for k in sorted(set(given) - set(by_name))]
    copies = []
    for names in _aliases(module).values():
        p, present = by_name[names[0]], [n for n in names if n in given]
        if not present:
            if strict:
                problems.append(f"missing: {' = '.join(names)}")
            continue
        src = given[present[0]]
        if not isinstance(src, torch.Tensor):
            problems.append(f"{present[0]}: given a {type(src).__name__}, not a tensor")
            continue
        if p.is_meta:  # copy_ into it is a no-op: "loaded", and the module had nothing
            problems.append(
                f"{names[0]}: the module's parameter is on the meta device (no memory to "
                "copy into); call module.to_empty(device='cpu') first"
            )
            continue
        if tuple(src.shape) != tuple(p.shape) or src.dtype != p.dtype:
            problems.append(
                f"{present[0]}: given {src.dtype}{tuple(src.shape)}, module {p.dtype}{tuple(p.shape)}"
            )
            continue
        differing = [n for n in present[1:] if not _same(given[n], src)]
        if differing:
            problems.append(
                f"tied parameters given different values: {present[0]} vs {', '.join(differing)} "
                "(they are one Parameter in the module; give one of them, or equal tensors)"
            )
            continue
        copies.append((p, src))
    return problems, copies


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (-0.0 == 0.0) or the same bits (a diverged run's NaN == NaN)."""
    return torch.equal(a.to(b.device), b) or same_bits(a, b)


def _buffer_problems(module: nn.Module, given: dict, strict: bool) -> tuple[list[str], list]:
    """(problems, [(buffer, source tensor)]) for ``given`` against the module's buffers
    (``strict``: every persistent one, the ones a state holds, must be given)."""
    from ftrain.state.init import _is_persistent

    by_name = dict(module.named_buffers())
    problems = [f"not a buffer of the module: {k}" for k in sorted(set(given) - set(by_name))]
    if strict:
        wanted = {n for n in by_name if _is_persistent(module, n)}
        problems += [f"missing buffer: {n}" for n in sorted(wanted - set(given))]
    copies = []
    for name in sorted(set(given) & set(by_name)):
        src, b = given[name], by_name[name]
        if tuple(src.shape) != tuple(b.shape) or src.dtype != b.dtype:
            problems.append(
                f"{name}: given {src.dtype}{tuple(src.shape)}, module {b.dtype}{tuple(b.shape)}"
            )
        else:
            copies.append((b, src))
    return problems, copies


def load_params(module: nn.Module, params, *, buffers=None, strict: bool = True) -> nn.Module:
    """Copy ``params`` (and ``buffers``) into ``module``'s existing tensors in place (ties
    kept).

    Args:
        module: the module to load into; its Parameter objects stay the same.
        params: ``state["params"]`` (a nested TensorDict) or ``{dotted name: tensor}``.
            A tied Parameter may be given under any of its names, or under several with
            equal values (``TensorDict.from_module`` lists every alias).
        buffers: ``state["buffers"]`` (a BatchNorm's running statistics: without them the
            module computes with its initial ones), or ``None`` to leave buffers as they are.
        strict: every Parameter (and, with ``buffers``, every persistent buffer) must be
            given (``False``: the others keep their values).

    Returns:
        ``module``.

    Raises:
        ValueError: names the module lacks, missing ones (``strict``), a shape or dtype
            that differs (never cast silently), or aliases given different values. Nothing
            is copied then.

    Example:
        >>> import torch, ftrain
        >>> m = torch.nn.Linear(2, 1)
        >>> state = ftrain.init_state(m, ftrain.optim.sgd(0.1), seed=0)
        >>> w = m.weight
        >>> load_params(m, state["params"].apply(torch.zeros_like)).weight is w
        True
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> s = ftrain.init_state(bn, ftrain.optim.sgd(0.1), seed=0)
        >>> stats = s["buffers"].apply(lambda t: t + 1)
        >>> float(load_params(bn, s["params"], buffers=stats).running_var[0])
        2.0
    """
    problems, copies = _problems(module, _flat(params), strict)
    if buffers is not None:
        more, buffer_copies = _buffer_problems(module, _flat(buffers), strict)
        problems, copies = problems + more, copies + buffer_copies
    if problems:
        shown = "; ".join(problems[:6]) + (
            f"; ... ({len(problems)} in all)" if len(problems) > 6 else ""
        )
        raise ValueError(f"load_params: the params do not fit {type(module).__name__}: {shown}")
    with torch.no_grad():
        for p, src in copies:
            p.copy_(src)
    return module
