"""The step's update-and-apply boundary: ``tx.update`` bucket by bucket, results written
straight into the next state — into the donated buffers when the step donates.

Why buckets. Run on the whole tree, a pure ``update`` holds the old and the new optimizer
moments at once plus whole-model lists of updates and temporaries (GPT-2 small donated:
1.64× the imperative loop's peak memory). Here the trainable leaves are cut into buckets of
about :data:`BUCKET_BYTES` of parameters (consecutive in sorted path order), and for each
bucket in turn:

1. its gradients are taken out of the step's list (freed once the bucket is done),
2. ``tx``'s bucketed body computes its updates and new optimizer entries
   (:mod:`ftrain.optim.bucketed`; the global quantities — clip norm, loss-scale skip —
   were fixed over all buckets before the first),
   — given the gradients as *owned* when each is a tensor of its own, so clipping,
   weight decay and the learning rate write into them instead of allocating,
3. donated: the new per-leaf optimizer entries are copied into the old buffers and the
   updates added to the parameters in place; pure: they become the new state's tensors,
   and the input state is not touched.

So the donated step's extra memory is about one bucket plus the gradients not yet used,
and the pure step never holds the whole-model updates list. The results are bit for bit
those of the whole-tree update (tested): every kernel is per leaf, reductions are over
per-leaf partials.

A ``tx`` that is not bucketable (a user transform with a plain ``update``) runs on the whole
tree as before, and donation then only adds the updates in place.

A ``tx`` whose bucketed form *applies* its updates (``adamw(fused=True)``, and chains
ending in it: :func:`ftrain.optim.bucketed.applying`) returns each bucket's new parameters
itself — one fused pass over parameter, gradient and moments — and the step only collects
them; with ``BUCKET_BYTES = None`` it runs as one bucket.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from ftrain.optim.base import FlatFn, pick
from ftrain.optim.bucketed import Prepare, Source, applies, call_body, sole_owners
from ftrain.state.tree import Key, Structure, entries, flatten, is_node, rebuild, structure

__all__ = ["BUCKET_BYTES", "spans_of", "update_and_apply"]

# Parameter bytes per bucket: the donated step's peak overhead is a few times this (the
# bucket's updates and Adam's temporaries); one leaf larger than it is a bucket alone.
# None runs every update on the whole tree (the reference the bucketed path is tested on).
BUCKET_BYTES: int | None = 16 * 2**20

Leaves = list[torch.Tensor]


def spans_of(params: Leaves, bucket_bytes: int) -> list[list[int]]:
    """Consecutive positions of ``params`` cut into buckets of about ``bucket_bytes``.

    Example:
        >>> spans_of([torch.zeros(4), torch.zeros(4), torch.zeros(8)], 32)
        [[0, 1], [2]]
    """
    spans: list[list[int]] = [[]]
    size = 0
    for i, p in enumerate(params):
        if spans[-1] and size + p.numel() * p.element_size() > bucket_bytes:
            spans.append([])
            size = 0
        spans[-1].append(i)
        size += p.numel() * p.element_size()
    return [s for s in spans if s]


def update_and_apply(
    update: FlatFn,
    prepare: Prepare | None,
    keys: list[Key],
    grads: list,
    opt: TensorDictBase,
    params: Leaves,
    in_place: bool,
    opt_flat: tuple[Structure, Leaves] | None = None,
) -> tuple[Leaves, TensorDictBase]:
    """``params + tx.update(grads)``, bucket by bucket when ``prepare`` allows it.

    Args:
        update: ``tx``'s flat update (the whole-tree path).
        prepare: ``tx``'s bucketed form, or None (not bucketable).
        keys: the trainable leaves' paths; ``params`` their tensors.
        grads: their gradients; **consumed**: the bucketed path sets each entry to None
            once its bucket is done, so the gradients are freed as they are used.
        opt: the optimizer state.
        in_place: donate: write into ``params`` and ``opt``'s buffers.
        opt_flat: ``structure(opt)`` when the caller has it (one walk of the state less).

    Returns:
        ``(new_params, new_opt)``.
    """
    applied = prepare is not None and applies(prepare)  # tx writes the new params itself
    if prepare is None or (BUCKET_BYTES is None and not applied):
        updates, new_opt = update(keys, grads, opt, params)
        return _apply(params, updates, in_place), new_opt
    spans = spans_of(params, BUCKET_BYTES) if BUCKET_BYTES else [list(range(len(params)))]
    body = prepare(Source.of(keys, grads, params, spans), opt)
    # one bucket, and an input state whose nodes are all locked (so "no locked node" in a
    # bucket state means no node shared with it): the bucket's state may be taken as it is
    whole = len(spans) == 1 and opt.is_locked
    writer = _StateWriter(opt_flat or structure(opt), in_place, like=opt if whole else None)
    if applied:
        return _applied_buckets(body, spans, grads, writer, params, in_place)
    held = {id(t) for t in params} | {id(t) for t in writer.old.values()}
    new = list(params)
    for span, g, owned in _buckets(spans, grads, params, writer):
        ps = pick(span, params)
        u, bucket_state = call_body(body, span, g, ps, owned, donated=in_place)
        del g
        if in_place:
            u = _unaliased(u, ps + writer.targets(bucket_state))
            writer.write(bucket_state)
            out = _apply(ps, u, True)
        else:
            writer.take(bucket_state)
            out = _add_into_updates(ps, u, held | {id(t) for t in flatten(bucket_state)[1]})
        for i, t in zip(span, out, strict=True):
            new[i] = t
        del u, bucket_state, out
    return new, writer.state()


def _applied_buckets(body, spans, grads: list, writer, params: Leaves, in_place: bool):
    """The buckets of an applying ``tx`` (``adamw(fused=True)``): its body returns each
    bucket's new parameters (written into ``params`` when donating) and its state."""
    new = list(params)
    for span, g, owned in _buckets(spans, grads, params, writer):
        out, bucket_state = call_body(
            body, span, g, pick(span, params), owned, donated=in_place, apply=True
        )
        del g
        (writer.write if in_place else writer.take)(bucket_state)
        for i, t in zip(span, out, strict=True):
            new[i] = t
        del out, bucket_state
    return new, writer.state()


