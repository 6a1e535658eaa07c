"""Spare buffers for the pure step's new state: the state two steps back, reused once
nothing holds it any more.

Why. A pure step must leave its input state intact, so it writes the new parameters and
moments into fresh memory: on a CPU that is one ``clone`` per leaf per step (156 for
AdamW on GPT-2 tiny), freed again when the caller drops the old state. Those frees and
allocations of mixed sizes are what fragments glibc's heap (a pure GPT-2 small step
peaked at 1.24-1.26x the imperative loop where the live tensors alone need 1.16x) and
what makes each step fault fresh pages in (5,000-8,600 minor faults a step on MLP 6x1024).

What. The fused AdamW writer (:mod:`ftrain.optim.fused`) asks a :class:`BufferPool` for
each bucket's copies. The pool keeps, per bucket and kind (params, ``mu``, ``nu``), the
flat buffers it made, each with the leaf views cut from it. In a loop
``state = step(state, batch)`` the state of step ``k - 1`` is dropped while step ``k``
runs, so step ``k + 1`` finds its buffers free and copies into them: no allocation, no
fresh pages, one spare state in memory (which the pure step needs at its peak anyway).

When is a buffer free. Only when nothing but the pool refers to it, checked on the
counts PyTorch and Python keep, never assumed: the storage's use count (every tensor
that views it, from any code, holds one), each view's ``TensorImpl`` use count (autograd's
saved tensors, C++ holders) and each view's Python reference count (a dict, a list, a
TensorDict, a numpy array made from it). A state kept by the caller, pinned by an async
checkpoint save or held in one leaf is never written, nor one in shared memory (a leaf
sent to another process through ``torch.multiprocessing``: the holders there are not
counted here); the pool then makes a new buffer and forgets its oldest. Writing into a reused view bumps its version counter, so caches
keyed on a tensor's identity and version (the incremental save's, the gradient norm's)
see a new value.

Scope. CPU leaves of one dtype, contiguous (CUDA's caching allocator already reuses
memory, and a side stream may still read a freed block); any other bucket gets plain
clones. Copies are made eagerly, never inside a ``torch.compile`` trace; the compiled step
asks for :meth:`BufferPool.destinations` instead and writes them inside its graph. :func:`release_buffers` hands the spare memory back,
e.g. after training, when the state is dropped but the optimizer lives on.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Hashable

import torch
from torch._utils import _unflatten_dense_tensors

__all__ = ["BufferPool", "clones", "poolable", "release_buffers", "unpooled"]

Leaves = list[torch.Tensor]

_POOLS: weakref.WeakSet[BufferPool] = weakref.WeakSet()

# False: every pool makes plain clones (the behaviour before pooling; the benchmark's
# ``pure_fused_clones`` variant, and a switch to rule the pool out when chasing a bug)
POOLING = True

# Bytes of buffers one pool may keep (two copies of the state): a larger state gets plain
# clones (the caller asks :meth:`BufferPool.admits` once for the whole state).
# The spare copy is resident all through the next forward and backward, where clones are
# made bucket by bucket into memory the gradients just freed: pooling a state of S bytes
# adds up to S/3 (its parameters' size) to the step's peak. Below a few hundred MiB that
# buys the step's speed for memory nobody misses (GPT-2 tiny: 2.5 MB; MLP 6x1024: 75 MB,
# 1.036x -> 0.981x the imperative loop); GPT-2 small's 984 MB state would peak at 1.36x the
# imperative loop instead of 1.24x, so it gets clones (docs/benchmarks.md).
POOL_BYTES = 256 * 2**20


def _only_in_a_list(views: Leaves) -> bool:
    """No view has a holder beyond the pool's list: a C++ holder (autograd's saved tensors;
    torch 2.13 also gives it a Python reference, checked as well rather than relied on) or
    a Python one (calibrated below: the count this very expression sees)."""
    return all(v._use_count() == 1 and sys.getrefcount(v) == _ALONE for v in views)


def _refcount_here(views: Leaves) -> int:
    return next(sys.getrefcount(v) for v in views)  # a generator frame, like the one above


_ALONE = _refcount_here([torch.empty(0)])


class _Buffer:
    """One flat buffer and the leaf views cut from it, in the leaves' order."""

    __slots__ = ("dtype", "flat", "nbytes", "shapes", "views")

    def __init__(self, leaves: Leaves, copy: bool = True) -> None:
        # not _flatten_dense_tensors: of a single tensor it returns a view, not a copy
        first = leaves[0]
        size = sum(t.numel() for t in leaves)
        self.flat = torch.empty(size, dtype=first.dtype, device=first.device)
        self.views: Leaves = list(_unflatten_dense_tensors(self.flat, leaves))
        if copy:
            torch._foreach_copy_(self.views, leaves)
        self.nbytes = size * first.element_size()
        self.shapes = [t.shape for t in leaves]
        self.dtype = first.dtype

    def free(self) -> bool:
        """Nothing outside the pool refers to the buffer or to any of its views."""
        # every tensor that views the storage, from any code, holds it: here self.flat, the
        # pool's views and the temporary storage object made for the call
        if self.flat.is_shared():  # sent to another process, whose holders no count shows
            return False
        holders = torch._C._storage_Use_Count(self.flat.untyped_storage()._cdata)
        return holders == len(self.views) + 2 and _only_in_a_list(self.views)

    def fits(self, leaves: Leaves) -> bool:
        """``leaves`` are plain CPU tensors with this buffer's shapes and dtype, leaf for
        leaf (a DTensor, say, must stay one: it is cloned instead)."""
        dtype = self.dtype
        return [t.shape for t in leaves] == self.shapes and all(
            type(t) is torch.Tensor and t.is_cpu and t.dtype == dtype for t in leaves
        )


