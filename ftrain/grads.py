"""Gradients of the loss with respect to the state's leaves: forward + backward over a
step's micro-batches, with the module used only as a function.

The state's leaves are bound into the module's parameter and buffer slots for the call
(:class:`_Binder`, or ``torch.func.functional_call`` where the slots are not plain), under
``torch.autocast`` when the step runs in bf16/fp16 and with the step's own dropout
generator; gradients come from ``torch.autograd.grad`` on detached leaves, so nothing is
accumulated into ``.grad`` and the module's own tensors are never touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import torch
from tensordict import TensorDictBase
from torch import nn
from torch.func import functional_call

from ftrain.nn import use_generator
from ftrain.state.tree import Key

__all__ = [
    "Bound",
    "Grads",
    "LossFn",
    "loss_and_aux",
    "merge_aux",
    "kept_modes",
    "named_leaves",
    "train_mode",
]

LossFn = Callable[[nn.Module, TensorDictBase], "torch.Tensor | tuple[torch.Tensor, Mapping]"]


class Bound(nn.Module):
    """``loss_fn(model, batch)`` as a module, so ``functional_call`` can bind parameters."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: TensorDictBase):
        return self.loss_fn(self.model, batch)


def named_leaves(
    prefix: str, keys: list[Key], leaves: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``{prefix + "a.b": leaf}``: the names ``functional_call`` binds."""
    return {prefix + ".".join(k): t for k, t in zip(keys, leaves, strict=True)}


def loss_and_aux(out) -> tuple[torch.Tensor, Mapping]:
    """``loss_fn``'s result as ``(0-d loss, aux metrics)``; anything else is a TypeError."""
    if isinstance(out, tuple) and len(out) != 2:
        raise TypeError(
            f"loss_fn must return a scalar tensor or (scalar tensor, dict), got a tuple of "
            f"{len(out)}: ({', '.join(type(v).__name__ for v in out)})"
        )
    loss, aux = out if isinstance(out, tuple) else (out, {})
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"loss_fn must return a scalar tensor or (scalar tensor, dict), got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    if not loss.is_floating_point():  # autograd's own error named neither the loss nor a fix
        raise TypeError(
            f"loss_fn's loss is {loss.dtype}: it must be a real floating tensor (float32, "
            "bfloat16, ...) to be differentiated; take the real part or a norm of a complex one"
        )
    if not isinstance(aux, Mapping):
        raise TypeError(
            f"loss_fn's aux metrics must be a dict of name to scalar, got {type(aux).__name__}"
        )
    for name, value in aux.items():
        _check_aux(name, value)
    return loss.reshape(()), aux


def _check_aux(name, value) -> None:
    """An aux metric is one number (it becomes a column of metrics.jsonl): a tensor of
    several elements reached ``.item()`` in the loop, a traceback far from the loss."""
    if not isinstance(name, str):
        raise TypeError(f"loss_fn's aux metric names must be strings, got {name!r}")
    if name in _STEP_METRICS or name.startswith("lr_"):  # the step's own value replaced it
        raise ValueError(
            f"loss_fn's aux metric {name!r} is a name the step reports itself (loss, "
            "grad_norm, lr, lr_<group>): rename it, e.g. 'aux_" + name + "'"
        )
    if name == "samples" and not _a_count(value):  # evaluate() weights batches by it
        raise TypeError(
            f"loss_fn's aux metric 'samples' is the batch's sample count (evaluate weights "
            f"batches by it): it must be a whole number >= 0 or an integer tensor, got {value!r}"
        )
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(
                f"loss_fn's aux metric {name!r} has shape {tuple(value.shape)}: each aux "
                "metric must be one number (reduce it, e.g. .mean(), or log its parts by name)"
            )
    elif not isinstance(value, int | float):  # bool is an int: a flag counts as 0/1
        raise TypeError(
            f"loss_fn's aux metric {name!r} is a {type(value).__name__}: each aux metric "
            "must be a number or a one-element tensor"
        )


_STEP_METRICS = frozenset({"loss", "grad_norm", "lr"})


def _a_count(value) -> bool:
    if isinstance(value, torch.Tensor):  # its value is not read: that would break a compile
        return not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def merge_aux(total: dict[str, torch.Tensor], aux: Mapping, k: int) -> None:
    """Sum integer aux metrics (counts) over micro-batches; average floating ones (float64
    kept: cast to float32, a 1e300 became inf)."""
    for name, value in aux.items():
        v = torch.as_tensor(value).detach().reshape(())
        if v.is_floating_point():
            v = v.to(torch.promote_types(v.dtype, torch.float32)) / k
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


def _differentiated(params: list[torch.Tensor], keep: list[int] | None):
    """``(values, leaves)``: every param as the forward sees it, and the ones differentiated
    (all, or only the trainable indices ``keep``: frozen leaves get no gradient at all)."""
    if keep is None:
        leaves = [p.detach().requires_grad_() for p in params]
        return leaves, leaves
    values = [p.detach() for p in params]
    for i in keep:
        values[i].requires_grad_()
    return values, [values[i] for i in keep]


class Grads:
    """Forward + backward over the micro-batches of one step, accumulating gradients of the
    trainable parameters."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, autocast: torch.dtype | None) -> None:
        self.bound = Bound(model, loss_fn)
        self.binder = _Binder(model)
        self.autocast = autocast

    def __call__(self, pkeys, params, keep, bkeys, buffers, micro, gen, loss_scale):
        values, leaves = _differentiated(params, keep)
        keys, values = pkeys + bkeys, values + buffers
        grads, loss_sum, aux_total = None, None, {}
        k = len(micro)
        with train_mode(self.binder.refresh()):
            fast = all(key in self.binder.slots for key in keys)
            for mb in micro:
                loss, aux = self._forward(keys, values, fast, mb, gen, leaves[0].device)
                scaled = loss / k if loss_scale is None else loss * (loss_scale / k)
                if not scaled.requires_grad:  # torch: "element 0 of tensors does not require grad"
                    raise ValueError(
                        "the loss does not depend on any trained parameter (it has no "
                        "gradient): compute it from the model's output in loss_fn(model, batch), "
                        "not from detached tensors or under torch.no_grad()"
                    )
                g = torch.autograd.grad(scaled, leaves, allow_unused=True)
                g = [
                    torch.zeros_like(t) if gi is None else gi
                    for t, gi in zip(leaves, g, strict=True)
                ]
                grads = g if grads is None else torch._foreach_add(grads, g)
                loss_sum = (
                    loss.detach().float() if loss_sum is None else loss_sum + loss.detach().float()
                )
                merge_aux(aux_total, aux, k)
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
                named = named_leaves("model.", keys, values)
                out = functional_call(self.bound, named, (mb,), tie_weights=True, strict=False)
        return loss_and_aux(out)


@contextlib.contextmanager
def train_mode(modules: tuple[nn.Module, ...]):
    """Train mode for the block (``modules[0]`` is the root, ``modules`` all of its modules),
    then every module's mode as it was.

    A root in train mode runs as the user set it: a submodule put in eval mode (a frozen
    BatchNorm: ``model.train(); model.bn.eval()``) stays so. A root in eval mode (the
    model was last evaluated) trains whole for the step. ``Module.train`` walks every
    submodule (~0.2 ms at GPT-2 tiny size), so nothing is walked while the root trains.
    """
    if modules[0].training:
        yield
        return
    with kept_modes(modules):
        modules[0].train()
        yield


@contextlib.contextmanager
def kept_modes(modules):
    """Every module's ``training`` flag restored on exit (``Module.train(mode)`` on the
    root would set them all alike: a user's frozen submodule was switched back)."""
    modes = [(m, m.training) for m in modules]
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
