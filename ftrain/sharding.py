"""A sharded optimizer state (ZeRO-1) on ``torch.distributed`` DTensor.

With ``make_step(..., shard="optimizer")`` (CLI: ``dist.shard=optimizer``) every rank holds
the whole parameters but only its **dim-0 shard** of every optimizer moment: the optimizer
state's per-parameter leaves are ``DTensor``s placed ``Shard(0)`` on a 1-D device mesh of
all ranks (0-d leaves such as counts and learning rates stay plain, replicated tensors).
One step:

1. forward + backward on the whole parameters, as in plain data parallelism;
2. the gradients are **reduce-scattered** (one bucket, averaged): each rank receives the
   summed rows of its own shard only;
3. ``tx.update`` runs on the shards — the transforms are unchanged: DTensor runs their
   ``torch._foreach_*`` kernels on the local rows, and reductions that span the tree
   (``clip_by_global_norm``'s norm, the ``grad_norm`` metric) all-reduce across shards, so
   clipping uses the **global** norm;
4. the updated parameter rows are **all-gathered** (one bucket) into whole parameters.

The step stays pure: shards are new tensors, the input state is never written.

Uneven sizes follow DTensor's ``Shard(0)`` (``torch.chunk``) rule: rank ``r`` owns rows
``[r*c, min((r+1)*c, n))`` with ``c = ceil(n / world)``; a rank may own no rows of a small
tensor. 0-d parameters are replicated (their gradients all-reduced).

Reduction order differs from ``shard="none"`` (one reduce-scatter instead of one
all-reduce, the norm as a sum of per-shard partial norms), so results match to rounding:
≤ 1e-5 relative after 50 steps (tested), not bit for bit. A run is still deterministic:
the same world size gives bit-identical results, including across a resume.

Checkpoints (:mod:`ftrain.ckpt.sharded`): every rank writes the chunks of its own rows into
one store of global arrays; a restore on any world size reads, on each rank, only the rows
that :meth:`Sharder.owned_rows` names and builds the DTensor leaves from them
(:meth:`Sharder.from_rows`). :func:`gather_state` assembles whole tensors (a collective) for
evaluation and for stores that take one writer.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ftrain.state.tree import flatten, rebuild, replace, structure

__all__ = [
    "SHARD_MODES",
    "Sharder",
    "gather_state",
    "is_sharded",
    "local_bytes",
    "shard_state",
]

SHARD_MODES = ("none", "optimizer")

# torch 2.13 renamed the flat-buffer collectives (the old names warn); same semantics
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _rows(n: int, world: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each rank's dim-0 shard of ``n`` rows (``torch.chunk``)."""
    c = math.ceil(n / world) if n else 0
    return [(min(r * c, n), max(0, min((r + 1) * c, n) - r * c)) for r in range(world)]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (the global layout of a shard)."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


