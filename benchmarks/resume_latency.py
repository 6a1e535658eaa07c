"""Resume latency of the CLI: process start -> first training step, resumed vs fresh.

For each model (``gpt2_tiny`` and GPT-2 small ``gpt2`` at batch 1 × 128 on the CPU) a run
is prepared once (a few steps, ending with a committed checkpoint). Then, interleaved,
``--reps`` times each:

- fresh: ``python -m ftrain ... resume=none`` in a new run directory, one step;
- resumed: ``python -m ftrain ...`` (resume=latest) on the prepared run, one more step.

The latency is the wall time from launching the process to the ``time`` of the first
``step`` record in ``metrics.jsonl`` (the step has completed then). Both variants share
one tokenized-data cache, prepared beforehand, so neither pays for tokenizing. The
resume record's ``restore_s`` (reading + verifying the checkpoint) is reported too.

    .venv/bin/python benchmarks/resume_latency.py --dir /tmp/resume_bench --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

CORPUS = str(Path(sysconfig.get_paths()["stdlib"]) / "json")  # a small real text corpus
COMMON = [
    "data=text",
    f"data.path={CORPUS}",
    "trainer.eval_every=0",
    "trainer.log_every=1",
    "run.plot=false",
]
MODELS = {
    "gpt2_tiny": ["model=gpt2_tiny", "model.block_size=64", "trainer.batch_size=8"],
    "gpt2": ["model=gpt2", "model.block_size=128", "trainer.batch_size=1"],
}
PREP_STEPS = 2


def _cli(run_dir: Path, cache: Path, *overrides: str) -> tuple[float, subprocess.CompletedProcess]:
    env = dict(os.environ, FTRAIN_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "ftrain", f"run.dir={run_dir}", *COMMON, *overrides]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return start, proc


def _records(run_dir: Path, since: float) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines if x.strip()]
    return [r for r in recs if r["time"] >= since]


def _latency(run_dir: Path, cache: Path, *overrides: str) -> tuple[float, float | None]:
    start, _ = _cli(run_dir, cache, *overrides)
    recs = _records(run_dir, start)
    first = next(r for r in recs if r["kind"] == "step")
    resume = next((r for r in recs if r["kind"] == "resume"), None)
    return first["time"] - start, (resume or {}).get("restore_s")


def main(args) -> None:
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    cache = root / "cache"
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    rows = []
    for model in args.models.split(","):
        over = MODELS[model]
        prepared = root / f"{model}-run"
        _cli(prepared, cache, *over, f"trainer.max_steps={PREP_STEPS}", "resume=none")
        fresh_s, resumed_s, restore_s = [], [], []
        for rep in range(args.reps):
            jobs = ["fresh", "resumed"] if rep % 2 == 0 else ["resumed", "fresh"]
            for job in jobs:
                if job == "fresh":
                    d = root / f"{model}-fresh-{rep}"
                    lat, _ = _latency(d, cache, *over, "trainer.max_steps=1", "resume=none")
                    fresh_s.append(lat)
                    shutil.rmtree(d, ignore_errors=True)
                else:
                    target = f"trainer.max_steps={PREP_STEPS + rep + 1}"
                    lat, rs = _latency(prepared, cache, *over, target)
                    resumed_s.append(lat)
                    restore_s.append(rs)
            print(f"  {model} rep {rep}: fresh {fresh_s[-1]:.2f} s, resumed {resumed_s[-1]:.2f} s")
        f, r = statistics.median(fresh_s), statistics.median(resumed_s)
        rs = [x for x in restore_s if x is not None]
        ckpt = max(
            (p for p in (prepared / "checkpoints").glob("step_*") if p.is_dir()), default=None
        )
        size = sum(x.stat().st_size for x in ckpt.rglob("*") if x.is_file()) if ckpt else 0
        rows.append(
            f"| {model} | {size / 1e6:,.1f} | {f:.2f} | {r:.2f} | {r / f:.3f}× | "
            f"{r - f:+.2f} | {statistics.median(rs) if rs else float('nan'):.3f} |"
        )
    print(f"\nlaunch -> first step completed, medians of {args.reps} interleaved runs each\n")
    print("| model | checkpoint MB | fresh s | resumed s | resumed / fresh | Δ s | restore_s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/resume_bench")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--reps", type=int, default=3)
    main(p.parse_args())
