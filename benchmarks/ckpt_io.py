"""Checkpoint I/O: ftrain vs raw writes, O_DIRECT, torch.save, safetensors and DCP.

Saves and restores a GPT-2 small (124M) + AdamW state (params, mu, nu: ~1.5 GB fp32)
with every method, side by side. Saves are durable (every file and directory fsync'd);
loads are cold in the guest (each file's pages dropped with posix_fadvise(DONTNEED)
after the fsync). Repetitions are interleaved (one round = every method once), medians
of ``--reps`` rounds, ratios against torch.save / safetensors / O_DIRECT. ``--codecs``
adds compressed ftrain rows, ``--bf16`` stores every float tensor as bfloat16. Results
go to docs/benchmarks.md ("Checkpoint I/O").

Two load figures: ``load`` is the time the load call takes; ``ready`` adds one read of
every 4 KiB page of every loaded tensor (what the first training step or ``.cuda()`` does
first). They differ for loaders whose tensors are lazily mapped files: safetensors'
``load_file`` returns tensors over a private ``mmap`` of the file, whose page-table
entries are only made at first touch; ftrain, torch.load and the raw loaders return
tensors already in the process's memory (the touch costs them a few ms).

    .venv/bin/python benchmarks/ckpt_io.py --dir /tmp/ckpt_bench --reps 3
    .venv/bin/python benchmarks/ckpt_io.py --only torch.save safetensors "ftrain sync" \
        --codecs zstd blosc-lz4 --reps 3 [--bf16]
    .venv/bin/python benchmarks/ckpt_io.py --only torch.save safetensors "ftrain sync" \
        --load-rounds 9     # the resume case: saved once, then cold loads only
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from ftrain.ckpt import CheckpointManager


def gpt2_adamw_state(
    n_layer: int = 12, d: int = 768, vocab: int = 50257, ctx: int = 1024
) -> TensorDict:
    shapes = {"wte": (vocab, d), "wpe": (ctx, d), "ln_f/weight": (d,), "ln_f/bias": (d,)}
    for i in range(n_layer):
        for name, shape in {
            "ln_1/weight": (d,), "ln_1/bias": (d,), "attn/c_attn/weight": (d, 3 * d),
            "attn/c_attn/bias": (3 * d,), "attn/c_proj/weight": (d, d), "attn/c_proj/bias": (d,),
            "ln_2/weight": (d,), "ln_2/bias": (d,), "mlp/c_fc/weight": (d, 4 * d),
            "mlp/c_fc/bias": (4 * d,), "mlp/c_proj/weight": (4 * d, d), "mlp/c_proj/bias": (d,),
        }.items():  # fmt: skip
            shapes[f"h/{i}/{name}"] = shape
    g = torch.Generator().manual_seed(0)

    def tree() -> TensorDict:
        td = TensorDict({}, [])
        for k, s in shapes.items():
            td[tuple(k.split("/"))] = torch.randn(s, generator=g)
        return td

    return TensorDict(
        {"step": torch.tensor(1000), "params": tree(), "buffers": {},
         "opt": {"mu": tree(), "nu": tree(), "count": torch.tensor(1000)},
         "amp": {}, "data": {"position": torch.tensor(0)}, "rng": torch.tensor([0, 1])},
        [],
    )  # fmt: skip


def flat(td: TensorDict) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in td.flatten_keys(".").items()}


def fsync_tree(path: Path, drop: bool = True) -> None:
    """fsync every file and directory under ``path``; drop the file pages (cold loads)."""
    for dirpath, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            os.fsync(fd)
            if drop:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def drop_cache(path: Path) -> None:
    fsync_tree(path, drop=True)


# ---- peers ---------------------------------------------------------------------------
def raw_save(tensors, path: Path) -> None:
    path.mkdir()
    for k, t in tensors.items():
        with open(path / k, "wb") as f:
            f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))
    fsync_tree(path, drop=False)


def raw_load(tensors, path: Path) -> dict:
    out = {}
    for k, t in tensors.items():
        o = torch.empty_like(t)
        with open(path / k, "rb", buffering=0) as f:
            f.readinto(memoryview(o.view(-1).view(torch.uint8).numpy()))
        out[k] = o
    return out


BLOCK = 16 << 20


def odirect_save(tensors, path: Path) -> None:
    path.mkdir()
    buf = mmap.mmap(-1, BLOCK)
    fd = os.open(path / "all.bin", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    fill = 0
    for t in tensors.values():
        src = memoryview(t.view(-1).view(torch.uint8).numpy())
        while len(src):
            n = min(len(src), BLOCK - fill)
            buf[fill : fill + n] = src[:n]
            fill, src = fill + n, src[n:]
            if fill == BLOCK:
                os.write(fd, buf)
                fill = 0
    if fill:
        os.write(fd, memoryview(buf)[: (fill + 4095) // 4096 * 4096])
    os.fsync(fd)
    os.close(fd)
    fsync_tree(path, drop=False)


def odirect_load(tensors, path: Path) -> dict:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    size = (total + 4095) // 4096 * 4096
    buf = mmap.mmap(-1, size)
    fd = os.open(path / "all.bin", os.O_RDONLY | os.O_DIRECT)
    mv, got = memoryview(buf), 0
    while got < size:
        got += os.readv(fd, [mv[got : min(size, got + BLOCK)]])
    os.close(fd)
    out, off = {}, 0
    whole = torch.frombuffer(buf, dtype=torch.uint8)
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        out[k] = whole[off : off + n].view(t.dtype).view(t.shape)
        off += n
    return out


def torch_save(tensors, path: Path) -> None:
    path.mkdir()
    torch.save(tensors, path / "ckpt.pt")
    fsync_tree(path, drop=False)


def torch_load(tensors, path: Path) -> dict:
    return torch.load(path / "ckpt.pt", weights_only=True)


def st_save(tensors, path: Path) -> None:
    from safetensors.torch import save_file

    path.mkdir()
    save_file(tensors, str(path / "ckpt.safetensors"))
    fsync_tree(path, drop=False)


def st_load(tensors, path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "ckpt.safetensors"))


def dcp_save(tensors, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(
        dict(tensors),
        storage_writer=dcp.FileSystemWriter(str(path), thread_count=2, sync_files=True),
    )
    fsync_tree(path, drop=False)


def dcp_load(tensors, path: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    out = {k: torch.empty_like(t) for k, t in tensors.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(path)))
    return out


# ---- ftrain --------------------------------------------------------------------------
def ftrain_methods(
    state: TensorDict, async_save: bool, compression: str | None = None, mapped: bool = False
):
    """``mapped``: restore with ``CheckpointManager.restore(mmap=True)``."""
    stats: dict = {}

    def save(_, path: Path) -> None:
        m = CheckpointManager(path, async_save=async_save, compression=compression)
        t0 = time.perf_counter()
        m.save(state)
        stats["blocking"] = time.perf_counter() - t0
        m.close()

    def load(_, path: Path) -> TensorDict:
        return CheckpointManager(path).restore(**({"mmap": True} if mapped else {}))

    return save, load, stats


def touch_pages(out) -> float:
    """Read one byte of every 4 KiB page of every tensor in ``out``; a checksum of them."""
    leaves = out.values() if isinstance(out, dict) else flat(out).values()
    total = 0
    for t in leaves:
        raw = t.reshape(-1).view(torch.uint8)
        total += int(raw[::4096].sum()) if raw.numel() else 0
    return total


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench_once(name, save, load, tensors, root: Path, res: dict, stats=None) -> None:
    """One save + cold load of one method, appended to ``res``."""
    path = root / "".join(c if c.isalnum() else "_" for c in name)
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    save(tensors, path)
    res["save"].append(time.perf_counter() - t0)
    if stats is not None:
        res["blocking"].append(stats["blocking"])
    res["bytes"].append(disk_bytes(path))
    drop_cache(path)
    t0 = time.perf_counter()
    out = load(tensors, path)
    res["load"].append(time.perf_counter() - t0)
    touch_pages(out)
    res["ready"].append(time.perf_counter() - t0)
    del out
    gc.collect()  # free this method's tensors now, not inside the next method's timing
    shutil.rmtree(path, ignore_errors=True)
    print(
        f"  {name:<28} save {res['save'][-1]:6.2f} s  load {res['load'][-1]:6.2f} s"
        f"  ready {res['ready'][-1]:6.2f} s",
        flush=True,
    )


def paired_ratio(times: list[float], ref: list[float] | None) -> str:
    """The median of the per-round ratios: both sides of each ratio ran in the same round,
    so a slow round of the virtual disk slows both instead of one median."""
    if not ref:
        return "-"
    ratios = [t / r for t, r in zip(times, ref, strict=True)]
    return f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})"


def load_rounds(methods: dict, tensors, root: Path, rounds: int) -> None:
    """The resume case: every checkpoint written once, up front, then only cold loads
    (round ``r`` starts at method ``r``, so no method always follows the same one). Loads
    right after a save read differently on this VM (the host's cache and writeback)."""
    paths = {}
    for name, (save, _, _) in methods.items():
        paths[name] = root / ("loads_" + "".join(c if c.isalnum() else "_" for c in name))
        shutil.rmtree(paths[name], ignore_errors=True)
        save(tensors, paths[name])
    ready: dict = {n: [] for n in methods}
    names = list(methods)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            drop_cache(paths[name])
            t0 = time.perf_counter()
            out = methods[name][1](tensors, paths[name])
            touch_pages(out)
            ready[name].append(time.perf_counter() - t0)
            del out
            gc.collect()
        print(f"round {r + 1}/{rounds}: " + "  ".join(f"{n} {v[-1]:.2f}" for n, v in ready.items()))
    print("\n| method | ready s (median) | ready / safetensors, paired |\n|---|---:|---:|")
    for name, times in ready.items():
        ratio = paired_ratio(times, ready.get("safetensors"))
        print(f"| {name} | {statistics.median(times):.2f} | {ratio} |")
    for p in paths.values():
        shutil.rmtree(p, ignore_errors=True)


def medians(res: dict) -> dict:
    return {k: statistics.median(v) for k, v in res.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ckpt_bench"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12, help="fewer for a quick smoke run")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--codecs", nargs="*", default=[], help="extra ftrain rows, e.g. zstd")
    ap.add_argument("--bf16", action="store_true", help="store every float tensor as bf16")
    ap.add_argument(
        "--load-rounds",
        type=int,
        default=0,
        help="instead: save each method once, then this many rounds of cold loads only",
    )

    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    state = gpt2_adamw_state(n_layer=args.layers)
    if args.bf16:
        state = state.apply(lambda t: t.bfloat16() if t.is_floating_point() else t)
    tensors = flat(state)
    gb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9
    print(f"state: {len(tensors)} tensors, {gb:.2f} GB; reps={args.reps}", flush=True)
    fs_save, fs_load, fs_stats = ftrain_methods(state, async_save=False)
    fa_save, fa_load, fa_stats = ftrain_methods(state, async_save=True)
    methods = {
        "raw O_DIRECT (ceiling)": (odirect_save, odirect_load, None),
        "raw file/tensor + fsync": (raw_save, raw_load, None),
        "torch.save / load": (torch_save, torch_load, None),
        "safetensors": (st_save, st_load, None),
        "DCP FileSystemWriter": (dcp_save, dcp_load, None),
        "ftrain sync": (fs_save, fs_load, fs_stats),
        "ftrain async": (fa_save, fa_load, fa_stats),
    }
    for codec in args.codecs:
        methods[f"ftrain sync {codec}"] = ftrain_methods(state, False, codec)
    methods["ftrain sync, mmap restore"] = ftrain_methods(state, False, mapped=True)
    methods = {n: m for n, m in methods.items() if not args.only or any(o in n for o in args.only)}
    raw: dict = {
        n: {k: [] for k in ("save", "load", "ready", "blocking", "bytes")} for n in methods
    }
    if args.load_rounds:
        return load_rounds(methods, tensors, args.dir, args.load_rounds)
    for rep in range(args.reps):  # interleaved: every method once per round
        print(f"round {rep + 1}/{args.reps}", flush=True)
        for name, (s, lo, stt) in methods.items():
            bench_once(name, s, lo, tensors, args.dir, raw[name], stt)
    results = {n: medians(r) for n, r in raw.items()}
    print(
        "\n| method | save s | load s | ready s | size GB | save / torch.save | save / O_DIRECT"
        " | load / safetensors | ready / safetensors | ready / safetensors, paired"
        " | load / O_DIRECT |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ref = {
        k: results.get(n)
        for k, n in [
            ("ts", "torch.save / load"),
            ("st", "safetensors"),
            ("od", "raw O_DIRECT (ceiling)"),
        ]
    }
    for name, r in results.items():
        cells = [f"{r[k]:.2f}" for k in ("save", "load", "ready")] + [f"{r['bytes'] / 1e9:.3f}"]
        pairs = [("ts", "save"), ("od", "save"), ("st", "load"), ("st", "ready"), ("od", "load")]
        for key, field in pairs:
            cells.append(f"{r[field] / ref[key][field]:.2f}×" if ref[key] else "-")
        cells.insert(-1, paired_ratio(raw[name]["ready"], raw.get("safetensors", {}).get("ready")))
        extra = f" (blocking {r['blocking'] * 1e3:.1f} ms)" if "blocking" in r else ""
        print(f"| {name}{extra} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
