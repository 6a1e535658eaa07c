"""Incremental checkpoints: LoRA fine-tuning saves vs full saves, and full training.

LoRA rows: GPT-2 small (124M, vocab 50304; ``--size medium``: 355M) with rank-8 LoRA on
every ``c_attn`` (``ftrain.lora.apply_lora``), AdamW on the adapters and ``optim.frozen()``
on the rest (``optim.multi_transform``), real steps (``ftrain.make_step``, one 1x64-token
batch) between saves, so the frozen base is carried by the step itself as the same tensor
objects. Each round runs one step and saves its state twice, durably (sync), in
alternating order: with ``incremental=False`` (a full save, the previous behaviour) and
with the default incremental manager (the base hard-linked from its previous step).
Every step is kept; retention's delete of one step is timed afterwards on its own. ``du``
of the incremental directory's two newest steps (hard links counted once) is compared
with one full step plus the adapters and their optimizer state.

Full-training rows: the GPT-2 + AdamW state of ``benchmarks/ckpt_io.py`` (1.49 GB), every
leaf a new tensor in every round (nothing can be reused), saved by the incremental and the
non-incremental manager in alternating order after one warm-up save each, with paired
ratios per round; plus the incremental machinery's own work timed on its own (the
identity check in ``save()``, the record after the commit, and for scale the checks of
the same state if every leaf were reused). Medians over ``--reps`` rounds; results go to
docs/benchmarks.md ("Incremental checkpoints").

    .venv/bin/python -W ignore benchmarks/ckpt_incremental.py --dir /tmp/ckpt_incr --reps 7
    .venv/bin/python -W ignore benchmarks/ckpt_incremental.py --reps 5 --size medium \
        --skip-full-training
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch

# the state of the checkpoint I/O benchmark (this script's directory is on sys.path)
from ckpt_io import gpt2_adamw_state
from tensordict import TensorDict

import ftrain
from ftrain import lora, optim
from ftrain.ckpt import CheckpointManager, LatestN
from ftrain.ckpt import commit as protocol
from ftrain.ckpt import incremental as incr
from ftrain.ckpt.store import groups_and_arrays
from ftrain.recipes.gpt2 import GPT, GPTConfig, lm_loss

SIZES = {"small": {}, "medium": {"n_layer": 24, "n_head": 16, "n_embd": 1024}}


def lora_run(vocab: int, size: str = "small"):
    """``(state, step, batch)`` of a rank-8 LoRA fine-tune on GPT-2's c_attn."""
    g = torch.Generator().manual_seed(0)
    model = GPT(GPTConfig.gpt2(vocab_size=vocab, dropout=0.0, **SIZES[size]), generator=g)
    lora.apply_lora(model, rank=8, alpha=16, targets=("c_attn",), generator=g)
    tx = optim.multi_transform(
        {"lora": optim.adamw(1e-3), "frozen": optim.frozen()},
        {"lora": lora.is_adapter, "frozen": None},
    )
    state = ftrain.init_state(model, tx, seed=0)
    tokens = torch.randint(0, vocab, (1, 65), generator=g)
    return state, ftrain.make_step(model, lm_loss, tx), {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def du(*paths: Path) -> int:
    """Bytes on disk of ``paths`` together, hard links counted once (``du -scb``)."""
    out = subprocess.run(["du", "-scb", *map(str, paths)], capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1].split()[0])


SETTLE_S = 1.0


def timed_save(m: CheckpointManager, state: TensorDict) -> dict:
    """One durable save, timed, from a settled disk: the VM's disk flush (``syncfs``) also
    waits for the host to write back whatever the previous save left in its cache, so
    without a pause each save would pay for the one before it (measured: incremental saves
    right after a 500 MB full save took 0.12-0.36 s, alone 0.10-0.14 s)."""
    os.sync()
    time.sleep(SETTLE_S)
    t0 = time.perf_counter()
    m.save(state, force=True)
    seconds = time.perf_counter() - t0
    save = m.metadata(int(state["step"]))["save"]
    return {"seconds": seconds, "written": save["written_bytes"], "linked": save["linked_bytes"]}