def _buckets(spans, grads: list, params: Leaves, writer: _StateWriter):
    """``(span, its gradients, owned)`` per bucket; each bucket's entries of ``grads`` are
    set to None as it is handed out, so the gradients die with the bucket. ``owned``: the
    step's own gradients, which tx may write into (no allocating pass)."""
    storages = {t.untyped_storage().data_ptr() for t in (*params, *writer.old.values())}
    for span in spans:
        g = pick(span, grads)
        for i in span:
            grads[i] = None
        yield span, g, sole_owners(g, storages)
        del g


def _apply(params: Leaves, updates: Leaves, in_place: bool) -> Leaves:
    """``params + updates``: the donation boundary (in place only when donating)."""
    if in_place:
        torch._foreach_add_(params, updates)
        return params
    return torch._foreach_add(params, updates)


def _add_into_updates(params: Leaves, updates: Leaves, held: set[int]) -> Leaves:
    """``params + updates`` out of place, written into the update tensors themselves where
    they are the step's own temporaries: the pure step then allocates no new parameters
    (the buffers the step owns are reused; the input state is not touched).

    An update is overwritten only if it is no parameter or optimizer entry (``held``), owns
    its storage with the parameter's layout, and is not returned for another leaf too.
    ``u + p`` is ``p + u`` bit for bit (IEEE addition commutes).
    """
    scratch, rest = [], []
    for i, (p, u) in enumerate(zip(params, updates, strict=True)):
        (scratch if _scratch(p, u, held) else rest).append(i)
    out = list(updates)
    if rest:  # first: they may read a tensor that a scratch leaf overwrites below
        summed = torch._foreach_add(pick(rest, params), pick(rest, updates))
        for i, t in zip(rest, summed, strict=True):
            out[i] = t
    if scratch:
        torch._foreach_add_(pick(scratch, updates), pick(scratch, params))
    return out


def _scratch(p: torch.Tensor, u: torch.Tensor, held: set[int]) -> bool:
    if id(u) in held:
        return False
    held.add(id(u))  # a tensor returned for two leaves is overwritten for one at most
    same = (u.shape, u.dtype, u.device, u.stride()) == (p.shape, p.dtype, p.device, p.stride())
    return same and u.untyped_storage().nbytes() == u.numel() * u.element_size()


def _unaliased(values: Leaves, targets: Leaves) -> Leaves:
    """``values``, each one that *is* a tensor about to be written in place cloned first:
    written, it would change under the writes that still read it (pure transforms may
    return their inputs, e.g. the skipped loss scale's old state)."""
    ids = {id(t) for t in targets}
    return [v.clone() if id(v) in ids else v for v in values]


