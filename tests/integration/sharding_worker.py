"""Run under torchrun by test_sharding.py: shard="optimizer" against shard="none".

Both steps train the same GPT-2 tiny from the same state on the same per-rank batches for
STEPS steps; rank 0 writes what it measured to the JSON file named by argv[1].

In float64: the two differ only by reduction order, and in float32 Adam turns that rounding
into visible differences on leaves whose exact gradient is zero (the attention key bias:
softmax ignores it), where the gradient is rounding noise that Adam normalises to full-size
steps. float64 keeps that noise below Adam's eps, so what is compared is the algorithm.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import ftrain
from ftrain import optim, sharding
from ftrain.recipes.gpt2 import GPT, GPTConfig, lm_loss
from ftrain.state.tree import flatten

STEPS = 50


def _batch(i: int, rank: int, world: int):
    g = torch.Generator().manual_seed(1000 + i)
    tokens = torch.randint(0, 256, (4 * world, 17), generator=g)
    mine = tokens[rank * 4 : (rank + 1) * 4]
    return {"x": mine[:, :-1], "y": mine[:, 1:]}


def _max_rel(a, b) -> float:
    worst = 0.0
    for x, y in zip(flatten(a)[1], flatten(b)[1], strict=True):
        if x.is_floating_point() and x.numel():
            scale = y.abs().max().clamp_min(1e-12)
            worst = max(worst, float((x - y).abs().max() / scale))
    return worst


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(
        GPTConfig.tiny(block_size=16, dropout=0.0), generator=torch.Generator().manual_seed(0)
    )
    model = model.to(torch.float64)
    tx, fused = (
        optim.chain(
            optim.clip_by_global_norm(0.5),  # small: clipping is active, the global norm matters
            optim.adamw(3e-3, weight_decay=0.1, mask=optim.masks.ndim_at_least(2), fused=f),
        )
        for f in (False, True)
    )
    state = ftrain.init_state(model, tx, seed=0)
    plain = ftrain.make_step(model, lm_loss, tx, dp=True)
    a = state
    runs = {mode: _Run(model, tx, state, mode) for mode in ("optimizer", "full")}
    # torch's fused Adam kernel on the DTensor shards (the same state layout)
    runs["optimizer_fused"] = _Run(model, fused, state, "optimizer")
    for i in range(STEPS):
        a, ma = plain(a, _batch(i, rank, world))
        for run in runs.values():
            run.step(i, rank, world, float(ma["grad_norm"]))
    report = {"world": world, "opt_bytes_plain": sharding.local_bytes(a["opt"])}
    report["param_bytes_plain"] = sharding.local_bytes(a["params"])
    for mode, run in runs.items():
        report[mode] = run.report(a)
        report[mode]["store"] = _check_store(run.state, Path(out_path).with_name(mode), rank, world)
    report["wide_rows"] = _wide_rows_round_trip(Path(out_path).with_name("wide"), world)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)
    dist.barrier()  # every rank's work is done; leave as reshard_worker does (no teardown)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _wide_rows_round_trip(where: Path, world: int) -> bool:
    """A sharded leaf whose one row is wider than ``chunk_bytes`` (8 KiB rows, 4 KiB chunks):
    the chunk plan raised a bare StopIteration on every save. One row per chunk instead."""
    from tensordict import TensorDict

    from ftrain.ckpt import CheckpointManager

    sharder = sharding.Sharder()
    w = torch.arange(4 * world * 2048, dtype=torch.float32).reshape(4 * world, 2048)
    state = TensorDict(
        {"step": torch.tensor(1), "params": {"w": w.clone()}, "opt": {"mu": sharder.shard(w)}},
        batch_size=[],
    )
    manager = CheckpointManager(where, async_save=False, chunk_bytes=4096)
    manager.save_sharded(state)
    back = CheckpointManager(where, async_save=False).restore()
    return manager.all_steps() == [1] and torch.equal(back["opt", "mu"], w)


class _Run:
    """One sharded run beside the plain one, with what it measured."""

    def __init__(self, model, tx, state, mode):
        self.fn = ftrain.make_step(model, lm_loss, tx, dp=True, shard=mode)
        self.state = sharding.shard_state(state, self.fn.sharder)
        self.norm_rel = 0.0

    def step(self, i, rank, world, plain_norm):
        self.state, m = self.fn(self.state, _batch(i, rank, world))
        self.norm_rel = max(self.norm_rel, abs(float(m["grad_norm"]) - plain_norm) / plain_norm)

    def report(self, plain):
        b = self.state
        whole = sharding.gather_state(b)
        again = sharding.shard_state(whole, self.fn.sharder)
        pairs = zip(flatten(b)[1], flatten(again)[1], strict=True)
        roundtrip = all(torch.equal(_local(x), _local(y)) for x, y in pairs)
        return {
            "params_rel": _max_rel(whole["params"], plain["params"]),
            "opt_rel": _max_rel(whole["opt"], plain["opt"]),
            "norm_rel": self.norm_rel,
            "opt_bytes": sharding.local_bytes(b["opt"]),
            "param_bytes": sharding.local_bytes(b["params"]),
            "roundtrip_bit_exact": roundtrip,
            "sharded_leaves": sum(hasattr(t, "to_local") for t in flatten(b)[1]),
            "params_identical_across_ranks": _same_on_every_rank(whole["params"]),
        }


def _check_store(state, where: Path, rank: int, world: int) -> dict:
    """Save with every rank writing its own rows; check the store from outside."""
    from ftrain.ckpt import CheckpointManager
    from ftrain.ckpt import commit as protocol
    from ftrain.ckpt.reader import specs_of
    from ftrain.ckpt.sharded import read_rows, write_part

    mgr = CheckpointManager(where / "ckpt", async_save=False)
    mgr.save_sharded(state)
    whole = sharding.gather_state(state)
    step_dir = protocol.committed_steps(where / "ckpt")[int(state["step"])]
    specs = specs_of(protocol.read_committed(step_dir)[1])
    # this rank's rows, read back from the chunks that hold them only
    rows_ok = True
    for key, t in zip(*_flat_keys(state), strict=True):
        if hasattr(t, "to_local") and t.ndim > 0:
            n, c = t.shape[0], -(-t.shape[0] // world)
            start, length = min(rank * c, n), max(0, min((rank + 1) * c, n) - rank * c)
            rows_ok &= torch.equal(read_rows(step_dir, specs[key], start, length), t.to_local())
    # each rank's part alone: the chunk files of its own rows and nothing of the others'
    part_dir = where / f"part{rank}"
    part_dir.mkdir(parents=True)
    write_part(part_dir, state, {}, rank=rank, world=world, chunk_bytes=4096, workers=2)
    files = sorted(str(p.relative_to(part_dir)) for p in part_dir.rglob("c.*"))
    every = [None] * world
    dist.all_gather_object(every, files)  # test-only: plain lists of strings
    union = set().union(*map(set, every))
    disjoint = sum(len(f) for f in every) == len(union)
    restored = mgr.restore() if rank == 0 else None
    same = rank != 0 or all(
        torch.equal(x, y) for x, y in zip(flatten(restored)[1], flatten(whole)[1], strict=True)
    )
    return {
        "rows_ok": bool(rows_ok),
        "parts_disjoint": disjoint,
        "restore_whole": bool(same),
        "files_per_rank": [len(f) for f in every],
        "rank_buffer_is_rank0s": _rank_buffer_stored_whole(state, where, rank),
    }


def _rank_buffer_stored_whole(state, where: Path, rank: int) -> bool:
    """A replicated buffer that differs per rank (4 chunks of 4 KiB) is stored as rank 0's
    whole, never a mix of the ranks' chunks."""
    from tensordict import TensorDict

    from ftrain.ckpt import CheckpointManager

    extra = state.clone(recurse=False)
    extra["buffers"] = TensorDict({"running": torch.full((4096,), float(rank))}, [])
    mgr = CheckpointManager(where / "ckpt_buffers", async_save=False, chunk_bytes=4096)
    mgr.save_sharded(extra)
    if rank != 0:
        return True
    got = mgr.restore(only=("buffers",))["buffers", "running"]
    return bool(torch.equal(got, torch.zeros(4096)))


def _flat_keys(state):
    from ftrain.ckpt.store import groups_and_arrays

    _, leaves = groups_and_arrays(state)
    return list(leaves), list(leaves.values())


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _same_on_every_rank(params) -> bool:
    flat = torch.cat([t.reshape(-1) for t in flatten(params)[1]])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    return bool(torch.equal(ref, flat))


if __name__ == "__main__":
    main(sys.argv[1])