def adapter_bytes(state: TensorDict) -> int:
    """The adapters and their optimizer state (what changes in a LoRA step)."""
    _, leaves = groups_and_arrays(state)
    return sum(t.numel() * t.element_size() for k, t in leaves.items() if "lora" in k)


def bench_lora(root: Path, reps: int, vocab: int, size: str) -> dict:
    """Saves of every step (kept: retention's deletes are timed on their own, after)."""
    state, step, batch = lora_run(vocab, size)
    full = CheckpointManager(root / "full", async_save=False, incremental=False)
    inc = CheckpointManager(root / "incr", async_save=False)
    res: dict = {"full": [], "incr": [], "first": None}
    for rep in range(reps + 1):
        state, _ = step(state, batch)
        order = [("full", full), ("incr", inc)] if rep % 2 else [("incr", inc), ("full", full)]
        for name, m in order:
            r = timed_save(m, state)
            if name == "incr" and rep == 0:
                res["first"] = r  # the first save has nothing to link from
            elif rep:
                res[name].append(r)
        if rep:
            print(f"  round {rep}: " + _times(res, ("full", "incr")), flush=True)
    dirs = [root / "incr" / f"step_{s:08d}" for s in inc.all_steps()[-2:]]
    res |= {
        "state_bytes": sum(
            t.numel() * t.element_size() for t in groups_and_arrays(state)[1].values()
        ),
        "adapter_bytes": adapter_bytes(state),
        "du_two": du(*dirs),
        "du_one_full": du(root / "full" / f"step_{full.all_steps()[-1]:08d}"),
    }
    for name, m in (("full", full), ("incr", inc)):  # what LatestN's delete of a step costs
        res[f"delete_{name}"] = _delete_oldest(m, reps - 1)
    return res


def _delete_oldest(m: CheckpointManager, n: int) -> float:
    """Median seconds of deleting the oldest step, ``n`` times (the newest is kept)."""
    times = []
    for s in m.all_steps()[:n]:
        path = m._locations()[s][0]
        t0 = time.perf_counter()
        protocol.delete_step(path)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _times(res: dict, names) -> str:
    return "  ".join(f"{n} {res[n][-1]['seconds']:.3f} s" for n in names)


def new_leaves(state: TensorDict) -> TensorDict:
    """The same values in new tensors: what a full training step hands the manager."""
    return state.apply(lambda t: t.clone())


def bench_full_training(root: Path, reps: int) -> dict:
    """Alternating saves of a state whose every leaf is new, plus the incremental
    machinery's own work timed on its own: the identity check when nothing matches (the
    full-training case), the post-commit record, and the checks of a fully reused state."""
    state = gpt2_adamw_state()
    keep = LatestN(1)
    managers = {
        "previous (incremental=False)": CheckpointManager(
            root / "ft_off", async_save=False, incremental=False, keep_policy=keep
        ),
        "incremental": CheckpointManager(root / "ft_on", async_save=False, keep_policy=keep),
    }
    inc = managers["incremental"]
    res: dict = {n: [] for n in managers} | {"check_new": [], "record": [], "check_reused": []}
    for m in managers.values():  # warm-up: each manager's first save (a new directory)
        timed_save(m, state)
    for rep in range(1, reps + 1):
        state = new_leaves(state)
        state["step"] = torch.tensor(1000 + rep)
        leaves = groups_and_arrays(state)[1]
        res["check_new"].append(_seconds(incr.plan_save, inc._last_commit, leaves, 32 << 20, None))
        names = list(managers) if rep % 2 else list(reversed(managers))
        for name in names:
            res[name].append(timed_save(managers[name], state))
        path = inc._locations()[1000 + rep][0]
        manifest = protocol.read_committed(path)[1]
        plan = incr.SavePlan(incr.identify(leaves), {})
        res["record"].append(_seconds(incr.remember, None, 0, path, manifest, leaves, plan))
        res["check_reused"].append(
            _seconds(incr.plan_save, inc._last_commit, leaves, 32 << 20, None)
        )
        print(f"  round {rep}: " + _times(res, names), flush=True)
    res["leaves"] = len(groups_and_arrays(state)[1])
    res["linked"] = [r["linked"] for r in res["incremental"]]
    return res


