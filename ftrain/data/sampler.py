"""The pure, elastic sampler: ``(cursor, key) -> (this rank's indices, next cursor)``.

The global sample stream
------------------------
Epoch ``e`` visits the ``N`` samples in the order ``perm_e``::

    data_key = fold_in(base_key, STREAM_DATA)           # base_key = state["rng"]
    perm_e   = torch.randperm(N, generator=generator(fold_in(data_key, e)))
                                                        # or arange(N) with shuffle=False

The cursor ``(epoch, position)`` points at ``perm_epoch[position]``, the next sample
of this *global* stream; it says nothing about ranks or batch sizes. A step takes
the next ``global_batch`` samples of the stream and rank ``r`` of ``w`` keeps the
contiguous slice ``[r * B, (r + 1) * B)`` with ``B = global_batch // w``. Hence a run
resumed on another world size with the same global batch reads exactly the batches
the uninterrupted run would have: the concatenation of the ranks' slices is the
same global batch.

The partial last batch
----------------------
``drop_last=False`` (default, **wrap**): the batch that crosses the end of epoch
``e`` takes the epoch's remaining samples, then continues with the first samples of
``perm_{e+1}``. Every sample is read exactly once per epoch and every batch has the
full size. The global stream is simply ``perm_0 ++ perm_1 ++ ...`` cut into batches,
so it is independent of the global batch too: a resume with a *different* global
batch continues the same stream from the same sample, with nothing skipped or
repeated.

``drop_last=True``: if fewer than ``global_batch`` samples remain in the epoch they
are skipped and the batch starts the next epoch. Which samples are skipped depends on
the global batch, so a resume with a different global batch still starts at the same
position but the epoch's tail is cut at a different place.

A cursor is normalised: when the next batch would start a new epoch, ``next_cursor``
already says ``(epoch + 1, 0)`` (with wrap, ``position == N`` becomes ``(epoch + 1, 0)``).
"""

from __future__ import annotations

import functools

import torch
from tensordict import TensorDict

from ftrain.rng import STREAM_DATA, fold_in, generator, key_data

__all__ = ["cursor_values", "data_key", "epoch_order", "init_cursor", "sample"]


def init_cursor(epoch: int = 0, position: int = 0) -> TensorDict:
    """A fresh data cursor for ``state["data"]``: int64 0-d ``epoch`` and ``position``.

    Example:
        >>> init_cursor()["position"].item()
        0
    """
    if epoch < 0 or position < 0:
        raise ValueError(f"a cursor needs epoch >= 0 and position >= 0, got {epoch=} {position=}")
    return TensorDict(
        {
            "epoch": torch.tensor(epoch, dtype=torch.int64),
            "position": torch.tensor(position, dtype=torch.int64),
        },
        batch_size=[],
    )


def cursor_values(cursor: TensorDict) -> tuple[int, int]:
    """``(epoch, position)`` of a cursor as Python ints, validated."""
    try:
        epoch, position = int(cursor["epoch"]), int(cursor["position"])
    except (KeyError, TypeError, RuntimeError) as e:
        raise TypeError(
            f"a data cursor is TensorDict(epoch=int64[], position=int64[]) as made by "
            f"init_cursor(), got {cursor!r}"
        ) from e
    if epoch < 0 or position < 0:
        raise ValueError(f"corrupt data cursor: {epoch=} {position=} must be >= 0")
    return epoch, position


def data_key(base_key: torch.Tensor) -> torch.Tensor:
    """The data stream's key, ``fold_in(base_key, STREAM_DATA)``."""
    return fold_in(base_key, STREAM_DATA)


@functools.lru_cache(maxsize=4)
def _order(key_bits: int, epoch: int, n: int, shuffle: bool) -> torch.Tensor:
    if not shuffle:
        return torch.arange(n)
    k = fold_in(torch.tensor(key_bits - (1 << 64) if key_bits >= 1 << 63 else key_bits), epoch)
    return torch.randperm(n, generator=generator(k))


def epoch_order(
    base_key: torch.Tensor, epoch: int, num_samples: int, shuffle: bool = True
) -> torch.Tensor:
    """The order of samples in ``epoch``: a permutation of ``range(num_samples)``.

    Pure (cached for speed; treat the result as read-only). See the module docstring.

    Example:
        >>> from ftrain.rng import key
        >>> sorted(epoch_order(key(0), 0, 5).tolist())
        [0, 1, 2, 3, 4]
    """
    return _order(key_data(data_key(base_key)), int(epoch), int(num_samples), bool(shuffle))