def clones(leaves: Leaves) -> Leaves:
    """Plain copies of ``leaves`` (their layouts kept): what a pure step makes unpooled."""
    return [t.clone(memory_format=torch.preserve_format) for t in leaves]


def _fresh(leaves: Leaves, copy: bool) -> Leaves:
    if copy:
        return clones(leaves)
    return [torch.empty_like(t, memory_format=torch.preserve_format) for t in leaves]


def unpooled(_key: Hashable, leaves: Leaves) -> Leaves:
    """:func:`clones` with :meth:`BufferPool.copies`' signature, for a state not pooled."""
    return clones(leaves)


def poolable(leaves: Leaves) -> bool:
    """Leaves the pool can keep in one flat buffer: plain, contiguous CPU tensors of one
    dtype that need no gradient (an empty list: nothing to keep, so yes)."""
    dtype = leaves[0].dtype if leaves else None
    return all(
        type(t) is torch.Tensor
        and t.is_cpu
        and t.dtype == dtype
        and t.is_contiguous()
        and not t.requires_grad
        for t in leaves
    )


class BufferPool:
    """Copies of leaf lists, written into buffers that nothing refers to any more.

    Args:
        spares: buffers kept per key (2: the one the caller's state holds and the one the
            next step writes; more only helps a caller that keeps one older state).

    Example:
        >>> pool = BufferPool()
        >>> a = pool.copies("w", [torch.ones(2), torch.zeros(3)])
        >>> b = pool.copies("w", [torch.ones(2), torch.zeros(3)])  # a is still held
        >>> del a
        >>> c = pool.copies("w", [torch.full((2,), 5.0), torch.zeros(3)])  # a's buffer
        >>> c[0].tolist(), b[0].tolist()
        ([5.0, 5.0], [1.0, 1.0])
    """

    def __init__(self, spares: int = 2) -> None:
        if spares < 1:
            raise ValueError(f"BufferPool needs spares >= 1, got spares={spares!r}")
        self.spares = spares
        self._buffers: dict[Hashable, list[_Buffer]] = {}
        self._bytes = 0
        self._lock = threading.Lock()  # two threads stepping must not take one buffer
        _POOLS.add(self)

    def copies(self, key: Hashable, leaves: Leaves) -> Leaves:
        """New tensors with ``leaves``' values; ``key`` names the list (the same leaves
        step after step). The leaves themselves are never written."""
        return self._take(key, leaves, copy=True)

    def destinations(self, key: Hashable, like: Leaves) -> Leaves:
        """New tensors shaped like ``like``, for the caller to overwrite whole (their
        values are left over from an older state): the compiled step writes its new state
        into them inside its graph. ``like`` itself is never written."""
        return self._take(key, like, copy=False)

    def _take(self, key: Hashable, leaves: Leaves, copy: bool) -> Leaves:
        if not POOLING or not leaves or torch.compiler.is_compiling():
            return _fresh(leaves, copy)
        with self._lock:
            buffers = self._buffers.setdefault(key, [])
            for i, buf in enumerate(buffers):  # oldest first: in a loop it is the free one
                if buf.free() and buf.fits(leaves):
                    if copy:
                        torch._foreach_copy_(buf.views, leaves)
                    buffers.append(buffers.pop(i))  # now the newest
                    return list(buf.views)
            if not poolable(leaves):
                return _fresh(leaves, copy)
            buf = _Buffer(leaves, copy)
            buffers.append(buf)
            self._bytes += buf.nbytes
            for old in buffers[: -self.spares]:  # whoever still holds it keeps it
                self._bytes -= old.nbytes
            del buffers[: -self.spares]
            return list(buf.views)

    @staticmethod
    def admits(copy_bytes: int) -> bool:
        """Whether a state whose copy is ``copy_bytes`` should be pooled: its two copies fit
        in :data:`POOL_BYTES` (decided for the whole state, so a state is pooled or not)."""
        return POOLING and 2 * copy_bytes <= POOL_BYTES

    def clear(self) -> None:
        """Forget every buffer (those still held live on with their holders)."""
        with self._lock:
            self._buffers.clear()
            self._bytes = 0

    def nbytes(self) -> int:
        """Bytes of the buffers the pool keeps (held by a state or spare)."""
        return self._bytes


def release_buffers() -> int:
    """Hand back the spare state buffers of every pure step's optimizer; returns the bytes
    the pools held (buffers a live state still uses stay with it).

    Example:
        >>> import ftrain
        >>> ftrain.optim.release_buffers() >= 0
        True
    """
    held = 0
    for pool in list(_POOLS):
        held += pool.nbytes()
        pool.clear()
    return held
