"""Memory per rank of a sharded training state: dist.shard none / optimizer / full at N ranks.

    python benchmarks/sharding_memory.py                 # GPT-2 small, N = 2 and 4, gloo CPU
    python benchmarks/sharding_memory.py --ranks 2 --model tiny --steps 2

For each (N, mode) one torchrun launch (a fresh process per rank, so each peak is its own)
trains a few AdamW steps of the GPT-2 recipe and reports, per rank: the bytes the state
holds at rest (params, optimizer state: a DTensor counts its local rows only) and the
process's peak RSS (VmHWM; includes the model, the data, and under ``full`` the whole
params gathered for each step). Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(mode: str, model_name: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import ftrain
    from ftrain import optim, sharding
    from ftrain.recipes.gpt2 import GPT, GPTConfig, lm_loss

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = GPTConfig.gpt2(block_size=64) if model_name == "small" else GPTConfig.tiny()
    model = GPT(shape, generator=torch.Generator().manual_seed(0))
    tx = optim.adamw(1e-4, weight_decay=0.1, mask=optim.masks.ndim_at_least(2))
    step = ftrain.make_step(model, lm_loss, tx, dp=True, shard=mode)
    state = ftrain.init_state(model, tx, seed=0)
    if step.sharder is not None:
        state = sharding.shard_state(state, step.sharder)
    for p in model.parameters():  # the module is only a function now: drop its own copy
        p.data = torch.empty(0)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        tokens = torch.randint(0, 256, (1, shape.block_size + 1), generator=g)
        state, _ = step(state, {"x": tokens[:, :-1], "y": tokens[:, 1:]})
    report = {
        "rank": rank,
        "world": world,
        "mode": mode,
        "param_bytes": sharding.local_bytes(state["params"]),
        "opt_bytes": sharding.local_bytes(state["opt"]),
        "peak_rss": _peak_rss(),
    }
    with open(f"{out}.{rank}", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def launch(n: int, mode: str, model: str, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "r")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={n}",
            "--standalone",
        ]
        cmd += [__file__, "--worker", mode, "--model", model, "--steps", str(steps), "--out", out]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"{n} ranks, shard={mode} failed:\n{proc.stderr[-3000:]}")
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(n)]


def _mb(b: float) -> str:
    return f"{b / 2**20:,.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--model", choices=["small", "tiny"], default="small")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--worker")
    p.add_argument("--out")
    ns = p.parse_args()
    if ns.worker:
        return worker(ns.worker, ns.model, ns.steps, ns.out)
    print(
        "| N | dist.shard | params MB/rank | optimizer MB/rank | params+opt vs none | peak RSS MB/rank (max) |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    for n in ns.ranks:
        base = None
        for mode in ("none", "optimizer", "full"):
            rows = launch(n, mode, ns.model, ns.steps)
            params = max(r["param_bytes"] for r in rows)
            opt = max(r["opt_bytes"] for r in rows)
            base = base or (params, opt)
            ratio = (params + opt) / sum(base)
            rss = max(r["peak_rss"] for r in rows)
            print(
                f"| {n} | {mode} | {_mb(params)} | {_mb(opt)} ({opt / base[1]:.2f}x) | {ratio:.2f}x | {_mb(rss)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
