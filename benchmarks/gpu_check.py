"""A prepared GPU check (under 5 minutes on one or more CUDA GPUs): ``python benchmarks/gpu_check.py``.

1. GPT-2 small, bf16 autocast: a few pure steps on ``cuda:0`` (ms/step after warm-up);
   ``adamw(fused=True)`` donated against ``torch.optim.AdamW(fused=True)`` (GPT-2 tiny).
2. Checkpoints from the GPU: a sync save, an async save (time the step loop is blocked,
   target <= 2 % of the sync save), a restore, verified.
3. Bit-exact resume with deterministic algorithms on: 4 steps straight vs 2 steps, save,
   restore, 2 steps — every leaf bit-identical.
4. With >= 2 GPUs: the sharded optimizer state (``shard="optimizer"``) on every visible
   GPU over NCCL, against ``shard="none"`` (max relative difference after 10 steps).

Without a CUDA device it prints why it skipped and exits 0. Each check prints one
``PASS``/``FAIL`` line; the exit status is 1 if any failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS

import torch  # noqa: E402

import ftrain  # noqa: E402
from ftrain import optim  # noqa: E402
from ftrain.recipes.gpt2 import GPT, GPTConfig, lm_loss  # noqa: E402


def _setup(device: str, block: int = 256, batch: int = 8):
    model = GPT(
        GPTConfig.gpt2(block_size=block, dropout=0.0), generator=torch.Generator().manual_seed(0)
    )
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(3e-4, weight_decay=0.1))
    state = ftrain.state.place(ftrain.init_state(model, tx, seed=0), device)

    def batch_at(i: int):
        t = torch.randint(
            0, 256, (batch, block + 1), generator=torch.Generator().manual_seed(100 + i)
        )
        return {"x": t[:, :-1].to(device), "y": t[:, 1:].to(device)}

    return model.to(device), tx, state, batch_at


def check_step(device: str) -> str:
    model, tx, state, batch_at = _setup(device)
    step = ftrain.make_step(model, lm_loss, tx, precision="bf16")
    for i in range(3):  # warm-up
        state, _ = step(state, batch_at(i))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(3, 13):
        state, m = step(state, batch_at(i))
    torch.cuda.synchronize()
    return f"GPT-2 small bf16: {(time.perf_counter() - t0) / 10 * 1e3:.1f} ms/step, loss {float(m['loss']):.3f}"


def check_fused(device: str) -> str:
    """``adamw(fused=True)``'s donated step against ``torch.optim.AdamW(fused=True)`` on the
    GPU: the same kernel, so the parameters should agree to the gradients' rounding."""
    torch.use_deterministic_algorithms(True)
    shape = GPTConfig.tiny(block_size=64, dropout=0.0)
    model = GPT(shape, generator=torch.Generator().manual_seed(0)).to(device)
    ref = GPT(shape, generator=torch.Generator().manual_seed(0)).to(device)
    tx = optim.adamw(3e-4, weight_decay=0.1, fused=True)
    state = ftrain.state.place(ftrain.init_state(model, tx, seed=0), device)
    step = ftrain.make_step(model, lm_loss, tx, donate=True)
    opt = torch.optim.AdamW(ref.parameters(), 3e-4, weight_decay=0.1, fused=True)
    for i in range(4):
        t = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(i))
        batch = {"x": t[:, :-1].to(device), "y": t[:, 1:].to(device)}
        state, _ = step(state, batch)
        opt.zero_grad(set_to_none=True)
        lm_loss(ref, batch)[0].backward()
        opt.step()
    worst = max(
        float((state["params"][tuple(n.split("."))] - p.detach()).abs().max())
        for n, p in ref.named_parameters()
    )
    if worst > 1e-5:
        raise AssertionError(f"fused step differs from torch's fused AdamW by {worst:.3g}")
    return f"adamw(fused=True) donated vs torch.optim.AdamW(fused=True): max abs diff {worst:.3g}"