class Sharder:
    """The dim-0 sharding of one mesh: shards tensors, and moves gradients and parameters
    between whole and sharded forms in one bucketed collective each.

    Args:
        mesh: a 1-D device mesh (default: every rank of the default group).
        full: the params are sharded too (``shard="full"``), not only the optimizer state.
    """

    def __init__(self, mesh: DeviceMesh | None = None, *, full: bool = False) -> None:
        self.full = full
        if mesh is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "a sharded optimizer state needs torch.distributed initialised "
                    "(launch with torchrun); use shard='none' on one process"
                )
            mesh = init_device_mesh(
                "cpu" if dist.get_backend() == "gloo" else "cuda", (dist.get_world_size(),)
            )
        self.mesh = mesh
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.rank = mesh.get_local_rank()

    # -- whole <-> sharded, no communication ------------------------------------
    def shard(self, t: torch.Tensor, *, copy: bool = True) -> DTensor:
        """This rank's rows of a whole (replicated) tensor as a ``Shard(0)`` DTensor (a 0-d
        tensor: ``Replicate``). ``copy=False`` keeps a view into ``t``."""
        if isinstance(t, DTensor):
            return t
        if t.ndim == 0:
            return DTensor.from_local(
                t.clone() if copy else t, self.mesh, [Replicate()], run_check=False
            )
        start, length = _rows(t.shape[0], self.world)[self.rank]
        local = t.narrow(0, start, length)
        return self.from_rows(local.clone() if copy else local, t.shape, t.stride())

    def from_rows(
        self, local: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...] | None = None
    ) -> DTensor:
        """The ``Shard(0)`` DTensor of global ``shape`` (and ``stride``; default: contiguous)
        whose rows on this rank are ``local`` (no communication: every rank passes its own
        rows, :meth:`owned_rows`)."""
        return DTensor.from_local(
            local,
            self.mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size(shape),
            stride=tuple(stride) if stride is not None else _contiguous_stride(shape),
        )

    def owned_rows(self, key: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """``(start, length)`` of this rank's rows of the leaf at ``key`` (``"opt/mu/w"``) if
        :func:`shard_state` row-shards it, else ``None`` (the leaf stays whole: 0-d leaves,
        and the params unless ``full``). What a restore reads of each array."""
        if not shape or key.split("/", 1)[0] not in _sharded_parts(self):
            return None
        return _rows(shape[0], self.world)[self.rank]

    # -- gradients: reduce-scatter (mean) ---------------------------------------
    def reduce_scatter_mean(self, grads: list[torch.Tensor]) -> list[DTensor]:
        """Average whole gradients over ranks, each rank keeping its own rows only."""
        scalars = [i for i, g in enumerate(grads) if g.ndim == 0]
        out: list = [None] * len(grads)
        if scalars:
            flat = torch.stack([grads[i].detach().float() for i in scalars])
            dist.all_reduce(flat, group=self.group)
            for j, i in enumerate(scalars):
                out[i] = self.shard((flat[j] / self.world).to(grads[i].dtype))
        rows = [i for i, g in enumerate(grads) if g.ndim > 0]
        for dtype in sorted({grads[i].dtype for i in rows}, key=str):
            same = [i for i in rows if grads[i].dtype == dtype]
            for i, local in zip(same, self._reduce_scatter([grads[i] for i in same]), strict=True):
                out[i] = self.from_rows(local, grads[i].shape, grads[i].stride())
        return out

    def _segments(self, ts: list[torch.Tensor]) -> tuple[list[int], list[list[tuple[int, int]]]]:
        """Per tensor: the padded segment length (max rows x row size) and every rank's rows."""
        seg, rows = [], []
        for t in ts:
            r = _rows(t.shape[0], self.world)
            rows.append(r)
            seg.append(max(length for _, length in r) * (t[0].numel() if t.shape[0] else 0))
        return seg, rows

    def _reduce_scatter(self, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        seg, rows = self._segments(ts)
        size = sum(seg)
        send = torch.zeros(self.world, size, dtype=ts[0].dtype, device=ts[0].device)
        at = 0
        for t, s, r in zip(ts, seg, rows, strict=True):
            row = t[0].numel() if t.shape[0] else 0
            for rank, (start, length) in enumerate(r):
                send[rank, at : at + length * row] = t.narrow(0, start, length).reshape(-1)
            at += s
        mine = torch.empty(size, dtype=ts[0].dtype, device=ts[0].device)
        _REDUCE_SCATTER(mine, send.reshape(-1), group=self.group)
        mine /= self.world
        out, at = [], 0
        for t, s, r in zip(ts, seg, rows, strict=True):
            length = r[self.rank][1]
            out.append(
                mine[at : at + length * (t[0].numel() if t.shape[0] else 0)].view(
                    length, *t.shape[1:]
                )
            )
            at += s
        return out

    # -- parameters: all-gather -------------------------------------------------
    def all_gather(self, shards: list[DTensor]) -> list[torch.Tensor]:
        """Whole tensors from every rank's rows (one bucket per dtype); 0-d stay as they are."""
        out: list = [None] * len(shards)
        for i, s in enumerate(shards):
            if s.ndim == 0:
                out[i] = s.to_local()
        rows = [i for i, s in enumerate(shards) if s.ndim > 0]
        for dtype in sorted({shards[i].dtype for i in rows}, key=str):
            same = [i for i in rows if shards[i].dtype == dtype]
            for i, whole in zip(same, self._all_gather([shards[i] for i in same]), strict=True):
                out[i] = whole
        return out

    def _all_gather(self, shards: list[DTensor]) -> list[torch.Tensor]:
        shapes = [s.shape for s in shards]
        seg, rows = self._segments([torch.empty(sh, device="meta") for sh in shapes])
        size = sum(seg)
        mine = torch.zeros(size, dtype=shards[0].dtype, device=shards[0].to_local().device)
        at = 0
        for s, n in zip(shards, seg, strict=True):
            local = s.to_local().reshape(-1)
            mine[at : at + local.numel()] = local
            at += n
        every = torch.empty(self.world * size, dtype=mine.dtype, device=mine.device)
        _ALL_GATHER(every, mine, group=self.group)
        every = every.view(self.world, size)
        out, at = [], 0
        for sh, n, r in zip(shapes, seg, rows, strict=True):
            row = math.prod(sh[1:])
            parts = [every[rank, at : at + length * row] for rank, (_, length) in enumerate(r)]
            out.append(torch.cat(parts).view(sh))
            at += n
        return out


def is_sharded(tree: TensorDictBase) -> bool:
    """Whether any leaf of ``tree`` is a DTensor."""
    return any(isinstance(t, DTensor) for t in flatten(tree)[1])


def _sharded_parts(sharder: Sharder) -> tuple[str, ...]:
    return ("opt", "params") if sharder.full else ("opt",)


def shard_state(state: TensorDictBase, sharder: Sharder) -> TensorDictBase:
    """The state with this rank's ``Shard(0)`` rows of every optimizer leaf of ndim >= 1
    (counts, learning rates and loss scales stay plain), and of every param for a ``full``
    sharder (0-d params: ``Replicate``)."""
    parts = {}
    for part in _sharded_parts(sharder):
        layout, leaves = structure(state[part])  # keeps stateless members' empty entries
        sharded = [sharder.shard(t) if t.ndim > 0 or part == "params" else t for t in leaves]
        parts[part] = rebuild(layout, sharded, device=state[part].device)
    return replace(state, **parts)


def gather_state(
    state: TensorDictBase, parts: tuple[str, ...] = ("opt", "params")
) -> TensorDictBase:
    """The state with whole tensors in place of DTensor shards (a collective: every rank
    calls it). What a checkpoint holds, whatever the world size."""
    out = {}
    for part in parts:
        layout, leaves = structure(state[part])
        if any(isinstance(t, DTensor) for t in leaves):
            whole = [t.full_tensor() if isinstance(t, DTensor) else t for t in leaves]
            out[part] = rebuild(layout, whole, device=state[part].device)
    return replace(state, **out) if out else state


def local_bytes(tree: TensorDictBase) -> int:
    """Bytes this rank holds for ``tree`` (a DTensor counts its local shard only)."""
    total = 0
    for t in flatten(tree)[1]:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total