class _StateWriter:
    """Collects the buckets' optimizer entries into the new state, by path.

    Donating, a per-leaf entry (``ndim > 0``) is copied into the old state's buffer at the
    same path, each at most once; 0-d entries (counts, rates, the loss scale: the same from
    every bucket) are taken as they come, never written into, so a later bucket still reads
    the old values. The new state has the old one's layout, empty sub-trees included.

    Out of place with one bucket and a locked input state ``like``, a bucket state that
    mirrors it node for node, all of its nodes new (none locked: none is a node of the input
    or an earlier state), *is* the new state: it is kept as it is instead of being rebuilt
    from its leaves (~100 TensorDict nodes for AdamW on GPT-2 tiny's 52 leaves: 0.1-0.25 ms
    a step, ``benchmarks/step_parts.py``), and checked by one walk that builds no paths.
    """

    def __init__(
        self,
        opt_flat: tuple[Structure, Leaves],
        in_place: bool,
        like: TensorDictBase | None = None,
    ) -> None:
        self.layout, leaves = opt_flat
        self.old = dict(zip(self.layout.keys, leaves, strict=True))
        self.new: dict[Key, torch.Tensor] = {}
        self.in_place = in_place
        self.like = None if in_place else like
        self.as_is: TensorDictBase | None = None

    def _entries(self, bucket_state: TensorDictBase) -> list[tuple[Key, torch.Tensor]]:
        layout, leaves = structure(bucket_state)
        unknown = [k for k in layout.keys if k not in self.old]
        if unknown:
            raise ValueError(
                f"the optimizer's bucketed update returned state entries {unknown[:3]} that "
                "its state does not have; a bucketable transform must keep its state's layout"
            )
        return list(zip(layout.keys, leaves, strict=True))

    def _writable(self, key: Key, t: torch.Tensor) -> bool:
        o = self.old[key]
        return (
            self.in_place
            and t is not o
            and o.ndim > 0
            and (o.shape, o.dtype, o.device) == (t.shape, t.dtype, t.device)
        )

    def targets(self, bucket_state: TensorDictBase) -> Leaves:
        """The old buffers :meth:`write` will overwrite for this bucket."""
        return [self.old[k] for k, t in self._entries(bucket_state) if self._writable(k, t)]

    def take(self, bucket_state: TensorDictBase) -> None:
        """Out of place: the entries become the new state's tensors."""
        if self.like is not None and not self.new and _mirrors_fresh(bucket_state, self.like):
            self.as_is = bucket_state
            return
        for key, t in self._entries(bucket_state):
            self.new[key] = t

    def write(self, bucket_state: TensorDictBase) -> None:
        """Donating: copy the per-leaf entries into the old buffers (before the parameters
        are written, so an entry that is a parameter is copied with its old value)."""
        entries = self._entries(bucket_state)
        writes = [(k, t) for k, t in entries if self._writable(k, t)]
        values = _unaliased([t for _, t in writes], [self.old[k] for k, _ in writes])
        for (key, _), value in zip(writes, values, strict=True):
            if key in self.new:
                raise RuntimeError(
                    f"optimizer state entry {'.'.join(key)!r} came from two buckets; a "
                    "bucketable transform's entries that are not per leaf must be 0-d"
                )
            self.old[key].copy_(value)
            self.new[key] = self.old[key]
        for key, t in entries:
            self.new.setdefault(key, t)

    def state(self) -> TensorDictBase:
        if self.as_is is not None:
            return self.as_is
        missing = [k for k in self.layout.keys if k not in self.new]
        if missing:
            raise ValueError(
                f"the optimizer's bucketed update left out state entries {missing[:3]}; a "
                "bucketable transform must return every entry of its state"
            )
        return rebuild(self.layout, [self.new[k] for k in self.layout.keys])


def _mirrors_fresh(new: TensorDictBase, old: TensorDictBase) -> bool:
    """``new`` has ``old``'s keys at every node (the same layout, empty sub-trees included)
    and no node of it is locked, so none belongs to an earlier (locked) state: locking the
    next state then locks only its own nodes."""
    if new.is_locked:
        return False
    mine, theirs = entries(new), entries(old)
    if mine.keys() != theirs.keys():
        return False
    for k, v in mine.items():
        node = is_node(v)
        if node != is_node(theirs[k]) or (node and not _mirrors_fresh(v, theirs[k])):
            return False
    return True
