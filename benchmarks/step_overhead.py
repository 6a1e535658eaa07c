"""Step overhead: ftrain's pure step vs an idiomatic imperative PyTorch loop, paired.

Time: every variant lives in **one process** and the variants take turns, round by
round (the order rotates each round), on the same batches, so noise from other jobs hits
all of them alike. A round is ``--steps`` steps of each variant; the figure of a variant
is the **median over rounds of its per-round ratio** to the imperative loop of that
round, next to its median ms/step. Warm-up steps (``--warmup``) run first and are not
timed; the compiled variants compile during warm-up and their compile time is reported
separately.

Variants (AdamW lr 1e-3, weight decay 0.01, clip 1.0 with torch's rule on both sides):

- ``imperative``: ``nn.Module`` + ``torch.optim.AdamW(foreach=True)`` +
  ``clip_grad_norm_(foreach=True)`` + ``zero_grad(set_to_none=True)``;
- ``pure``: ``ftrain.make_step`` (out of place; the input state stays intact);
- ``donate``: ``make_step(..., donate=True)``;
- ``compiled``: ``make_step(..., compile=True)`` (the whole step's tensor core compiled);
- ``compiled_donate`` (only when named in ``--variants``): the same with ``donate=True``;
- ``pure_fused``, ``donate_fused`` (only when named): ``pure`` / ``donate`` with
  ``adamw(..., fused=True)`` (Adam's moments and update in torch's fused kernel), and
  ``imperative_fused``: ``torch.optim.AdamW(fused=True)``, its fair baseline;
  ``pure_fused_clones``: ``pure_fused`` with the state buffer pool switched off
  (:mod:`ftrain.optim.buffers`: every copy a fresh clone, as before the pool);
  ``compiled_clones``: ``compiled`` with the pool off (the compiler allocates the new
  state each step, as before pooled destinations); ``compiled_cppwrapper``: ``compiled``
  with Inductor's C++ wrapper (``ftrain.compiled.CPP_WRAPPER = True``);
- ``imperative_compiled``: ``torch.compile(model)`` + a compiled ``optimizer.step`` (the
  PyTorch tutorial's recipe), clipping eager.

Workloads: ``mlp512`` (6 × Linear 512, batch 64), ``mlp1024`` (6 × 1024, batch 256),
``mlp2048`` (6 × 2048, batch 256), ``gpt2tiny`` (GPT-2 tiny, dropout 0, batch 8 × 64),
``gpt2micro`` (GPT-2 tiny's layers at width 8, batch 1 × 8: the fixed cost per step).
The final parameters of every variant are checked against ``imperative``.

On a shared machine (``--cpu-time``, with ``--threads 1``): the figure is the **thread
CPU time** of the round (``time.thread_time``: user + system time of the one thread that
runs every kernel, page faults included) instead of wall time, which also counts the
time spent waiting for a core another job holds. With one intra-op thread nothing runs
outside the measured thread (two OpenMP threads also stall on each other's core).

Memory (``--memory``): peak RSS (``VmHWM``) of a **fresh subprocess per variant**
training GPT-2 small (vocab 256, batch 1 × 128) for a few steps, as a ratio to the
imperative loop's.

    .venv/bin/python benchmarks/step_overhead.py                     # everything
    .venv/bin/python benchmarks/step_overhead.py --rounds 2 --steps 3 --only mlp512
    .venv/bin/python benchmarks/step_overhead.py --threads 1 --cpu-time  # a busy machine
    .venv/bin/python benchmarks/step_overhead.py --memory --only none  # memory only
    .venv/bin/python benchmarks/step_overhead.py --memory --only none --bucket-mb none
        # the same with tx.update on the whole tree (no buckets: the pre-bucketing step)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

LR, CLIP, WD = 1e-3, 1.0, 0.01
WORKLOADS = {  # name -> (kind, width or GPT size, batch)
    "mlp512": ("mlp", 512, 64),
    "mlp1024": ("mlp", 1024, 256),
    "mlp2048": ("mlp", 2048, 256),
    "gpt2tiny": ("gpt", "tiny", 8),
    # GPT-2 tiny's 52 leaves at width 8, one 8-token sequence: kernels cost next to
    # nothing, so the time is each loop's fixed Python and dispatch cost per step
    "gpt2micro": ("gpt", "micro", 1),
    # the memory target's model (86 M params, one 128-token sequence): ~0.5 s a step
    "gpt2small": ("gpt", "small", 1),
}
DEFAULT_WORKLOADS = [w for w in WORKLOADS if w != "gpt2small"]
# --variants also knows compiled_donate, pure_fused, donate_fused, imperative_fused
VARIANTS = ("imperative", "pure", "donate", "compiled", "imperative_compiled")
SEQ = {"tiny": 64, "small": 128, "micro": 8}


class MLP(nn.Module):
    """Six ``Linear(width, width)`` layers with GELU between them."""

    def __init__(self, width: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(6))
        with torch.no_grad():
            for p in self.parameters():  # seeded init: every variant starts identical
                p.copy_(torch.randn(p.shape, generator=g) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else nn.functional.gelu(layer(x))
        return x


def mlp_loss(model, batch):
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])


def gpt_loss(model, batch):
    from ftrain.recipes.gpt2 import lm_loss

    return lm_loss(model, batch)[0]


def make_model(workload: str) -> nn.Module:
    kind, size, _ = WORKLOADS.get(workload, ("gpt", workload, 1))
    if kind == "mlp":
        return MLP(size)
    from ftrain.recipes.gpt2 import GPT, GPTConfig

    if size == "tiny":
        cfg = GPTConfig.tiny(dropout=0.0)
    elif size == "micro":
        cfg = GPTConfig.tiny(dropout=0.0, n_embd=8, block_size=8)
    else:
        cfg = GPTConfig.gpt2(dropout=0.0, vocab_size=256)
    return GPT(cfg, generator=torch.Generator().manual_seed(0))


def make_batches(workload: str, n: int) -> list[dict[str, torch.Tensor]]:
    kind, size, batch = WORKLOADS.get(workload, ("gpt", workload, 1))
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        if kind == "mlp":
            x = torch.randn(batch, size, generator=g)
            out.append({"x": x, "y": torch.randn(batch, size, generator=g)})
        else:
            tok = torch.randint(0, 256, (batch, SEQ[size] + 1), generator=g)
            out.append({"x": tok[:, :-1].contiguous(), "y": tok[:, 1:].contiguous()})
    return out


# ----------------------------------------------------------------------------- variants


def imperative(model: nn.Module, loss_fn, compiled: bool = False, fused: bool = False):
    """``step(batch) -> loss`` and ``params() -> {name: tensor}`` of the imperative loop."""
    kernel = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, **kernel)
    forward = torch.compile(model) if compiled else model
    opt_step = torch.compile(opt.step) if compiled else opt.step
    model.train()

    def step(batch):
        loss = loss_fn(forward, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        opt_step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, lambda: {n: p.detach() for n, p in model.named_parameters()}


def functional(model: nn.Module, loss_fn, variant: str):
    """The same with ``ftrain.make_step``; the module is only a function afterwards."""
    import ftrain
    from ftrain.state.tree import flatten, path_str

    tx = ftrain.optim.chain(
        ftrain.optim.clip_by_global_norm_torch(CLIP),
        ftrain.optim.adamw(LR, weight_decay=WD, fused="_fused" in variant),
    )
    box = [ftrain.init_state(model, tx, seed=0)]
    model.to("meta")  # the state owns the weights now, as in ftrain use
    step_fn = ftrain.make_step(
        model,
        loss_fn,
        tx,
        donate="donate" in variant,
        compile=variant.startswith("compiled"),
    )

    def step(batch):
        box[0], metrics = step_fn(box[0], batch)
        return metrics["loss"]

    def params():
        keys, leaves = flatten(box[0]["params"])
        return {path_str(k): t for k, t in zip(keys, leaves, strict=True)}

    from ftrain import compiled
    from ftrain.optim import buffers

    if "_clones" in variant:  # the pure step's copies as plain clones, no pool
        step = _with(buffers, "POOLING", False, step)
    if "_cppwrapper" in variant:  # Inductor's C++ wrapper (read at the compile)
        step = _with(compiled, "CPP_WRAPPER", True, step)
    return step, params


def _with(module, name: str, value, step):
    """``step`` run with ``module.name = value`` (restored after each call)."""

    def switched(batch):
        before = getattr(module, name)
        setattr(module, name, value)
        try:
            return step(batch)
        finally:
            setattr(module, name, before)

    return switched


def build(variant: str, workload: str):
    model = make_model(workload)
    loss_fn = mlp_loss if WORKLOADS.get(workload, ("gpt",))[0] == "mlp" else gpt_loss
    if variant.startswith("imperative"):
        compiled, fused = variant == "imperative_compiled", variant == "imperative_fused"
        return imperative(model, loss_fn, compiled=compiled, fused=fused)
    return functional(model, loss_fn, variant)


# ----------------------------------------------------------------------------- time


def _run(step, batches, clock=time.perf_counter) -> float:
    """Seconds for these steps, with the usual per-step loss read (one host sync)."""
    t0 = clock()
    for batch in batches:
        float(step(batch).detach())
    return clock() - t0


def paired(workload: str, variants: list[str], args) -> dict:
    """Warm up every variant, then ``rounds`` rounds of ``steps`` steps each, interleaved."""
    n = args.warmup + args.rounds * args.steps
    batches = make_batches(workload, n)
    runners, params, compile_s = {}, {}, {}
    for v in variants:
        step, params[v] = build(v, workload)
        runners[v] = step
        compile_s[v] = _run(step, batches[:1])  # the first step compiles the compiled ones
        _run(step, batches[1 : args.warmup])
    times: dict[str, list[float]] = {v: [] for v in variants}
    faults: dict[str, list[float]] = {v: [] for v in variants}
    clock = time.thread_time if args.cpu_time else time.perf_counter
    for r in range(args.rounds):
        chunk = batches[args.warmup + r * args.steps : args.warmup + (r + 1) * args.steps]
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v in order:
            before = _minor_faults()
            times[v].append(_run(runners[v], chunk, clock) / args.steps)
            faults[v].append((_minor_faults() - before) / args.steps)
    return {
        "times": times,
        "faults": faults,
        "first_step_s": compile_s,
        "max_diff": _diffs(params, variants),
    }


def _minor_faults() -> int:
    """This process's minor page faults so far: fresh pages the allocator had to map (a
    step that reuses its buffers takes none; one whose memory glibc returned to the OS
    takes one per 4 KiB page it writes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _diffs(params: dict, variants: list[str]) -> dict[str, float]:
    if "imperative" not in params:
        return {}
    ref = params["imperative"]()
    out = {}
    for v in variants:
        mine = params[v]()
        out[v] = max(float((mine[k].float() - ref[k].float()).abs().max()) for k in ref)
    return out


