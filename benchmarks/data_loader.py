"""Data loader throughput: ftrain's Loader vs torch.utils.data.DataLoader over one memmap.

Both read the same uint16 token memmap with the same windows (non-overlapping,
``block_size + 1`` tokens) in a shuffled order and deliver int64 ``x``/``y``
batches on the CPU. The loop only consumes batches (no model), so the figures are
an upper bound on what the reader can feed a step.

Run::

    .venv/bin/python benchmarks/data_loader.py            # prints a markdown table
    .venv/bin/python benchmarks/data_loader.py --batches 500 --tokens 5_000_000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ftrain.data import Loader, TokenFileSource, init_cursor
from ftrain.rng import key


class MemmapWindows(Dataset):
    """The plain-PyTorch baseline: one window per ``__getitem__``, default collate."""

    def __init__(self, path: Path, block_size: int) -> None:
        self.path, self.block_size = path, block_size
        self.n = (path.stat().st_size // 2 - 1) // block_size
        self.mm: np.memmap | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mm is None:  # opened lazily so that worker processes open their own
            self.mm = np.memmap(self.path, dtype=np.uint16, mode="r")
        w = torch.from_numpy(
            self.mm[i * self.block_size : (i + 1) * self.block_size + 1].astype(np.int64)
        )
        return w[:-1], w[1:]


def endless(loader: DataLoader):
    while True:  # epochs of the baseline, back to back
        yield from loader


def rate(batches, n: int, warmup: int = 10) -> float:
    it = iter(batches)
    for _ in range(warmup):
        next(it)
    t0 = time.perf_counter()
    for _ in range(n):
        next(it)
    return n / (time.perf_counter() - t0)


def overhead_us(batches, n: int, work_s: float = 1e-3) -> float:
    """Host time a step spends waiting for data when the step itself idles ``work_s``.

    ``time.sleep`` stands in for a GPU step: the host waits on the device, and a
    prefetch thread can read the next batch meanwhile.
    """
    it = iter(batches)
    next(it)
    t0 = time.perf_counter()
    for _ in range(n):
        time.sleep(work_s)
    idle = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n):
        next(it)
        time.sleep(work_s)
    return max(time.perf_counter() - t0 - idle, 0.0) / n * 1e6


def bench(path: Path, batch: int, block: int, n: int) -> dict[str, tuple[float, float]]:
    out = {}
    src = TokenFileSource(path, block_size=block, val_fraction=0.0)
    for prefetch in (0, 2):
        loader = Loader(src, global_batch=batch, key=key(0), prefetch=prefetch)
        speed = rate(loader.iter_from(init_cursor()), n)
        lag = overhead_us(loader.iter_from(init_cursor()), n // 4)
        out[f"ftrain Loader (prefetch={prefetch})"] = (speed, lag)
        loader.close()
    ds = MemmapWindows(path, block)
    for workers in (0, 2):
        g = torch.Generator().manual_seed(0)
        dl = DataLoader(
            ds,
            batch_size=batch,
            shuffle=True,
            generator=g,
            num_workers=workers,
            persistent_workers=workers > 0,
        )
        speed = rate(endless(dl), n)
        out[f"DataLoader (num_workers={workers})"] = (speed, overhead_us(endless(dl), n // 4))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=2000, help="timed batches per configuration")
    p.add_argument("--tokens", type=int, default=20_000_000, help="tokens in the memmap")
    args = p.parse_args()
    configs = [(8, 256), (12, 1024)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.bin"
        np.random.default_rng(0).integers(0, 50257, args.tokens, dtype=np.uint16).tofile(path)
        results = {cfg: bench(path, *cfg, args.batches) for cfg in configs}
    names = list(next(iter(results.values())))
    heads = [f"{b}x{t}: batches/s | {b}x{t}: wait per 1 ms step" for b, t in configs]
    print(f"| loader | {' | '.join(heads)} |")
    print(f"|---|{'---:|---:|' * len(configs)}")
    for name in names:
        cells = [f"{results[c][name][0]:,.0f} | {results[c][name][1]:,.0f} µs" for c in configs]
        print(f"| {name} | {' | '.join(cells)} |")
    print(
        f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {args.tokens:,} uint16 tokens"
    )


if __name__ == "__main__":
    main()