def _check(rank: int, world: int, global_batch: int, num_samples: int, drop_last: bool) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got {rank=} {world=}")
    if global_batch < 1 or global_batch % world:
        raise ValueError(
            f"global_batch must be a positive multiple of world, got {global_batch=} {world=}; "
            f"use a global batch divisible by {world}"
        )
    if num_samples < 1:
        raise ValueError(f"the source has no samples ({num_samples=})")
    if drop_last and num_samples < global_batch:
        raise ValueError(
            f"drop_last=True with {num_samples=} < {global_batch=} leaves no full batch; "
            "use drop_last=False (wrap) or a smaller global batch"
        )


def _start(epoch: int, pos: int, n: int, global_batch: int, drop_last: bool) -> tuple[int, int]:
    if pos >= n or (drop_last and pos + global_batch > n):
        return epoch + 1, 0  # a shrunk dataset (allowed change) or a dropped tail
    return epoch, pos


def rank_starts(
    cursor: TensorDict, *, world: int, global_batch: int, num_samples: int, drop_last: bool
) -> list[tuple[int, int]]:
    """``(epoch, position)`` where each rank's part of the batch at ``cursor`` begins, as
    :func:`sample` reads it: a cursor past a shrunk dataset's end starts the next epoch,
    and a rank whose part begins past the epoch's end reads the next one.

    Example:
        >>> rank_starts(init_cursor(0, 20), world=2, global_batch=4, num_samples=22,
        ...             drop_last=False)
        [(0, 20), (1, 0)]
    """
    epoch, pos = _start(*cursor_values(cursor), num_samples, global_batch, drop_last)
    local = global_batch // world
    out = []
    for r in range(world):
        e, at = epoch, pos + r * local
        e, at = e + at // num_samples, at % num_samples  # a batch may span several epochs
        out.append((e, at))
    return out


def sample(
    cursor: TensorDict,
    key: torch.Tensor,
    *,
    rank: int = 0,
    world: int = 1,
    global_batch: int,
    num_samples: int,
    shuffle: bool = True,
    drop_last: bool = False,
) -> tuple[torch.Tensor, TensorDict]:
    """The sample indices of the batch at ``cursor`` for one rank, and the cursor after it.

    A pure function: the same arguments give the same result, the input cursor is not
    modified, and no global RNG is touched.

    Args:
        cursor: ``state["data"]`` (see :func:`init_cursor`).
        key: the run's base key, ``state["rng"]``; the data key is derived from it.
        rank: this process's rank in ``[0, world)``.
        world: the number of data-parallel ranks.
        global_batch: samples per step over all ranks; must be divisible by ``world``.
        num_samples: ``len(source)``.
        shuffle: permute each epoch (else natural order).
        drop_last: skip an epoch's partial last batch instead of wrapping into the next
            epoch (see the module docstring).

    Returns:
        ``(indices, next_cursor)``: int64 ``[global_batch // world]`` and a new cursor.

    Raises:
        ValueError: bad rank/world/global batch, or no full batch with ``drop_last``.

    Example:
        >>> from ftrain.rng import key
        >>> idx, nxt = sample(init_cursor(), key(0), global_batch=4, num_samples=10, shuffle=False)
        >>> idx.tolist(), nxt["position"].item()
        ([0, 1, 2, 3], 4)
    """
    _check(rank, world, global_batch, num_samples, drop_last)
    epoch, pos = _start(*cursor_values(cursor), num_samples, global_batch, drop_last)
    pieces, need = [], global_batch
    while need:
        take = min(need, num_samples - pos)
        pieces.append(epoch_order(key, epoch, num_samples, shuffle)[pos : pos + take])
        need, pos = need - take, pos + take
        if pos == num_samples:
            epoch, pos = epoch + 1, 0
    if drop_last and pos + global_batch > num_samples:
        epoch, pos = epoch + 1, 0
    local = global_batch // world
    indices = torch.cat(pieces)[rank * local : (rank + 1) * local].clone()
    return indices, init_cursor(epoch, pos)
