"""Parameter groups: ``multi_transform`` (optax's), ``frozen`` (optax's ``set_to_zero``).

Fine-tuning trains part of a model: a new head at a higher learning rate, the last blocks,
LoRA adapters over a frozen base. ``multi_transform`` gives each *label* its own transform,
each leaf one label::

    from ftrain.optim import adamw, frozen, masks, multi_transform
    tx = multi_transform(
        {"body": adamw(1e-4), "head": adamw(1e-3), "frozen": frozen()},
        {"frozen": masks.glob("transformer.h.[0-5].*"), "head": masks.glob("lm_head.*"),
         "body": None},
    )

Leaves labelled with :func:`frozen` get **no gradient** (the step does not differentiate
them: less backward work and memory), **no optimizer state**, and are carried into the
next state as the same tensor objects (so incremental checkpoints link them instead of
writing them again). Numerics per label are those of the label's transform on its leaves;
on the same gradients they equal optax's ``multi_transform``.

One difference from optax on purpose: gradient processing that spans the tree
(``clip_by_global_norm`` before a ``multi_transform``) sees the trainable leaves only, as
``torch.nn.utils.clip_grad_norm_`` sees only parameters with ``requires_grad``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import torch
from tensordict import TensorDictBase

from ftrain.optim import masks as _masks
from ftrain.optim.base import (
    GradientTransformation,
    Path,
    Trainable,
    empty_state,
    flat_update,
    flatten,
    frozen_indices,
    make_transform,
    member_state,
    new_td,
    path_str,
    per_structure,
    pick,
    refreshing_members,
    trainable_only,
    unflatten,
    with_zeros,
)
from ftrain.optim.bucketed import (
    Body,
    Source,
    applies,
    applying,
    call_body,
    hands_on,
    leafwise,
    owning,
    prepare_of,
)

__all__ = ["frozen", "learning_rates", "multi_transform"]

# a label keys the optimizer state, hence a checkpoint group: a plain name
_LABEL_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]*")

Labels = Callable[[str, torch.Tensor], str] | Mapping[str, "_masks.Mask | None"]


def _all(keys: list[Path], leaves: list[torch.Tensor]) -> list[int]:
    return list(range(len(keys)))


def frozen() -> GradientTransformation:
    """No update and no state for its leaves (optax ``set_to_zero``); the step skips them.

    As a label's transform in :func:`multi_transform` it freezes that label's leaves: they
    are not differentiated and are carried into the next state unchanged (the same tensor
    objects). Called directly on updates it returns zeros.

    Returns:
        A stateless :class:`GradientTransformation` named ``frozen``.

    Example:
        >>> from ftrain.optim import adamw, frozen, masks, multi_transform
        >>> tx = multi_transform({"train": adamw(1e-3), "frozen": frozen()},
        ...                      {"frozen": masks.glob("wte.*"), "train": None})
    """

    def flat(keys, u, state, params, owned=False):  # fresh zeros either way
        return [torch.zeros_like(t) for t in u], empty_state()

    return make_transform(
        "frozen", lambda params: empty_state(), flat, _all, prepare=leafwise(flat, "frozen")
    )


def _check_transforms(transforms: Mapping[str, GradientTransformation]) -> None:
    if not isinstance(transforms, Mapping) or not transforms:
        raise ValueError(
            f"multi_transform needs a non-empty dict label -> transform, got {transforms!r}"
        )
    for label, tx in transforms.items():
        if not isinstance(label, str) or not _LABEL_RE.fullmatch(label):
            raise ValueError(
                f"multi_transform label {label!r} must be a plain name (letters, digits, "
                "'_', '-'): it keys the optimizer state"
            )
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"multi_transform transform for {label!r} must be a GradientTransformation, "
                f"got {type(tx).__name__}"
            )


def _labeller(labels: Labels, known: list[str]) -> Callable[[str, torch.Tensor], str]:
    """``labels`` as one function ``(path, tensor) -> label``, checked against ``known``."""
    if callable(labels) and not isinstance(labels, Mapping | TensorDictBase):
        fn = labels
    elif isinstance(labels, Mapping):
        order = [(label, _masks.to_predicate(mask)) for label, mask in labels.items()]
        unknown = sorted(str(label) for label, _ in order if label not in known)
        if unknown:
            raise ValueError(
                f"multi_transform labels {unknown} have no transform; transforms: {known}"
            )

        def fn(path: str, tensor: torch.Tensor) -> str:
            for label, predicate in order:  # the first matching label wins
                if predicate is None or predicate(path, tensor):
                    return label
            raise ValueError(
                f"multi_transform: parameter {path!r} matches no label's mask "
                f"({[label for label, _ in order]}); add a catch-all label with mask None"
            )
    else:
        raise TypeError(
            "multi_transform labels must be a function (path, tensor) -> label or a dict "
            f"label -> mask, got {labels!r}"
        )

    def checked(path: str, tensor: torch.Tensor) -> str:
        label = fn(path, tensor)
        if label not in known:
            raise ValueError(
                f"multi_transform: parameter {path!r} got label {label!r}, which has no "
                f"transform; transforms: {known}"
            )
        return label

    return checked


class _Groups:
    """Leaf indices of each label for a key list, cached per structure."""

    def __init__(self, labeller: Callable[[str, torch.Tensor], str], labels: list[str]) -> None:
        self.labeller, self.labels = labeller, labels
        self.cache: dict[tuple[Path, ...], dict[str, list[int]]] = {}

    def of(self, keys: list[Path], leaves: list[torch.Tensor]) -> dict[str, list[int]]:
        return per_structure(self.cache, tuple(keys), lambda: self._label(keys, leaves))

    def _label(self, keys: list[Path], leaves: list[torch.Tensor]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {label: [] for label in self.labels}
        for i, (k, t) in enumerate(zip(keys, leaves, strict=True)):
            groups[self.labeller(path_str(k), t)].append(i)
        return groups


def multi_transform(
    transforms: Mapping[str, GradientTransformation], labels: Labels
) -> GradientTransformation:
    """A transform per label; every leaf gets exactly one label (optax ``multi_transform``).

    Args:
        transforms: ``{label: transform}``; :func:`frozen` freezes a label's leaves.
        labels: which label each leaf gets: a function ``(path, tensor) -> label`` over the
            dotted parameter path, or a dict ``{label: mask}`` (masks as in
            :mod:`ftrain.optim.masks`, e.g. ``masks.glob("lm_head.*")``; ``None`` selects
            every leaf) where the first label whose mask selects a leaf wins. Resolved once
            per parameter structure: it must depend on paths, shapes and dtypes only.

    Returns:
        A :class:`GradientTransformation` named ``multi_transform``; its state is
        ``{label: that label's transform state over its leaves}`` (empty for frozen ones).
        Learning rates per label: :func:`learning_rates`.

    Raises:
        ValueError: an empty ``transforms``, a label without a transform, a leaf that no
            mask selects (at ``init``/``update``).
        TypeError: a transform that is not a GradientTransformation.

    Example:
        >>> from ftrain.optim import adamw, masks, multi_transform
        >>> tx = multi_transform({"head": adamw(1e-3), "body": adamw(1e-4)},
        ...                      {"head": masks.glob("lm_head.*"), "body": None})
    """
    _check_transforms(transforms)
    names = list(transforms)
    groups = _Groups(_labeller(labels, names), names)
    members = [(label, transforms[label], flat_update(transforms[label])) for label in names]

    def frozen_of(keys: list[Path], leaves: list[torch.Tensor]) -> list[int]:
        out: list[int] = []
        for label, tx, _ in members:
            idx = groups.of(keys, leaves)[label]
            out += [idx[j] for j in frozen_indices(tx, pick(idx, keys), pick(idx, leaves))]
        return sorted(out)

    trainable = Trainable(frozen_of if any(_may_freeze(tx) for tx in transforms.values()) else None)

    def init(params: TensorDictBase) -> TensorDictBase:
        keys, leaves = flatten(params)
        states = {}
        for label, tx, _ in members:
            idx = groups.of(keys, leaves)[label]
            sub = unflatten(pick(idx, keys), pick(idx, leaves), device=params.device)
            states[label] = tx.init(sub)
        return new_td(states)

    def run(keys, u, state, params):
        out: list = [None] * len(keys)
        states = {}
        for label, _, fn in members:
            idx = groups.of(keys, params if params is not None else u)[label]
            sub_out, states[label] = fn(
                pick(idx, keys),
                pick(idx, u),
                member_state(state, label, "multi_transform"),
                pick(idx, params),
            )
            for i, v in zip(idx, sub_out, strict=True):
                out[i] = v
        return out, new_td(states)

    def flat(keys, u, state, params):
        keep = trainable.indices(keys, params if params is not None else u)
        if keep is None:
            return run(keys, u, state, params)
        # frozen leaves passed in (a caller with the whole tree): zeros, their label's
        # transform never sees them, exactly as when the step leaves them out
        out, new_state = run(pick(keep, keys), pick(keep, u), state, pick(keep, params))
        return with_zeros(u, keep, out), new_state

    preps = [(label, prepare_of(tx)) for label, tx, _ in members]
    prepare = None
    if all(p is not None for _, p in preps):

        def prepare(src: Source, state: TensorDictBase) -> Body:
            trainable_only(trainable, src, "multi_transform")
            return _bucketed_groups(src, state, groups.of(src.keys, src.params), preps)

        if any(applies(p) for _, p in preps):
            applying(prepare)

    refresh = refreshing_members([(label, tx) for label, tx, _ in members], "multi_transform")
    return make_transform("multi_transform", init, flat, trainable.frozen_of, prepare, refresh)


def _bucketed_groups(src: Source, state: TensorDictBase, groups: dict, preps) -> Body:
    """``multi_transform``'s bucketed form: each label's transform prepared on its own
    leaves (its globals, e.g. a clip inside the label, over that label only)."""
    label_of, local = [0] * len(src.keys), [0] * len(src.keys)
    bodies = []
    for n, (label, prep) in enumerate(preps):
        idx = groups[label]
        for j, i in enumerate(idx):
            label_of[i], local[i] = n, j
        bodies.append((label, prep(src.part(idx), member_state(state, label, "multi_transform"))))

    def body(idx, u, params, owned=False, donated=False, apply=False):
        out: list = [None] * len(idx)
        states = {}
        for n, (label, member) in enumerate(bodies):
            sel = [j for j, i in enumerate(idx) if label_of[i] == n]
            local_idx = [local[idx[j]] for j in sel]  # each label owns its part of u
            sub, states[label] = call_body(
                member, local_idx, pick(sel, u), pick(sel, params), owned, donated, apply
            )
            for j, v in zip(sel, sub, strict=True):
                out[j] = v
        return out, new_td(states)

    # its output holds every label's: handed on owned only if each label's is
    out = owning(body, hands_on=all(hands_on(member) for _, member in bodies))
    # applied when a label can apply itself (the others' updates are added per label)
    return applying(out) if any(applies(member) for _, member in bodies) else out


def _may_freeze(tx: GradientTransformation) -> bool:
    return getattr(tx.update, "frozen_of", None) is not None


def learning_rates(opt: TensorDictBase) -> dict[str, torch.Tensor]:
    """Every ``learning_rate`` entry of an optimizer state, by dotted path.

    With one optimizer this is one entry; with :func:`multi_transform` one per label that
    has a learning rate (``{"multi_transform.head....learning_rate": ...}``).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from ftrain.optim import adamw, learning_rates
        >>> list(learning_rates(adamw(1e-3).init(TensorDict({"w": torch.ones(2)}))))
        ['scale_by_learning_rate.learning_rate']
    """
    return learning_rates_in(*flatten(opt))


def learning_rates_in(keys: Sequence[Path], leaves: Sequence[torch.Tensor]) -> dict:
    """:func:`learning_rates` of an optimizer state already flattened (the step walks its
    state once and reads everything it needs from that walk)."""
    return {path_str(k): t for k, t in zip(keys, leaves, strict=True) if k[-1] == "learning_rate"}
