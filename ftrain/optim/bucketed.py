"""Bucketed updates: a transform run on a bucket of leaves at a time.

Why. A pure ``update`` over the whole tree allocates whole-model temporaries: the new
moments while the old ones are alive, the updates list, each member's intermediate list.
The step (:mod:`ftrain.apply`) instead runs ``tx`` on one bucket of leaves at a time and
writes that bucket's results into the donated buffers (or into the new state) before the
next, so the extra memory is about one bucket. The transforms stay written once: this
module only adds a way to *call* them per bucket, with every global quantity fixed first.

Protocol. A transform is *bucketable* when its :class:`~ftrain.optim.base.FlatUpdate` has a
``prepare``::

    body = prepare(src, state)           # once per update, src: a Source (below)
    updates_b, state_b = body(idx, updates_b, params_b)   # once per bucket

``body`` returns, for the leaves at positions ``idx`` of ``src.keys``, bit for bit what the
whole-tree ``update`` gives those leaves; ``state_b`` has the layout of the new state with
the per-leaf entries of those leaves only. The contract that makes this exact:

* **Global quantities are computed in ``prepare``**, before any bucket: the global norm of
  ``clip_by_global_norm``, the finiteness check and skip decision of
  ``dynamic_loss_scale``. ``prepare`` reads its input bucket by bucket (``src.read``), so
  it never holds more than one bucket of it; a reduction over per-leaf partials (per-leaf
  norms, then their norm) gives the same bits as over the whole list.
* **Bodies are leafwise**: a leaf's results depend on its own gradient, parameter and
  state entries and on values fixed in ``prepare`` (or the state's 0-d entries) only.
* **State that is not per leaf is 0-d** (counts, the learning rate, the loss scale): every
  bucket computes it from the same old values, so every bucket returns the same new
  value. The step writes per-leaf entries back into the donated buffers and takes 0-d
  entries as new tensors, so no later bucket ever reads an entry already overwritten.

A transform without ``prepare`` (a user's plain ``update``, ``mean_across_ranks``, a
composition with such a member) is not bucketable, and the step runs it on the whole
tree as before. :func:`leafwise` makes ``prepare`` for a flat function that is leafwise
by nature (every built-in optimizer transform).

Owned updates. A body marked :func:`owning` also takes ``owned=True``: the caller gives
up the bucket's ``updates`` (nobody else holds them), so the body may write into them
instead of allocating new ones (clipping, weight decay, the learning rate: on a CPU an
allocating pass over a bucket costs up to ~10x an in-place one, the fresh pages are
faulted in). In-place and out-of-place kernels give the same bits. The step passes its
own gradients as owned when each one is a tensor of its own (:func:`sole_owners`); a
chain passes a member's output on as owned when that member is an owning built-in whose
output holds no input it did not own and never its state's tensors (:func:`handed_on`).
A body that is not marked is never called with ``owned`` and its output is never owned.

Applied updates. A body whose ``prepare`` is marked :func:`applying` also takes
``apply=True``: it then returns the bucket's **new parameters** instead of its updates —
written into ``params`` when ``donated``, new tensors otherwise — so a fused kernel can
read and write each parameter once (``adamw(fused=True)``: torch's fused AdamW, which
also folds the decay, the rate and ``p + u`` into its one pass). Combinators pass
``apply`` on to the member that produces their output (a chain's last, every label of a
``multi_transform``, ``dynamic_loss_scale``'s inner) and apply a member that cannot
(:func:`call_body` adds its updates). The step asks for applied updates whenever the
prepare allows it; the result is then the kernel's, which rounds ``p + tx.update(...)``
in its own order.

Donated state. A donating step (``make_step(donate=True)``) also calls owning bodies with
``donated=True``: the per-leaf entries of the state they were prepared with are its to
overwrite, so ``scale_by_adam`` and ``trace`` update their moments in place, as
``torch.optim`` does, instead of making new ones that the step then copies back. 0-d
entries (counts) are never written: every later bucket still reads the old values.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDictBase

from ftrain.state.tree import Key, flatten, new_td, unflatten

__all__ = [
    "Body",
    "Prepare",
    "Source",
    "add_updates",
    "applies",
    "applying",
    "call_body",
    "handed_on",
    "hands_on",
    "leafwise",
    "mul",
    "owning",
    "owns",
    "prepare_of",
    "sole_owners",
]

Leaves = list[torch.Tensor]
# body(idx, updates, params) -> (updates, state) for the leaves at positions idx; an
# owning body also takes owned=True (it may then write into updates) and donated=True
# (it may write its new per-leaf state into the old one's buffers)
Body = Callable[..., tuple[Leaves, TensorDictBase]]


def _pick(idx: Sequence[int], items):
    return None if items is None else [items[i] for i in idx]


class Source:
    """A transform's input over all leaves, read one bucket at a time.

    Attributes:
        keys: every leaf's path (sorted, as the step passes them).
        params: every leaf's parameter (or None).
        spans: the buckets: lists of positions in ``keys``, in order.
        whole: the whole input list when it exists already (the step's gradients), so a
            reduction can read it without computing anything; None when each bucket's input
            is computed on demand (the output of an earlier chain member).
    """

    __slots__ = ("_read", "keys", "params", "spans", "whole")

    def __init__(self, keys, params, spans, read: Callable[[list[int]], Leaves], whole=None):
        self.keys, self.params, self.spans = keys, params, spans
        self._read, self.whole = read, whole

    @classmethod
    def of(cls, keys: list[Key], updates: Leaves, params: Leaves | None, spans) -> Source:
        """The step's gradients as a source."""
        return cls(keys, params, spans, lambda idx: _pick(idx, updates), updates)

    def read(self, idx: list[int]) -> Leaves:
        """The input at positions ``idx`` (computed now if it is a later member's input)."""
        return self._read(idx)

    def then(self, body: Body) -> Source:
        """The input of the next chain member: ``body``'s updates, computed per read."""
        params = self.params

        def read(idx):
            return body(idx, self.read(idx), _pick(idx, params))[0]

        return Source(self.keys, params, self.spans, read)

    def part(self, idx: list[int]) -> Source:
        """The input of the leaves at ``idx`` alone (a ``multi_transform`` label's)."""
        local = {g: i for i, g in enumerate(idx)}
        spans = [s for s in ([local[g] for g in span if g in local] for span in self.spans) if s]
        return Source(
            _pick(idx, self.keys),
            _pick(idx, self.params),
            spans,
            lambda sub: self.read(_pick(sub, idx)),
            _pick(idx, self.whole),
        )


Prepare = Callable[[Source, TensorDictBase], Body]


def owning(body: Body, hands_on: bool = True) -> Body:
    """Mark ``body`` as taking ``owned=True`` (see the module docstring).

    ``hands_on``: its updates are always new tensors or its own inputs (never its state's,
    never views), so an output that is none of its unowned inputs can be handed on owned.
    """
    body.takes_owned = True  # type: ignore[attr-defined]
    body.hands_on = hands_on  # type: ignore[attr-defined]
    return body


def owns(body: Body) -> bool:
    """Whether ``body`` is marked :func:`owning`."""
    return getattr(body, "takes_owned", False)


def hands_on(body: Body) -> bool:
    """Whether ``body`` is marked :func:`owning` with ``hands_on``."""
    return getattr(body, "hands_on", False)


def applying(fn):
    """Mark a ``prepare`` (and the bodies it makes) as taking ``apply=True`` (see the module
    docstring); returns ``fn``."""
    fn.applies = True  # type: ignore[attr-defined]
    return fn


def applies(fn) -> bool:
    """Whether a ``prepare`` or a body is marked :func:`applying`."""
    return getattr(fn, "applies", False)


def call_body(
    body: Body,
    idx: list[int],
    updates: Leaves,
    params,
    owned: bool,
    donated: bool = False,
    apply: bool = False,
):
    """``body(idx, updates, params)``, with ``owned``/``donated`` only for an owning body.

    ``apply``: return the new parameters instead of the updates: from the body itself when
    it is :func:`applying`, else its updates added here (in place when ``donated``).
    """
    if apply and applies(body):
        return body(idx, updates, params, owned=owned, donated=donated, apply=True)
    if (owned or donated) and owns(body):
        out, state = body(idx, updates, params, owned=owned, donated=donated)
    else:
        out, state = body(idx, updates, params)
    return (add_updates(params, out, donated), state) if apply else (out, state)


def add_updates(params: Leaves, updates: Leaves, in_place: bool) -> Leaves:
    """``params + updates``: written into ``params`` when they are donated (an update that
    *is* a parameter is read before any parameter is written: cloned first)."""
    if not params:
        return params
    if not in_place:
        return torch._foreach_add(params, updates)
    ids = {id(p) for p in params}
    torch._foreach_add_(params, [u.clone() if id(u) in ids else u for u in updates])
    return params


def handed_on(body: Body, out: Leaves, inputs: Leaves, owned: bool) -> bool:
    """Whether ``body``'s output ``out`` may be passed on as owned: a handing-on body's,
    of distinct tensors, none of them an input it did not own."""
    if not hands_on(body) or len({id(t) for t in out}) != len(out):
        return False
    return owned or not {id(t) for t in inputs} & {id(t) for t in out}


def mul(leaves: Leaves, factor, owned: bool) -> Leaves:
    """``leaves * factor``: written into ``leaves`` when the caller gave them up."""
    if not owned:
        return torch._foreach_mul(leaves, factor)
    torch._foreach_mul_(leaves, factor)
    return leaves


def sole_owners(leaves: Leaves, held: set[int]) -> bool:
    """True when every leaf is a dense tensor with a storage of its own (no other leaf's,
    none of ``held``'s storage pointers) that it covers exactly: writing into one changes
    nothing else. Autograd may hand one gradient to two inputs (``(a + b).sum()``), or an
    expanded one with a stride of 0, or a custom backward's saved tensor."""
    seen: set[int] = set()
    for t in leaves:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in held or ptr in seen or not t.is_contiguous():
            return False
        if storage.nbytes() != t.numel() * t.element_size() or not ptr:
            return False
        seen.add(ptr)
    return True


def prepare_of(tx) -> Prepare | None:
    """``tx``'s ``prepare`` (None: not bucketable, run it on the whole tree)."""
    return getattr(tx.update, "prepare", None)


def leafwise(
    flat, name: str, per_leaf: tuple[str, ...] = (), aliases_state: bool = False
) -> Prepare:
    """``prepare`` for a flat function that is leafwise: ``body`` calls ``flat`` itself on
    the bucket's leaves and on the bucket's slice of the state.

    Args:
        flat: the transform's flat update (its only implementation); if it takes an
            ``owned`` keyword (it may then write into its updates), the body is owning,
            and a ``donated`` keyword (it may write its per-leaf state in place) is passed
            when the step donates.
        name: the transform's name, for errors.
        per_leaf: the state entries that are trees shaped like the params (``("mu", "nu")``
            of ``scale_by_adam``); every other entry is passed whole (0-d by the contract).
        aliases_state: ``flat`` may return its new state's tensors as its updates
            (``trace``): its body takes ``owned``, its output is never handed on owned.
    """

    def prepare(src: Source, state: TensorDictBase) -> Body:
        stored = {entry: flatten(state[entry]) for entry in per_leaf}
        for entry, (skeys, _) in stored.items():
            if len(skeys) != len(src.keys):
                raise ValueError(
                    f"{name} state {entry!r} has {len(skeys)} leaves for {len(src.keys)} "
                    "updates; build the state with init(params) from the same parameter tree"
                )
        keys = src.keys

        def body(idx, u, params, owned=False, donated=False):
            sub = state  # a bucket of every leaf (a small model) needs no slice
            if stored and len(idx) != len(keys):  # flat checks the slice's paths
                sliced = {
                    entry: unflatten(_pick(idx, sk), _pick(idx, sl), device=state[entry].device)
                    for entry, (sk, sl) in stored.items()
                }
                sub = new_td({k: state[k] for k in state.keys()} | sliced)
            given = {"owned": owned, "donated": donated}
            flags = {k: True for k in takes if given[k]}  # only what flat knows
            return flat(_pick(idx, keys), u, sub, params, **flags)

        return owning(body, hands_on=not aliases_state) if "owned" in takes else body

    takes = {"owned", "donated"} & set(inspect.signature(flat).parameters)
    return prepare
