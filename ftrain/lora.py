"""LoRA: low-rank adapters on a model's ``nn.Linear`` layers (Hu et al. 2021).

``apply_lora(model, rank=8, alpha=16, targets=("c_attn", "c_proj"), generator=g)`` replaces
each targeted ``nn.Linear`` by a :class:`LoRALinear` that computes
``x W^T + b + (alpha / rank) * (x A^T) B^T`` with ``A: [rank, in]`` and ``B: [out, rank]``.
The base ``weight``/``bias`` keep their names (``transformer.h.0.attn.c_attn.weight``), so
a base model's checkpoint loads into the adapted one as it is (``init.from``); the
adapters are ``....c_attn.lora_A`` / ``....c_attn.lora_B``.

Initialisation as in the paper and its reference code (loralib, peft): ``B = 0``, so the
adapted model at step 0 computes exactly the base model; ``A`` is Kaiming-uniform
(``a=sqrt(5)``, torch's ``nn.Linear`` default), drawn from the explicit ``generator``.

Train only the adapters by freezing everything else in the optimizer::

    tx = optim.multi_transform({"lora": optim.adamw(1e-3), "frozen": optim.frozen()},
                               {"lora": ftrain.lora.is_adapter, "frozen": None})

:func:`merge` folds trained adapters into the base weights (``W + (alpha/rank) B A``) and
drops them: the result has the plain model's parameter names (``python -m ftrain.ckpt
export ... --merge-lora``).
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from collections.abc import Sequence

import torch
from tensordict import TensorDictBase
from torch import nn
from torch.nn import functional as F

from ftrain.nn import Dropout
from ftrain.state.tree import flatten, path_str, unflatten

__all__ = ["ADAPTER_NAMES", "LoRALinear", "apply_lora", "is_adapter", "merge"]

ADAPTER_NAMES = ("lora_A", "lora_B")


class LoRALinear(nn.Module):
    """An ``nn.Linear`` plus a low-rank update; holds the base layer's own parameters.

    Args:
        base: the layer to adapt; its ``weight`` and ``bias`` Parameters are reused (same
            objects, same names).
        rank: adapter rank ``r`` (positive).
        alpha: scaling numerator; the update is scaled by ``alpha / rank``.
        generator: draws ``A`` (ftrain never uses the global RNG).
        dropout: keyed dropout on the adapter's input (:class:`ftrain.nn.Dropout`).
    """

    def __init__(
        self,
        base: nn.Linear,
        rank: int,
        alpha: float,
        generator: torch.Generator,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.weight = base.weight
        self.bias = base.bias
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **like))
        self.dropout = Dropout(dropout)
        _kaiming_uniform(self.lora_A, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low_rank = F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + low_rank * self.scaling

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, rank={self.rank}, alpha={self.alpha}"
        )


@torch.no_grad()
def _kaiming_uniform(t: torch.Tensor, generator: torch.Generator) -> None:
    """``nn.init.kaiming_uniform_(t, a=sqrt(5))`` (U(-1/sqrt(fan_in), 1/sqrt(fan_in))),
    drawn in float32 on the generator's device, so one key gives the same A anywhere."""
    bound = 1.0 / math.sqrt(t.shape[1])
    w = torch.empty(t.shape, dtype=torch.float32, device=generator.device)
    t.copy_(w.uniform_(-bound, bound, generator=generator))


def _check(rank: int, alpha: float, targets: Sequence[str], dropout: float) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be a positive int, got rank={rank!r}")
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float)
        or not (math.isfinite(alpha) and alpha > 0)  # inf: B = 0 times inf is NaN
    ):
        raise ValueError(f"LoRA alpha must be a finite positive number, got alpha={alpha!r}")
    if (
        isinstance(targets, str)
        or not targets
        or not all(isinstance(t, str) and t for t in targets)
    ):
        raise ValueError(
            f"LoRA targets must be a non-empty list of module names, got targets={targets!r}"
        )
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ValueError(f"LoRA dropout must be a number in [0, 1), got dropout={dropout!r}")


def _is_glob(target: str) -> bool:
    return any(c in target for c in ".*?[")


