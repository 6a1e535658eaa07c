"""Step overhead: ftrain's pure step vs an idiomatic imperative PyTorch loop.

GPT-2 tiny and GPT-2 small (vocab 256, dropout 0 so both loops compute the same thing)
trained for the same steps on the same token batches by:

- ``imperative``: ``nn.Module`` + ``torch.optim.AdamW(foreach=True)`` +
  ``zero_grad(set_to_none=True)`` + ``clip_grad_norm_(..., 1.0, foreach=True)``;
- ``pure``: ``ftrain.make_step`` (out of place; the input state stays intact);
- ``donate``: ``make_step(..., donate=True)`` (in place, JAX's ``donate_argnums``);
- ``compile``: the pure step with ``torch.compile`` on the loss function (model forward).

For the ftrain variants the module is only a function: after ``init_state`` copies its
weights into the state, the module's own weights are released (``model.to("meta")``), as
an ftrain user does; ``pure+module`` keeps them to show what they cost.

Every variant runs in a fresh subprocess (so peak RSS, ``VmHWM``, is its own), repetitions
are interleaved across variants (the machine is shared and noisy), and the table reports
medians and ratios against ``imperative``. The final parameters of ``pure`` are checked
against ``imperative`` (max abs difference ≤ 1e-5).

    .venv/bin/python benchmarks/step_overhead.py                 # both models, ~8 min
    .venv/bin/python benchmarks/step_overhead.py --models tiny --reps 3
    .venv/bin/python benchmarks/step_overhead.py --paired --reps 1  # time only, 1 process
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # model -> (batch, seq, warmup steps, timed steps)
    "tiny": (8, 64, 5, 40),
    "small": (1, 128, 2, 8),
}
PAIRED_STEPS = {"tiny": 200, "small": 12}  # timed steps per variant with --paired
VARIANTS = ("imperative", "pure", "pure+module", "donate", "compile")
LR, CLIP, WD = 1e-3, 1.0, 0.01


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _config(model: str):
    from ftrain.recipes.gpt2 import GPTConfig

    if model == "tiny":
        return GPTConfig.tiny(dropout=0.0)
    return GPTConfig.gpt2(dropout=0.0, vocab_size=256)


def _batches(model: str, n: int) -> list[dict[str, torch.Tensor]]:
    b, t, _, _ = SHAPES[model]
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        tok = torch.randint(0, 256, (b, t + 1), generator=g)
        out.append({"x": tok[:, :-1].contiguous(), "y": tok[:, 1:].contiguous()})
    return out


def _imperative(model, batches):
    from ftrain.recipes.gpt2 import lm_loss

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)
    model.train()

    def step(batch):
        loss, _ = lm_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def final():
        return {n: p.detach() for n, p in model.named_parameters()}

    return step, final


def _ftrain(model, batches, variant):
    import ftrain
    from ftrain.recipes.gpt2 import lm_loss
    from ftrain.state.tree import flatten, path_str

    tx = ftrain.optim.adamw(LR, weight_decay=WD)
    state = ftrain.init_state(model, tx, seed=0)
    if variant != "pure+module":
        model.to("meta")  # the module is only a function now; the state owns the weights
    loss_fn = lm_loss
    if variant == "compile":
        loss_fn = torch.compile(lm_loss)
    step_fn = ftrain.make_step(model, loss_fn, tx, clip=CLIP, donate=variant == "donate")
    box = [state]

    def step(batch):
        box[0], metrics = step_fn(box[0], batch)
        return metrics["loss"]

    def final():
        keys, leaves = flatten(box[0]["params"])
        return {path_str(k): t for k, t in zip(keys, leaves, strict=True)}

    return step, final


def worker(args) -> None:
    """One variant, one process: time each step, read the peak RSS, save final params."""
    from ftrain.recipes.gpt2 import GPT

    torch.set_num_threads(args.threads)
    _, _, warmup, steps = SHAPES[args.model]
    batches = _batches(args.model, warmup + steps)
    rss_start = _status_kib("VmRSS")
    model = GPT(_config(args.model), generator=torch.Generator().manual_seed(0))
    if args.variant == "imperative":
        step, final = _imperative(model, batches)
    else:
        step, final = _ftrain(model, batches, args.variant)
    rss_ready = _status_kib("VmRSS")
    times = []
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        loss = step(batch)
        float(loss.detach())  # the imperative loop's usual per-step logging sync
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    params = {k: v.detach().clone() for k, v in final().items()}
    if args.params_out:
        torch.save(params, args.params_out)
    print(
        json.dumps(
            {
                "variant": args.variant,
                "model": args.model,
                "step_s": times,
                "rss_start_kib": rss_start,
                "rss_ready_kib": rss_ready,
                "hwm_kib": _status_kib("VmHWM"),
                "loss": float(loss),
            }
        )
    )


def paired(args) -> None:
    """All variants in one process, their steps interleaved round-robin (time only).

    Noise from other jobs then hits every variant alike, so per-step ratios are far steadier
    than across processes; peak RSS is meaningless here (the models share one process).
    """
    from ftrain.recipes.gpt2 import GPT

    torch.set_num_threads(args.threads)
    warmup, steps = SHAPES[args.model][2], PAIRED_STEPS[args.model]
    batches = _batches(args.model, warmup + steps)
    names = [v for v in args.variants.split(",") if v not in ("pure+module", "compile")]
    runners = {}
    for v in names:
        model = GPT(_config(args.model), generator=torch.Generator().manual_seed(0))
        runners[v] = (
            _imperative(model, batches)[0] if v == "imperative" else _ftrain(model, batches, v)[0]
        )
    times: dict[str, list[float]] = {v: [] for v in names}
    for i, batch in enumerate(batches):
        order = names[i % len(names) :] + names[: i % len(names)]
        for v in order:
            t0 = time.perf_counter()
            float(runners[v](batch).detach())
            if i >= warmup:
                times[v].append(time.perf_counter() - t0)
    base = statistics.median(times["imperative"])
    print(f"\n### GPT-2 {args.model}, one process, steps interleaved ({steps} timed each)\n")
    print("| variant | ms/step | time × | paired ratio (median of per-step ratios) |")
    print("|---|---:|---:|---:|")
    for v in names:
        med = statistics.median(times[v])
        pair = statistics.median(a / b for a, b in zip(times[v], times["imperative"], strict=True))
        print(f"| {v} | {med * 1e3:,.1f} | {med / base:.3f}× | {pair:.3f}× |")


def _run_worker(variant: str, model: str, threads: int, params_out: str | None) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--model", model]
    cmd += ["--threads", str(threads)]
    if params_out:
        cmd += ["--params-out", params_out]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"variant": variant, "error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _max_diff(a_path: str, b_path: str) -> float:
    a = torch.load(a_path, weights_only=True)
    b = torch.load(b_path, weights_only=True)
    if set(a) != set(b):
        names = sorted(set(a) ^ set(b))[:3]
        raise SystemExit(f"parameter names differ between variants: {names}")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _row(name: str, runs: list[dict], base: dict | None) -> tuple[str, dict]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return f"| {name} | failed: {runs[0]['error']} | | | | | |", {}
    step = statistics.median(statistics.median(r["step_s"]) for r in ok)
    hwm = statistics.median(r["hwm_kib"] for r in ok) / 1024
    grow = statistics.median(r["hwm_kib"] - r["rss_start_kib"] for r in ok) / 1024
    stats = {"step": step, "hwm": hwm, "grow": grow}
    ratio = (
        (f"{step / base['step']:.3f}×", f"{hwm / base['hwm']:.3f}×", f"{grow / base['grow']:.3f}×")
        if base
        else ("1.000×", "1.000×", "1.000×")
    )
    line = (
        f"| {name} | {step * 1e3:,.1f} | {ratio[0]} | {hwm:,.0f} | {ratio[1]} | "
        f"{grow:,.0f} | {ratio[2]} |"
    )
    return line, stats


def main(args) -> None:
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, threads={args.threads}")
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            b, t, warmup, steps = SHAPES[model]
            runs: dict[str, list[dict]] = {v: [] for v in variants}
            for rep in range(args.reps):
                order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
                for v in order:  # rotate the order so no variant always runs first
                    out = str(Path(tmp) / f"{model}-{v}.pt") if rep == 0 else None
                    res = _run_worker(v, model, args.threads, out)
                    runs[v].append(res)
                    med = statistics.median(res["step_s"]) * 1e3 if "step_s" in res else None
                    print(
                        f"  {model} rep {rep} {v}: {med and f'{med:.1f} ms'} {res.get('error', '')}"
                    )
            print(
                f"\n### GPT-2 {model}: batch {b}×{t}, {steps} timed steps after {warmup} "
                f"warm-up, {args.reps} interleaved processes per variant\n"
            )
            print(
                "| variant | ms/step | time × | peak RSS MiB | RSS × | RSS growth MiB | growth × |"
            )
            print("|---|---:|---:|---:|---:|---:|---:|")
            base = None
            for v in variants:
                line, stats = _row(v, runs[v], base)
                if v == "imperative":
                    base = stats or None
                print(line)
            ref = Path(tmp) / f"{model}-imperative.pt"
            for v in variants[1:]:
                other = Path(tmp) / f"{model}-{v}.pt"
                if ref.exists() and other.exists():
                    print(f"\nmax |param({v}) - param(imperative)| = {_max_diff(ref, other):.3g}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--params-out", help=argparse.SUPPRESS)
    p.add_argument("--paired", action="store_true", help="one process, interleaved steps")
    a = p.parse_args()
    if a.paired:
        for m in a.models.split(","):
            a.model = m
            paired(a)
    elif a.worker:
        a.variant = a.worker
        worker(a)
    else:
        main(a)
