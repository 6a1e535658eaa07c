"""Where a compiled pure step's floor is: one compiled AdamW update, three ways, paired.

The same fused update (Inductor, one kernel) over ``--leaves`` square fp32 tensors:

- ``allocate``: returns new parameters and moments the compiler allocates (the compiled
  pure step before pooled destinations: fresh pages every call);
- ``destinations``: writes them into buffers passed in, reused every other call (the pure
  step's pooled destinations: the old state stays intact);
- ``in_place``: overwrites the inputs (the donated step, and an imperative loop).

All three read the same bytes; ``destinations`` also keeps the old state live, so its
working set is the old and the new state, where ``in_place`` has one. Variants take turns
round by round in one process; the figure is the median ms per call.

    .venv/bin/python benchmarks/update_traffic.py                # 6 x 1024^2 (MLP 6x1024)
    .venv/bin/python benchmarks/update_traffic.py --size 256      # a cache-sized state
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _moments(ps, gs, mus, nus):
    mu = torch._foreach_add(torch._foreach_mul(mus, 0.9), gs, alpha=0.1)
    nu = torch._foreach_addcmul(torch._foreach_mul(nus, 0.999), gs, gs, value=0.001)
    step = torch._foreach_div(mu, torch._foreach_add(torch._foreach_sqrt(nu), 1e-8))
    return torch._foreach_add(ps, torch._foreach_mul(step, -1e-3)), mu, nu


def allocate(ps, gs, mus, nus, dst):
    return _moments(ps, gs, mus, nus)


def destinations(ps, gs, mus, nus, dst):
    for out, new in zip(dst, _moments(ps, gs, mus, nus), strict=True):
        torch._foreach_copy_(out, new)
    return dst


def in_place(ps, gs, mus, nus, dst):
    for out, new in zip((ps, mus, nus), _moments(ps, gs, mus, nus), strict=True):
        torch._foreach_copy_(out, new)
    return ps, mus, nus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=1024, help="side of each square leaf")
    p.add_argument("--leaves", type=int, default=6)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    def state():
        return [torch.randn(args.size, args.size) for _ in range(args.leaves)]

    ps, gs, mus, nus = state(), state(), state(), state()
    spares = [[state(), state(), state()] for _ in range(2)]  # two sets, used in turn
    fns = {f.__name__: torch.compile(f, dynamic=False) for f in (allocate, destinations, in_place)}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # compile and warm up
        for i in range(3):
            fn(ps, gs, mus, nus, spares[i % 2])
    for r in range(args.rounds):
        order = list(fns)[r % 3 :] + list(fns)[: r % 3]
        for name in order:
            t0 = time.perf_counter()
            for i in range(args.calls):
                out = fns[name](ps, gs, mus, nus, spares[i % 2])
                del out
            times[name].append((time.perf_counter() - t0) / args.calls * 1e3)
    mb = args.leaves * args.size**2 * 4 / 2**20
    print(
        f"{args.leaves} x {args.size}^2 fp32 ({mb:.0f} MiB a tensor list), {args.threads} threads"
    )
    base = statistics.median(times["in_place"])
    print("| update | ms/call (median) | x in place |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
