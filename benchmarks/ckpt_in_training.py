"""Checkpoint cost inside training: GPT-2 step intervals with and without a save in them.

A mid-sized GPT-2 (default 4 layers, 384 wide, context 128, vocab 256: ~7.2M params,
~87 MB of params + AdamW moments) is trained with ``ftrain.make_step`` in intervals of
``--every`` steps that alternate between no save and a save (``CheckpointManager``,
``LatestN(2)``) of the state at the interval's start, sync or async. A save interval ends
with ``manager.wait()``, so a write longer than the interval is charged to it.

The machine is shared and noisy, so the design is paired: each process compares its save
intervals with its own neighbouring plain intervals (medians), and processes for the
variants are interleaved. "overhead per save" = median(save interval) / median(plain
interval) - 1 is what checkpointing at that interval costs in throughput (target: ≤ 2 %
async at an interval where sync costs ≥ 20 %). "CPU in save()" is the process's CPU time
(every thread) during the ``save`` call: for a sync save, what the whole write costs.

The second table measures each save's cost from step times instead of interval totals:
its blocking plus what the steps its write overlapped (and the one after, and ``--tail``
more) took beyond the process's median plain step. Only those few steps carry noise, so
the cost per save is resolved where whole-interval ratios are not (their noise, ±3 % of an
interval, is larger than the 2 % target at long intervals); divided by an interval it is
the overhead there, as long as a write fits in the interval.

    .venv/bin/python benchmarks/ckpt_in_training.py --dir /tmp/ckpt_train --reps 3
    .venv/bin/python benchmarks/ckpt_in_training.py --variants sync,async,async:1 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

VARIANTS = ("sync", "async")  # "sync:N"/"async:N": N I/O threads (default 4)


def _nice_writer(manager) -> None:
    """Run the background writer (and the I/O threads it starts) at the lowest CPU priority."""
    run = manager._run_background

    def nice_run(*a):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        run(*a)

    manager._run_background = nice_run


def worker(args) -> None:
    import ftrain
    from ftrain.ckpt import CheckpointManager
    from ftrain.ckpt.policies import LatestN
    from ftrain.recipes.gpt2 import GPT, GPTConfig, lm_loss
    from ftrain.state import is_pinned

    torch.set_num_threads(args.threads)
    cfg = GPTConfig(block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
    model = GPT(cfg, generator=torch.Generator().manual_seed(0))
    tx = ftrain.optim.chain(
        ftrain.optim.clip_by_global_norm(1.0), ftrain.optim.adamw(3e-4, weight_decay=0.1)
    )
    state = ftrain.init_state(model, tx, seed=0)
    model.to("meta")  # the state owns the weights
    step = ftrain.make_step(model, lm_loss, tx)
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, 256, (args.steps + 2, args.batch, args.seq + 1), generator=g)
    batches = [{"x": t[:, :-1].contiguous(), "y": t[:, 1:].contiguous()} for t in tok]
    run_dir = Path(args.dir) / f"{args.worker}-{os.getpid()}"
    manager = None
    if args.worker != "none":
        mode, _, workers = args.worker.partition(":")  # e.g. "async:1": 1 I/O thread
        manager = CheckpointManager(
            run_dir,
            keep_policy=LatestN(2),
            async_save=mode == "async",
            **({"io_workers": int(workers.removesuffix("n"))} if workers else {}),
        )
        if workers.endswith("n"):  # experiment: writer threads at nice 19 ("async:4n")
            _nice_writer(manager)
    for b in batches[:2]:  # warm-up (allocator, first-call paths); not timed
        state, metrics = step(state, b)
    plain, saving, blocking, cpu = [], [], [], []
    plain_steps, windows = [], []  # step times of plain intervals; of each save's window
    it = iter(batches[2:])
    for block in range(args.steps // args.every):
        with_save = manager is not None and block % 2 == 1
        t0 = time.perf_counter()
        saved = state
        if with_save:  # the save of the state at this interval's start
            before = _cpu_s()
            manager.save(state, metrics={"loss": float(metrics["loss"])})
            blocking.append(time.perf_counter() - t0)
            cpu.append(_cpu_s() - before)  # sync: the whole write's CPU; async: its call's
        times, writing = [], []
        for _ in range(args.every):
            t = time.perf_counter()
            state, metrics = step(state, next(it))
            float(metrics["loss"])
            times.append(time.perf_counter() - t)
            writing.append(with_save and is_pinned(saved))  # the write outlived this step
        if with_save:
            windows.append(_window(times, writing, args.tail))
        else:
            plain_steps += times
        if with_save:
            manager.wait()  # a write longer than the interval costs its rest here
        (saving if with_save else plain).append(time.perf_counter() - t0)
    if manager is not None:
        manager.close()
    nbytes = sum(t.numel() * t.element_size() for t in state.flatten_keys().values())
    shutil.rmtree(run_dir, ignore_errors=True)
    print(
        json.dumps(
            {
                "variant": args.worker,
                "plain_s": plain,
                "saving_s": saving,
                "blocking_s": blocking,
                "save_cpu_s": cpu,
                "plain_step_s": plain_steps,
                "window_step_s": windows,
                "state_mb": nbytes / 1e6,
                "params": sum(p.numel() for p in state["params"].flatten_keys().values()),
            }
        )
    )


def _window(times: list[float], writing: list[bool], tail: int) -> list[float]:
    """The step times of a save's window: every step the write overlapped, the first one
    after it ended, and ``tail`` more (a late effect of the write, e.g. cache pressure)."""
    last = max((i for i, w in enumerate(writing) if w), default=-1)
    return times[: last + 2 + tail]


def _cpu_s() -> float:
    """This process's user + system CPU seconds so far (every thread)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _run(variant: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant]
    names = ("dir", "steps", "every", "batch", "seq", "layers", "heads", "width", "threads", "tail")
    for name in names:
        cmd += [f"--{name}", str(getattr(args, name))]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(args) -> None:
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    variants = tuple(args.variants.split(","))
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for rep in range(args.reps):
        k = rep % len(variants)
        order = variants[k:] + variants[:k]
        for v in order:
            r = _run(v, args)
            runs[v].append(r)
            print(f"  rep {rep} {v}: done", flush=True)
    first = next(iter(runs.values()))[0]
    print(
        f"\nGPT {args.layers}×{args.width}, context {args.seq}, batch {args.batch}: "
        f"{first['params'] / 1e6:.2f}M params, state {first['state_mb']:.0f} MB; intervals of "
        f"{args.every} steps, {args.steps // args.every} per process alternating without/with a "
        f"save, {args.reps} processes per variant, {args.threads} torch threads\n"
    )
    print(
        "| checkpoints | interval s, no save | interval s, with save | overhead per save "
        "| blocking per save ms | CPU in save() ms |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for v in variants:
        plain = statistics.median(x for r in runs[v] for x in r["plain_s"])
        saving = [x for r in runs[v] for x in r["saving_s"]]
        block = [b for r in runs[v] for b in r["blocking_s"]]
        cpu = [c for r in runs[v] for c in r["save_cpu_s"]]
        if not saving:
            print(f"| {v} | {plain:.3f} | – | – | – | – |")
            continue
        # paired: each process's save intervals against its own neighbouring plain ones
        ratios = [
            statistics.median(r["saving_s"]) / statistics.median(r["plain_s"]) for r in runs[v]
        ]
        print(
            f"| {v} | {plain:.3f} | {statistics.median(saving):.3f} | "
            f"{(statistics.median(ratios) - 1) * 100:+.1f} % | {statistics.median(block) * 1e3:.1f} | "
            f"{statistics.median(cpu) * 1e3:.0f} |"
        )
    _report_windows(runs, variants, args)


def _save_costs(run: dict) -> list[float]:
    """Seconds of training each save cost: its blocking plus what the steps in its window
    took beyond this process's median plain step (paired: the same process, neighbouring
    intervals). Only the few steps a write overlaps carry its noise, not a whole interval."""
    base = statistics.median(run["plain_step_s"])
    return [
        b + sum(t - base for t in w)
        for b, w in zip(run["blocking_s"], run["window_step_s"], strict=True)
    ]


def _report_windows(runs: dict, variants: tuple, args) -> None:
    """The per-save cost from step times, and what it is at ``--every`` and at the Young/Daly
    interval the advisor gives (``advisor.advised_every_steps``' rule, a ``--mtbf-h`` MTBF,
    at least one whole write) with C = that measured cost (the advisor's C for async saves,
    ``RunStats.cost_s``) and with C = the blocking time alone (its C before the stall was
    measured)."""
    from ftrain.ckpt.advisor import young_daly

    print(
        f"\nPer save, from step times (window: the steps a write overlaps + 1 + {args.tail}; "
        f"MTBF {args.mtbf_h:g} h)\n"
    )
    print(
        "| checkpoints | saves | step ms | cost per save ms (q1–q3) | window steps "
        f"| at {args.every} steps | advisor's interval s | at it | blocking-only interval s "
        "| at it |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for v in variants:
        done = [r for r in runs[v] if r["blocking_s"]]
        if not done:
            continue
        costs = sorted(c for r in done for c in _save_costs(r))
        step_s = statistics.median(t for r in done for t in r["plain_step_s"])
        window = statistics.median(len(w) for r in done for w in r["window_step_s"])
        writes = statistics.median(sum(w) for r in done for w in r["window_step_s"])
        block = statistics.median(b for r in done for b in r["blocking_s"])
        cost = statistics.median(costs)
        mtbf = args.mtbf_h * 3600
        tau, tau_block = (max(young_daly(c, mtbf), writes) for c in (max(cost, block), block))
        q1, q3 = costs[len(costs) // 4], costs[(3 * len(costs)) // 4]
        at = cost / (args.every * step_s) * 100  # valid while a write fits in the interval
        print(
            f"| {v} | {len(costs)} | {step_s * 1e3:.0f} | {cost * 1e3:.0f} ({q1 * 1e3:.0f}–"
            f"{q3 * 1e3:.0f}) | {window:g} | {at:+.1f} % | {tau:.1f} | {cost / tau * 100:+.2f} % "
            f"| {tau_block:.1f} | {cost / tau_block * 100:+.2f} % |"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/ckpt_train")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tail", type=int, default=2, help="steps counted after a write ends")
    p.add_argument("--mtbf-h", type=float, default=6.0, help="MTBF for the advisor's interval")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
    else:
        main(a)