def _chosen(model: nn.Module, targets: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The modules to adapt. A plain target names modules by their last component
    (``c_proj``: both attention and MLP projections, as peft's ``target_modules``) and
    every one must be an ``nn.Linear``; a target with ``.``/``*`` is a glob over full module
    paths (``transformer.h.*.attn.*``) that picks the ``nn.Linear`` layers it matches."""
    names = [t for t in targets if not _is_glob(t)]
    globs = [t for t in targets if _is_glob(t)]
    chosen, wrong, used = [], [], set()
    for n, m in model.named_modules():
        if not n:  # the model itself: nothing to put an adapter in its place ("*" matched it)
            continue
        last = n.rsplit(".", 1)[-1]
        hits = [g for g in globs if isinstance(m, nn.Linear) and fnmatch.fnmatchcase(n, g)]
        used.update(hits + ([last] if last in names else []))
        if last in names and not isinstance(m, nn.Linear):
            wrong.append(f"{n} ({type(m).__name__})")
        elif last in names or hits:
            chosen.append((n, m))
    if wrong:
        raise ValueError(
            f"LoRA targets {list(targets)} name modules that are not nn.Linear: {wrong}"
        )
    unused = [t for t in targets if t not in used]
    if chosen and unused:  # a typo beside a target that matched: adapters on part only
        # a warning, as peft (which needs one target to match): the default targets on a
        # model without c_proj trained before, and must still resume
        warnings.warn(
            f"LoRA targets {unused} match no nn.Linear (the others do), so only "
            f"{sorted({n.rsplit('.', 1)[-1] for n, _ in chosen})} get adapters; the model's "
            f"Linear layers are named {_linear_names(model)}",
            RuntimeWarning,
            stacklevel=3,
        )
    return chosen


def _linear_names(model: nn.Module) -> list[str]:
    return sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    )


def apply_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str],
    generator: torch.Generator,
    dropout: float = 0.0,
) -> list[str]:
    """Replace the targeted ``nn.Linear`` layers of ``model`` by :class:`LoRALinear`, in place.

    Args:
        model: any module.
        rank: adapter rank.
        alpha: the update is scaled by ``alpha / rank``.
        targets: module names (last component, e.g. ``"c_attn"``) or globs over module paths.
        generator: draws every adapter's ``A`` in module order.
        dropout: dropout on the adapters' inputs.

    Returns:
        The dotted paths of the adapted modules, in module order.

    Raises:
        ValueError: bad settings, targets that match no ``nn.Linear`` (one that matches
            none while others do is a ``RuntimeWarning``), or one that names a module that
            is not an ``nn.Linear``.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4))
        >>> apply_lora(m, rank=2, alpha=4, targets=["0"], generator=torch.Generator())
        ['0']
    """
    _check(rank, alpha, targets, dropout)
    if not isinstance(generator, torch.Generator):  # it draws every adapter's A
        raise TypeError(
            f"apply_lora's generator must be a torch.Generator (e.g. "
            f"torch.Generator().manual_seed(0)), got {generator!r}"
        )
    chosen = _chosen(model, targets)
    if not chosen and isinstance(model, nn.Linear):
        raise ValueError(
            "the model itself is an nn.Linear: LoRA replaces sub-modules of a model, so wrap "
            "it first (torch.nn.Sequential(model), target '0')"
        )
    if not chosen:
        raise ValueError(
            f"LoRA targets {list(targets)} match no module; the model's Linear layers are "
            f"named {_linear_names(model)}"
        )
    too_small = [(n, m) for n, m in chosen if rank > min(m.in_features, m.out_features)]
    if too_small:  # a rank past the layer's: more adapter parameters than the layer has
        name, m = too_small[0]
        raise ValueError(
            f"LoRA rank {rank} exceeds {name}'s smallest dimension "
            f"({m.in_features} in, {m.out_features} out): the adapters would hold more "
            f"than the layer they adapt; use a rank <= {min(m.in_features, m.out_features)}"
        )
    for name, module in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, LoRALinear(module, rank, alpha, generator, dropout))
    return [n for n, _ in chosen]


def is_adapter(path: str, tensor: torch.Tensor | None = None) -> bool:
    """Mask predicate: the leaf is a LoRA adapter (``....lora_A`` or ``....lora_B``)."""
    return path.rsplit(".", 1)[-1] in ADAPTER_NAMES


def merge(params: TensorDictBase, scaling: float | dict[str, float]) -> TensorDictBase:
    """Fold adapters into their base weights and drop them: the plain model's params.

    ``W' = W + scaling * (B @ A)``, computed in float32 (float64 for float64 weights) and
    cast back to ``W``'s dtype (bf16 stays bf16).

    Args:
        params: a params tree with ``X.weight``, ``X.lora_A``, ``X.lora_B`` leaves.
        scaling: ``alpha / rank``, one for all layers or ``{module path: scaling}``.

    Returns:
        A new params tree without adapter leaves (other leaves are the same tensors).

    Raises:
        ValueError: an adapter without its partner or base weight, or mismatched shapes.

    Example:
        >>> from tensordict import TensorDict
        >>> p = TensorDict({"l": {"weight": torch.zeros(2, 3), "lora_A": torch.ones(1, 3),
        ...                       "lora_B": torch.ones(2, 1)}}, batch_size=[])
        >>> merge(p, 2.0)["l", "weight"].tolist()
        [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
    """
    keys, leaves = flatten(params)
    table = {path_str(k): t for k, t in zip(keys, leaves, strict=True)}
    modules = sorted({p.rsplit(".", 1)[0] for p in table if is_adapter(p)})
    for m in modules:
        table[f"{m}.weight"] = _merged(
            table, m, scaling if isinstance(scaling, float | int) else scaling[m]
        )
    kept = [(k, table[path_str(k)]) for k in keys if not is_adapter(path_str(k))]
    return unflatten([k for k, _ in kept], [t for _, t in kept], device=params.device)


def _merged(table: dict[str, torch.Tensor], module: str, scaling: float) -> torch.Tensor:
    missing = [f"{module}.{n}" for n in ("weight", *ADAPTER_NAMES) if f"{module}.{n}" not in table]
    if missing == [f"{module}.weight"]:  # nanoGPT's lm_head.weight = wte.weight
        raise ValueError(
            f"cannot merge LoRA adapters of {module!r}: the params hold no {module}.weight; a "
            "weight tied to another parameter is kept once, under the other name, and folding "
            "the adapters into it would change that parameter too: keep the adapters separate "
            "(export without --merge-lora) or put LoRA on layers whose weights are not tied"
        )
    if missing:
        raise ValueError(f"cannot merge LoRA adapters of {module!r}: missing {missing}")
    w, a, b = (table[f"{module}.{n}"] for n in ("weight", *ADAPTER_NAMES))
    if w.ndim != 2 or a.shape != (a.shape[0], w.shape[1]) or b.shape != (w.shape[0], a.shape[0]):
        raise ValueError(
            f"cannot merge LoRA adapters of {module!r}: weight {tuple(w.shape)}, "
            f"lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} (need [out,in], [r,in], [out,r])"
        )
    wide = torch.float64 if w.dtype == torch.float64 else torch.float32
    delta = (b.to(wide) @ a.to(wide)) * scaling
    return (w.to(wide) + delta).to(w.dtype)
