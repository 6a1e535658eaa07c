"""Where the pure step's fixed cost goes: its parts timed alone, on GPT-2 tiny's 52 leaves.

At width 8 (``--width``) the kernels cost next to nothing, so each figure is the Python and
dispatch cost of that part of ``ftrain.make_step``'s pure step with ``adamw(fused=True)``
(the CLI's default) and torch-style clipping, as in ``step_overhead.py``'s ``pure_fused``:
the whole step, the update-and-apply boundary (``ftrain.apply.update_and_apply``; also with
its one bucket's state rebuilt from leaves, as the step did before 2026-12-02), the new
state's construction and locking, one walk of the optimizer state, and the tensor work
inside them (the 156 copies a pure step makes, the fused kernel, the clip's norm) for scale.
Medians of ``--reps`` timings of ``--n`` calls each, one thread, thread CPU time.

    .venv/bin/python benchmarks/step_parts.py
    .venv/bin/python benchmarks/step_parts.py --width 64   # GPT-2 tiny's real width
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ftrain
from ftrain import apply as apply_module
from ftrain import step as step_module
from ftrain.apply import update_and_apply
from ftrain.optim.base import flat_update
from ftrain.optim.bucketed import prepare_of
from ftrain.recipes.gpt2 import GPT, GPTConfig, lm_loss
from ftrain.state.tree import flatten, rebuild, structure, unflatten


def _timed(fn, n: int, reps: int) -> float:
    """Median ms per call of ``fn`` (thread CPU time)."""
    for _ in range(5):
        fn()
    runs = []
    for _ in range(reps):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        runs.append((time.thread_time() - t0) / n * 1e3)
    return statistics.median(runs)


def main(args) -> None:
    torch.set_num_threads(1)
    cfg = GPTConfig.tiny(dropout=0.0, n_embd=args.width, block_size=8)
    model = GPT(cfg, generator=torch.Generator().manual_seed(0))
    tx = ftrain.optim.chain(
        ftrain.optim.clip_by_global_norm_torch(1.0),
        ftrain.optim.adamw(1e-3, weight_decay=0.01, fused=True),
    )
    state = ftrain.init_state(model, tx, seed=0)
    step = ftrain.make_step(model, lambda m, b: lm_loss(m, b)[0], tx)
    tok = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    batch = {"x": tok[:, :-1].contiguous(), "y": tok[:, 1:].contiguous()}
    for _ in range(3):
        state, _ = step(state, batch)
    keys, params = flatten(state["params"])
    opt = state["opt"]
    layout = structure(opt)
    grads = [torch.ones_like(p) for p in params]
    update, prepare = flat_update(tx), prepare_of(tx)
    moments = [g.clone() for g in grads]
    steps = [torch.tensor(1.0)] * len(grads)

    def fused():
        torch._fused_adamw_(
            [p.clone() for p in params], grads, moments, moments, [], steps, lr=1e-3,
            beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip

    def new_state():
        return step_module._new_state(
            step=state["step"] + 1,
            params=unflatten(keys, params),
            buffers=state["buffers"],
            opt=rebuild(*layout),
            data=state["data"],
            rng=state["rng"],
        )

    def apply_once():
        return update_and_apply(update, prepare, keys, list(grads), opt, params, False, layout)

    def apply_rebuilt():
        """The same with the bucket's state rebuilt node by node (the step before
        ``_StateWriter`` kept a fresh one-bucket state as it is)."""
        keep = apply_module._mirrors_fresh
        apply_module._mirrors_fresh = lambda new, old: False
        try:
            return apply_once()
        finally:
            apply_module._mirrors_fresh = keep

    parts = [
        ("whole pure step", lambda: step(state, batch)),
        ("update_and_apply (one bucket)", apply_once),
        ("update_and_apply, its state rebuilt", apply_rebuilt),
        ("new state: build + lock", new_state),
        ("one walk of the optimizer state", lambda: structure(opt)),
        ("rebuild of the optimizer state", lambda: rebuild(*layout)),
        (f"{3 * len(params)} copies (params + moments)", lambda: [p.clone() for p in params * 3]),
        ("the fused AdamW kernel (+ param copies)", fused),
        ("the clip's norm (_foreach_norm)", lambda: torch._foreach_norm(grads)),
    ]
    print(
        f"GPT-2 tiny layers at width {args.width}: {len(params)} parameter leaves, "
        f"{len(layout[1])} optimizer leaves; ms per call, median of {args.reps} × {args.n}, "
        "1 thread, thread CPU time\n"
    )
    print("| part | ms |\n|---|---:|")
    for name, fn in parts:
        print(f"| {name} | {_timed(fn, args.n, args.reps):.3f} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--reps", type=int, default=5)
    main(p.parse_args())