def check_saves(device: str) -> str:
    _, _, state, _ = _setup(device)
    with tempfile.TemporaryDirectory() as d:
        sync = ftrain.CheckpointManager(f"{d}/sync", async_save=False)
        t0 = time.perf_counter()
        sync.save(state, force=True)
        sync_s = time.perf_counter() - t0
        asyn = ftrain.CheckpointManager(f"{d}/async", async_save=True)
        t0 = time.perf_counter()
        asyn.save(state, force=True)
        blocked = time.perf_counter() - t0
        asyn.wait()
        back = asyn.restore(target=state)
        same = ftrain.tree_equal(back, state)
    ratio = blocked / sync_s
    verdict = "met" if ratio <= 0.02 else "NOT met"
    if not same:
        raise AssertionError("the restored state differs from the saved one")
    return f"sync save {sync_s:.2f} s; async blocks {blocked * 1e3:.1f} ms = {ratio:.1%} (target <= 2 %: {verdict}); restore bit-exact"


def check_resume(device: str) -> str:
    torch.use_deterministic_algorithms(True)
    model, tx, state, batch_at = _setup(device, block=128, batch=4)
    step = ftrain.make_step(model, lm_loss, tx, precision="bf16")
    a = state
    for i in range(4):
        a, _ = step(a, batch_at(i))
    b = state
    with tempfile.TemporaryDirectory() as d:
        mgr = ftrain.CheckpointManager(d, async_save=False)
        for i in range(2):
            b, _ = step(b, batch_at(i))
        mgr.save(b, force=True)
        b = mgr.restore(target=b)
    for i in range(2, 4):
        b, _ = step(b, batch_at(i))
    diff = ftrain.first_difference(a, b)
    if diff:
        raise AssertionError(f"resumed run differs: {diff}")
    return "4 steps straight == 2 steps + save + restore + 2 steps, bit for bit (deterministic algorithms)"


def sharded_worker() -> None:
    import torch.distributed as dist

    from ftrain import sharding

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = f"cuda:{torch.cuda.current_device()}"
    model, tx, state, batch_at = _setup(device, block=128, batch=4)
    plain = ftrain.make_step(model, lm_loss, tx, dp=True)
    sharded = ftrain.make_step(model, lm_loss, tx, dp=True, shard="optimizer")
    a, b = state, sharding.shard_state(state, sharded.sharder)
    for i in range(10):
        a, _ = plain(a, batch_at(10 * i + rank))
        b, _ = sharded(b, batch_at(10 * i + rank))
    b = sharding.gather_state(b)
    worst = max(
        float((x - y).abs().max() / x.abs().max().clamp_min(1e-12))
        for x, y in zip(
            a["params"].flatten_keys().values(), b["params"].flatten_keys().values(), strict=True
        )
    )
    if rank == 0:
        print(f"max relative difference after 10 steps: {worst:.2e}")
    dist.destroy_process_group()


def check_sharded(n: int) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={n}",
        "--standalone",
        __file__,
        "--sharded",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if proc.returncode:
        raise AssertionError(proc.stderr[-2000:])
    line = [ln for ln in proc.stdout.splitlines() if "relative difference" in ln]
    return f"{n} GPUs, NCCL, shard=optimizer vs none: {line[-1] if line else proc.stdout[-200:]}"


def main() -> int:
    if "--sharded" in sys.argv:
        sharded_worker()
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); skipped")
        return 0
    n = torch.cuda.device_count()
    print(f"gpu_check: {n} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    checks = [
        ("step", lambda: check_step("cuda:0")),
        ("fused", lambda: check_fused("cuda:0")),
        ("saves", lambda: check_saves("cuda:0")),
        ("resume", lambda: check_resume("cuda:0")),
    ]
    if n >= 2:
        checks.append(("sharded", lambda: check_sharded(n)))
    failed = 0
    for name, fn in checks:
        try:
            print(f"PASS {name:<8} {fn()}", flush=True)
        except Exception as e:  # noqa: BLE001 - every check reports, then the verdict
            failed += 1
            print(f"FAIL {name:<8} {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
