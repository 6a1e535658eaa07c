"""Run under torchrun by test_sharding.py: shard="optimizer" against shard="none".

Both steps train the same GPT-2 tiny from the same state on the same per-rank batches for
STEPS steps; rank 0 writes what it measured to the JSON file named by argv[1].

In float64: the two differ only by reduction order, and in float32 Adam turns that rounding
into visible differences on leaves whose exact gradient is zero (the attention key bias:
softmax ignores it), where the gradient is rounding noise that Adam normalises to full-size
steps. float64 keeps that noise below Adam's eps, so what is compared is the algorithm.
"""

import json
import sys

import torch
import torch.distributed as dist

import ftrain
from ftrain import optim, sharding
from ftrain.recipes.gpt2 import GPT, GPTConfig, lm_loss
from ftrain.state.tree import flatten, path_str

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
    tx = optim.chain(
        optim.clip_by_global_norm(0.5),  # small: clipping is active, so the global norm matters
        optim.adamw(3e-3, weight_decay=0.1, mask=optim.masks.ndim_at_least(2)),
    )
    state = ftrain.init_state(model, tx, seed=0)
    plain = ftrain.make_step(model, lm_loss, tx, dp=True)
    sharded_step = ftrain.make_step(model, lm_loss, tx, dp=True, shard="optimizer")
    a = state
    b = sharding.shard_state(state, sharded_step.sharder)
    norms = []
    for i in range(STEPS):
        a, ma = plain(a, _batch(i, rank, world))
        b, mb = sharded_step(b, _batch(i, rank, world))
        norms.append((float(ma["grad_norm"]), float(mb["grad_norm"])))
    whole = sharding.gather_state(b)
    again = sharding.shard_state(whole, sharded_step.sharder)
    roundtrip = all(
        torch.equal(x.to_local(), y.to_local()) if hasattr(x, "to_local") else torch.equal(x, y)
        for x, y in zip(flatten(b["opt"])[1], flatten(again["opt"])[1], strict=True)
    )
    shard_paths = [
        path_str(k) for k, t in zip(*flatten(b["opt"]), strict=True) if hasattr(t, "to_local")
    ]
    report = {
        "world": world,
        "params_rel": _max_rel(b["params"], a["params"]),
        "opt_rel": _max_rel(whole["opt"], a["opt"]),
        "norm_rel": max(abs(x - y) / x for x, y in norms),
        "opt_bytes_sharded": sharding.local_bytes(b["opt"]),
        "opt_bytes_plain": sharding.local_bytes(a["opt"]),
        "roundtrip_bit_exact": roundtrip,
        "sharded_leaves": len(shard_paths),
        "params_identical_across_ranks": _same_on_every_rank(b["params"]),
    }
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


def _same_on_every_rank(params) -> bool:
    flat = torch.cat([t.reshape(-1) for t in flatten(params)[1]])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    return bool(torch.equal(ref, flat))


if __name__ == "__main__":
    main(sys.argv[1])
