"""A tiny thread fan-out for chunk I/O.

Plain threads instead of ``concurrent.futures``: an executor refuses new work once the
interpreter starts shutting down, and a background save that is finishing during a normal
process exit must still be able to write its chunks.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def run_parallel(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """Apply ``fn`` to every item on up to ``workers`` threads; results in input order.

    Args:
        fn: the function (it should release the GIL for the heavy part, as I/O and crc do).
        items: the inputs.
        workers: the number of threads (1 runs inline).

    Returns:
        ``[fn(x) for x in items]``.

    Raises:
        The first exception raised by ``fn`` (the remaining items are not started).

    Example:
        >>> run_parallel(abs, [-1, 2], workers=2)
        [1, 2]
    """
    todo = list(enumerate(items))
    results: list = [None] * len(todo)
    if workers <= 1 or len(todo) <= 1:
        return [fn(x) for x in (item for _, item in todo)]
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    for job in todo:
        jobs.put(job)
    errors: list[BaseException] = []

    def worker() -> None:
        while not errors:
            try:
                i, item = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = fn(item)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors.append(e)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(workers, len(todo)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def run_pools(pools: list[tuple[Callable[[T], R], Iterable[T], int]]) -> list[list[R]]:
    """Run several :func:`run_parallel` fan-outs at the same time (each with its own
    threads and queue); results per pool.

    Raises:
        The first exception of the first pool that failed (all pools are waited for).
    """
    out: list = [None] * len(pools)
    errors: list = [None] * len(pools)

    def one(k: int) -> None:
        fn, items, workers = pools[k]
        try:
            out[k] = run_parallel(fn, items, workers)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[k] = e

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(1, len(pools))]
    for t in threads:
        t.start()
    one(0)
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return out