def _seconds(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def med(rows: list[dict], field: str) -> float:
    return statistics.median(r[field] for r in rows)


def report_lora(lo: dict, reps: int) -> None:
    full_s, inc_s = med(lo["full"], "seconds"), med(lo["incr"], "seconds")
    full_b, inc_b = med(lo["full"], "written"), med(lo["incr"], "written")
    mb = 1e6
    print(
        f"\nLoRA state: {lo['state_bytes'] / mb:.1f} MB, adapters + their AdamW state "
        f"{lo['adapter_bytes'] / mb:.2f} MB; medians of {reps} rounds"
    )
    print("| save | seconds | written | linked | bytes vs full | time vs full |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| full (incremental=False) | {full_s:.3f} | {full_b / mb:.1f} MB | 0 | 1 | 1 |")
    first = lo["first"]
    print(f"| incremental, first save | {first['seconds']:.3f} | {first['written'] / mb:.1f} MB |")
    linked = med(lo["incr"], "linked")
    print(
        f"| incremental, later saves | {inc_s:.3f} | {inc_b / mb:.2f} MB | {linked / mb:.1f} MB"
        f" | {inc_b / full_b:.4f} | {inc_s / full_s:.3f} |"
    )
    print(
        f"retention's delete of one step: full {lo['delete_full'] * 1e3:.0f} ms, "
        f"incremental {lo['delete_incr'] * 1e3:.0f} ms"
    )
    want = lo["du_one_full"] + lo["adapter_bytes"]
    print(
        f"du of two consecutive incremental steps {lo['du_two'] / mb:.1f} MB; one full step "
        f"{lo['du_one_full'] / mb:.1f} MB + adapters and state {lo['adapter_bytes'] / mb:.2f} MB"
        f" = {want / mb:.1f} MB (ratio {lo['du_two'] / want:.3f})"
    )


def report_full_training(ft: dict, reps: int) -> None:
    off, on = ft["previous (incremental=False)"], ft["incremental"]
    ratios = [b["seconds"] / a["seconds"] for a, b in zip(off, on, strict=True)]
    # rounds alternate which manager saves first; the geometric mean of the two orders'
    # medians cancels an order effect (a save right after another one is slower)
    first = statistics.median(ratios[1::2])  # even rounds: incremental first
    second = statistics.median(ratios[0::2])
    print(f"\nFull training: {ft['leaves']} leaves, all new every round; medians of {reps} rounds")
    print("| manager | save s | paired ratio (median) |")
    print("|---|---:|---:|")
    print(f"| previous (incremental=False) | {med(off, 'seconds'):.3f} | 1 |")
    print(f"| incremental | {med(on, 'seconds'):.3f} | {statistics.median(ratios):.3f} |")
    print(f"paired ratios per round: {[round(r, 3) for r in ratios]}; linked: {ft['linked']}")
    print(
        f"order-balanced ratio: sqrt({first:.3f} (incremental first) x {second:.3f} "
        f"(incremental second)) = {math.sqrt(first * second):.3f}"
    )
    ms = {k: statistics.median(ft[k]) * 1e3 for k in ("check_new", "record", "check_reused")}
    print(
        f"incremental work per save: identity check {ms['check_new']:.2f} ms (in save()), "
        f"record after the commit {ms['record']:.2f} ms; checks of the same state fully "
        f"reused {ms['check_reused']:.2f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ckpt_incr"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=50304, help="256: ftrain's byte-level GPT-2")
    ap.add_argument("--size", choices=sorted(SIZES), default="small", help="GPT-2 size")
    ap.add_argument("--skip-full-training", action="store_true")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    torch.set_num_threads(2)
    print(f"LoRA fine-tune (GPT-2 {args.size}, rank 8 on c_attn)", flush=True)
    lo = bench_lora(args.dir, args.reps, args.vocab, args.size)
    shutil.rmtree(args.dir / "full")
    shutil.rmtree(args.dir / "incr")
    ft = None
    if not args.skip_full_training:
        print("full training (every leaf new)", flush=True)
        ft = bench_full_training(args.dir, args.reps)
    report_lora(lo, args.reps)
    if ft is not None:
        report_full_training(ft, args.reps)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
