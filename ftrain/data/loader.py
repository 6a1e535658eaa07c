"""The prefetching loader: batches from any cursor, read ahead in a background thread.

The loader holds no position of its own. ``loader.iter_from(cursor)`` starts a
stream at a cursor; each batch carries ``cursor`` = the cursor *after* it, which
the trainer puts into the new state when the step that consumed the batch commits.
A producer thread may run ``prefetch`` batches ahead, but what it has read ahead is
simply discarded on restart: resuming from a checkpoint means calling
``iter_from(state["data"])`` again, which joins the old thread and starts a new one.

On CUDA the producer pins each batch's host memory and the consumer copies it with
``non_blocking=True`` on the current stream. Cursor tensors always stay on the CPU.
"""

from __future__ import annotations

import queue
import threading
import warnings
import weakref
from collections.abc import Iterator

import torch
from tensordict import TensorDict

from ftrain.data.sampler import cursor_values, init_cursor, sample
from ftrain.data.sources import (
    DataFormatError,
    DataPathError,
    SampleShapeError,
    Source,
    TokenRangeError,
)

__all__ = [
    "Loader",
    "LoaderIterator",
    "check_sample_shapes",
    "check_token_ids",
    "val_batches",
]

_POLL_S = 0.1


class _Stop:
    """Sentinel passed through the queue when the producer ends (with an optional error)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


def _produce(read, cursor: TensorDict, out: queue.Queue, stop: threading.Event) -> None:
    """The prefetch thread: batches from ``cursor`` into ``out`` until ``stop``."""
    try:
        while not stop.is_set():
            batch = read(cursor)
            cursor = batch["cursor"]
            _put(out, batch, stop)
    except BaseException as e:  # surfaced to the consumer on its next() call
        _put(out, _Stop(e), stop)


def _put(out: queue.Queue, item, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return
        except queue.Full:
            continue


class LoaderIterator(Iterator[TensorDict]):
    """An endless stream of batches from one starting cursor. ``close()`` joins its thread."""

    def __init__(self, loader: Loader, cursor: TensorDict) -> None:
        self._loader = loader
        self._cursor = init_cursor(*cursor_values(cursor))  # own copy; the caller's is untouched
        self._closed = False
        self._thread: threading.Thread | None = None
        if loader.prefetch > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=loader.prefetch)
            self._stop = threading.Event()
            # the thread holds the queue, the event and the loader's reader, never this
            # iterator: one dropped without close() (a `break` out of a for loop) is
            # collected, and collecting it stops the thread (it polled forever before)
            self._thread = threading.Thread(
                target=_produce,
                args=(loader._read, self._cursor, self._queue, self._stop),
                name="ftrain-data-prefetch",
                daemon=True,
            )
            weakref.finalize(self, self._stop.set)
            self._thread.start()

    def __next__(self) -> TensorDict:
        if self._closed:
            raise RuntimeError(
                "this data iterator is closed; start a new one with loader.iter_from(cursor)"
            )
        if self._thread is None:
            batch = self._loader._read(self._cursor)
        else:
            while True:
                try:
                    batch = self._queue.get(timeout=_POLL_S)
                    break
                except queue.Empty:
                    if not self._thread.is_alive() and self._queue.empty():
                        raise RuntimeError(
                            "the data prefetch thread died without a batch"
                        ) from None
            if isinstance(batch, _Stop):
                self.close()
                if isinstance(batch.error, (DataFormatError, DataPathError)):
                    raise batch.error  # its message names the data and the fix
                raise RuntimeError(
                    "the data prefetch thread failed while reading a batch"
                ) from batch.error
        self._cursor = batch["cursor"]
        return self._loader._to_device(batch)

    def close(self) -> None:
        """Stop the prefetch thread and wait for it; idempotent."""
        self._closed = True
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __enter__(self) -> LoaderIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Loader:
    """Batches of a source for one rank, in the order of the pure sampler.

    Args:
        source: any :class:`~ftrain.data.sources.Source`.
        global_batch: samples per step over all ranks (divisible by ``world``).
        rank: this process's rank.
        world: the number of data-parallel ranks.
        key: the run's base key (``state["rng"]``).
        shuffle: permute each epoch.
        drop_last: skip an epoch's partial last batch instead of wrapping (see sampler).
        prefetch: batches to read ahead in a background thread (0: read synchronously).
        device: where ``x`` and ``y`` are delivered; on CUDA via pinned memory and
            non-blocking copies.
        vocab_size: when given, a batch holding a token id outside ``[0, vocab_size)``
            raises :class:`~ftrain.data.DataFormatError` naming the data and the fix
            (the model's embedding would fail deep inside ``F.embedding``, or a CUDA
            device assert); checked on the host before the copy, per batch.

    Example:
        >>> from ftrain.data.sources import TensorSource
        >>> from ftrain.rng import key
        >>> loader = Loader(TensorSource(torch.arange(100), block_size=4), global_batch=2, key=key(0))
        >>> with loader.iter_from(init_cursor()) as it:
        ...     batch = next(it)
        >>> batch["x"].shape, batch["cursor", "position"].item()
        (torch.Size([2, 4]), 2)
    """

    def __init__(
        self,
        source: Source,
        *,
        global_batch: int,
        key: torch.Tensor,
        rank: int = 0,
        world: int = 1,
        shuffle: bool = True,
        drop_last: bool = False,
        prefetch: int = 2,
        device: str | torch.device = "cpu",
        vocab_size: int | None = None,
    ) -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch=}")
        self.source, self.global_batch, self.rank, self.world = source, global_batch, rank, world
        self.key, self.shuffle, self.drop_last, self.prefetch = (
            key.clone(),
            shuffle,
            drop_last,
            prefetch,
        )
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self._pin = self.device.type == "cuda"
        # held weakly: the prefetch thread holds this loader (its reader), so a strong
        # reference here kept a dropped iterator, and its thread, alive for good
        self._active: weakref.ref[LoaderIterator] | None = None
        self._said_short = False
        # validate the arguments now rather than in the producer thread
        sample(init_cursor(), self.key, **self._sample_kwargs())

    def _sample_kwargs(self) -> dict:
        return {
            "rank": self.rank,
            "world": self.world,
            "global_batch": self.global_batch,
            "num_samples": len(self.source),
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def _read(self, cursor: TensorDict) -> TensorDict:
        indices, next_cursor = sample(cursor, self.key, **self._sample_kwargs())
        xy = self.source.get(indices)
        epoch, position = cursor_values(cursor)
        where = f"epoch {epoch}, position {position}"
        note = check_sample_shapes(
            self.source, xy, len(indices), where, tokens=self.vocab_size is not None
        )
        if note and not self._said_short:
            self._said_short = True  # once per loader: a padding source's every batch
            warnings.warn(note, stacklevel=2)
        x, y = xy["x"], xy["y"]
        check_token_ids(self.source, x, y, self.vocab_size, where)
        if self._pin:
            x, y = x.pin_memory(), y.pin_memory()
        return TensorDict({"x": x, "y": y, "cursor": next_cursor}, batch_size=[])

    def _to_device(self, batch: TensorDict) -> TensorDict:
        if self.device.type == "cpu":
            return batch
        return TensorDict(
            {
                "x": batch["x"].to(self.device, non_blocking=True),
                "y": batch["y"].to(self.device, non_blocking=True),
                "cursor": batch["cursor"],
            },
            batch_size=[],
        )

    def iter_from(self, cursor: TensorDict | None = None) -> LoaderIterator:
        """Start a batch stream at ``cursor`` (default: the start), closing the previous one.

        Each batch is ``TensorDict(x, y, cursor)``: ``x``/``y`` int64
        ``[global_batch // world, block_size]`` and ``cursor`` the cursor after this batch.
        """
        self.close()
        stream = LoaderIterator(self, init_cursor() if cursor is None else cursor)
        self._active = weakref.ref(stream)
        return stream

    def __iter__(self) -> LoaderIterator:
        return self.iter_from(None)

    def close(self) -> None:
        """Close the active stream (joins its prefetch thread)."""
        stream = self._active() if self._active is not None else None
        if stream is not None:
            stream.close()
        self._active = None

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_sample_shapes(source: Source, xy, n: int, where: str, *, tokens: bool) -> str | None:
    """``source.get`` of ``n`` indices returned tensors ``x`` and ``y`` of ``n`` rows, and
    (``tokens``: the model has a vocabulary) token windows: ``x`` and ``y`` of one shape
    ``[n, T]``, ``T`` at most ``source.block_size``. A missing row shifted the batch, and
    ``y`` a token short of ``x``, without a word. Without a vocabulary only the rows are
    checked (a regression's targets may be ``[n, 1]``).

    Returns:
        A note when token windows are shorter than ``block_size`` (a padding source's
        batches may be; a cut window trains on short contexts): the caller warns once.

    Raises:
        SampleShapeError: a DataFormatError naming the source, the shapes and the fix.
    """
    block = getattr(source, "block_size", None)
    block = block if isinstance(block, int) else None
    x, y = (xy.get(k, None) if hasattr(xy, "get") else None for k in ("x", "y"))
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in (x, y)]
    length = _window_length(shapes, n, block, tokens)
    if length is not None:
        short = tokens and block is not None and length < block
        return (
            f"{type(source).__name__}.get() returns windows of {length} tokens, fewer than its block_size={block}: the model sees shorter contexts than it was built for"
            if short
            else None
        )
    got = ", ".join(
        f"{k} {'missing (not a tensor)' if s is None else s}"
        for k, s in zip("xy", shapes, strict=True)
    )
    want = (
        f"x and y of one shape [len(indices), T] = ({n}, T)"
        + (f", T <= block_size = {block}" if block is not None else "")
        if tokens
        else f"x and y of {n} rows"
    )
    raise SampleShapeError(
        f"{type(source).__name__}.get() returned {got} for {n} samples in the batch read at "
        f"{where}; a Source's get(indices) returns {want}: fix the source's get"
        + (" or its block_size" if tokens and block is not None else "")
    )


def _window_length(shapes: list, n: int, block: int | None, tokens: bool) -> int | None:
    """The windows' length if the shapes are well formed (see :func:`check_sample_shapes`;
    0 for a batch that is not token windows), else None."""
    x_shape, y_shape = shapes
    if x_shape is None or y_shape is None or x_shape[:1] != (n,) or y_shape[:1] != (n,):
        return None
    if not tokens:
        return 0
    fits = len(x_shape) == 2 and y_shape == x_shape and (block is None or x_shape[1] <= block)
    return x_shape[1] if fits else None


def check_token_ids(
    source: Source, x: torch.Tensor, y: torch.Tensor, vocab_size: int | None, where: str
) -> None:
    """Every input id of a batch in ``[0, vocab_size)`` and no target id at or above it
    (nothing checked without a size). Negative targets pass: ``-100`` is the ignore index
    of ``F.cross_entropy`` (a source masking padding or prompt tokens).

    Raises:
        TokenRangeError: a DataFormatError naming the id, the data, where it was read and
            the fix.
    """
    if vocab_size is None or not x.numel():
        return
    if x.is_floating_point() or y.is_floating_point() or x.dtype == torch.bool:
        facts = source.describe()  # F.embedding's own error was a traceback from the model
        raise TokenRangeError(
            f"the batch read at {where} of {facts.get('path') or facts.get('kind', 'the data')!r} "
            f"holds {x.dtype} inputs and {y.dtype} targets: token ids must be integers (the "
            "model has a vocabulary); make the source return integer tensors"
        )
    lo, hi = int(x.min()), max(int(x.max()), int(y.max()))
    if lo >= 0 and hi < vocab_size:
        return
    bad = hi if hi >= vocab_size else lo
    facts = source.describe()
    bigger = (
        f"a model.vocab_size above {bad} (a new run once steps are committed: " if bad >= 0 else ""
    )
    raise TokenRangeError(
        f"token id {bad} is outside the model's vocabulary [0, {vocab_size}) in the batch read "
        f"at {where} of {facts.get('path') or facts.get('kind', 'the data')!r}"
        + (f" (dtype {facts['dtype']})" if "dtype" in facts else "")
        + "; set data.dtype to the dtype the file was written with, regenerate the data"
        + (f", or use {bigger}resume=none run.overwrite=true)" if bigger else "")
    )


def val_batches(
    source: Source,
    n_batches: int,
    global_batch: int,
    rank: int = 0,
    world: int = 1,
    device: str | torch.device = "cpu",
    vocab_size: int | None = None,
) -> Iterator[TensorDict]:
    """The fixed evaluation batches of ``source``: the same every call, no RNG, no cursor.

    Batch ``b`` holds the samples ``floor(j * N / (n_batches * global_batch))`` for
    ``j`` in its slice, i.e. evenly spread over the split (wrapping when the split has
    fewer than ``n_batches * global_batch`` samples); rank ``r`` keeps its contiguous
    slice as in training.

    Yields:
        ``TensorDict(x, y)`` with ``[global_batch // world, block_size]`` int64 tensors.

    Raises:
        DataFormatError: with ``vocab_size``, a token id outside ``[0, vocab_size)``.

    Example:
        >>> from ftrain.data.sources import TensorSource
        >>> src = TensorSource(torch.arange(41), block_size=4)
        >>> [b["x"][:, 0].tolist() for b in val_batches(src, 2, 2)]
        [[0, 8], [20, 28]]
    """
    if global_batch < 1 or world < 1 or global_batch % world or not 0 <= rank < world:
        raise ValueError(
            f"need global_batch divisible by world and 0 <= rank < world, got {global_batch=} {rank=} {world=}"
        )
    n, total, local = len(source), n_batches * global_batch, global_batch // world
    order = torch.arange(total) * n // total if total <= n else torch.arange(total) % n
    dev, said_short = torch.device(device), False
    for b in range(n_batches):
        start = b * global_batch + rank * local
        xy = source.get(order[start : start + local])
        note = check_sample_shapes(
            source, xy, local, f"evaluation batch {b}", tokens=vocab_size is not None
        )
        if note and not said_short:
            said_short = True
            warnings.warn(note, stacklevel=2)
        check_token_ids(source, xy["x"], xy["y"], vocab_size, f"evaluation batch {b}")
        yield TensorDict({"x": xy["x"].to(dev), "y": xy["y"].to(dev)}, batch_size=[])