def report(workload: str, res: dict, args) -> None:
    times = res["times"]
    base = times.get("imperative")
    kind, size, batch = WORKLOADS[workload]
    clock = "thread CPU time" if args.cpu_time else "wall time"
    print(
        f"\n### {workload} ({kind} {size}, batch {batch}): {args.rounds} rounds × "
        f"{args.steps} steps after {args.warmup} warm-up, torch.set_num_threads({args.threads}), "
        f"{clock}\n"
    )
    print(
        "| variant | ms/step (median) | × imperative (median of round ratios) | "
        "rounds' ratio range | first step s | max abs param diff | minor faults/step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for v, ts in times.items():
        ratios = [a / b for a, b in zip(ts, base, strict=True)] if base else [float("nan")]
        print(
            f"| {v} | {statistics.median(ts) * 1e3:,.2f} | {statistics.median(ratios):.3f}× | "
            f"{min(ratios):.3f}–{max(ratios):.3f} | {res['first_step_s'][v]:.2f} | "
            f"{res['max_diff'].get(v, float('nan')):.2g} | "
            f"{statistics.median(res['faults'][v]):,.0f} |"
        )


# ----------------------------------------------------------------------------- memory


def set_bucket(mb: str | None) -> None:
    """``--bucket-mb``: the eager step's update bucket (``none``: the whole tree at once)."""
    if mb is None:
        return
    from ftrain import apply

    apply.BUCKET_BYTES = None if mb == "none" else int(float(mb) * 2**20)


def memory_worker(variant: str, model: str, steps: int) -> None:
    """One variant in this (fresh) process: train a few steps, print the peak RSS."""
    step, _ = build(variant, model)
    _run(step, make_batches(model, steps))
    print(json.dumps({"variant": variant, "model": model, "peak_rss_kib": _peak_rss_kib()}))


def _peak_rss_kib() -> int:
    """This process's own peak RSS. ``ru_maxrss`` is not it: Linux carries the parent's
    RSS at fork across ``exec`` into it, so every worker reported the parent's 4.5 GB;
    ``VmHWM`` belongs to this process's address space alone."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def memory(variants: list[str], args) -> None:
    rows = {}
    for v in variants:
        cmd = [sys.executable, __file__, "--memory-worker", v, "--memory-model", args.memory_model]
        cmd += ["--threads", str(args.threads), "--memory-steps", str(args.memory_steps)]
        cmd += ["--bucket-mb", args.bucket_mb] if args.bucket_mb else []
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            rows[v] = None
            print(f"  {v}: failed: {proc.stderr.strip().splitlines()[-1:]}")
            continue
        rows[v] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_kib"] / 1024
    base = rows.get("imperative")
    print(f"\n### peak RSS, GPT-2 {args.memory_model}, a fresh process per variant\n")
    print("| variant | peak RSS MiB | × imperative |")
    print("|---|---:|---:|")
    for v, mib in rows.items():
        ratio = f"{mib / base:.3f}×" if mib and base else "n/a"
        print(f"| {v} | {mib:,.0f} | {ratio} |" if mib else f"| {v} | failed | |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30, help="steps per variant per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--only", default=",".join(DEFAULT_WORKLOADS), help="workloads, or 'none'")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--cpu-time", action="store_true", help="time rounds by thread CPU time (use --threads 1)"
    )
    p.add_argument("--memory", action="store_true", help="also peak RSS on GPT-2 small")
    p.add_argument("--memory-model", default="small")
    p.add_argument("--memory-steps", type=int, default=3)
    p.add_argument("--memory-worker", help=argparse.SUPPRESS)
    p.add_argument("--bucket-mb", help="update bucket MiB of the eager step ('none': whole tree)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    set_bucket(args.bucket_mb)
    variants = [v for v in args.variants.split(",") if v]
    if args.memory_worker:
        return memory_worker(args.memory_worker, args.memory_model, args.memory_steps)
    if args.cpu_time and args.threads != 1:
        p.error("--cpu-time measures the calling thread: use it with --threads 1")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}, "
        f"load average {load}"
    )
    for workload in [w for w in args.only.split(",") if w and w != "none"]:
        report(workload, paired(workload, variants, args), args)
    if args.memory:
        memory(variants, args)


if __name__ == "__main__":
    main()
