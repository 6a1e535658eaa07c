"""torch.distributed plumbing: process group from torchrun's environment, and agreements.

Data parallelism itself lives in the step (gradients are all-reduced inside it); this
module starts the process group and gives the loop the few collective decisions it needs:
one restore step for every rank, one stop decision, averaged evaluation metrics.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "World",
    "agree_any",
    "all_mean",
    "broadcast_int",
    "broadcast_json",
    "checkpoint_group",
    "gather_json",
    "init_world",
    "local_device",
    "shutdown",
]


@dataclass(frozen=True)
class World:
    """This process's place: ``rank`` of ``size`` (``size == 1``: not distributed)."""

    rank: int = 0
    size: int = 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.size > 1


class LaunchError(ValueError):
    """The launcher's environment (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``) is incomplete or malformed; the CLI says so and exits 2."""


def _env(name: str, *, number: bool):
    """A launcher variable, named in the error if it is missing or not a whole number."""
    value = os.environ.get(name)
    if value is None or (number and _whole(value) is None):
        said = "is not set" if value is None else f"is {value!r}, not a whole number"
        why = "" if name == "WORLD_SIZE" else f", and WORLD_SIZE={os.environ['WORLD_SIZE']} asks for several processes"
        raise LaunchError(
            f"the environment variable {name} {said}{why}: launch with torchrun (it sets WORLD_SIZE, RANK, "
            "MASTER_ADDR and MASTER_PORT), set all four yourself, or unset WORLD_SIZE to run "
            "one process"
        )
    return _whole(value) if number else value


def _whole(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _world_size() -> int:
    return _env("WORLD_SIZE", number=True) if "WORLD_SIZE" in os.environ else 1


def init_world(
    backend: str = "auto", timeout_s: int = 600, device: torch.device | None = None
) -> World:
    """Join the process group described by torchrun's env vars (or run alone without them).

    ``backend="auto"`` picks nccl for CUDA devices and gloo otherwise.
    """
    size = _world_size()
    if size <= 1:
        return World()
    if not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        rank, timeout = _env("RANK", number=True), datetime.timedelta(seconds=timeout_s)
        store = _attempt_store(rank, size, timeout)
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=size, timeout=timeout
        )
    return World(dist.get_rank(), dist.get_world_size())


def _attempt_store(rank: int, size: int, timeout: datetime.timedelta) -> dist.Store:
    """torchrun's store, namespaced by restart attempt.

    After ``torchrun --max-restarts`` restarts the workers, the agent's store can still hold
    the previous attempt's gloo addresses; a restarted rank that reads one connects to a dead
    peer ("Connection refused"). A per-attempt prefix makes every attempt rendezvous afresh.
    """
    host, port = _env("MASTER_ADDR", number=False), _env("MASTER_PORT", number=True)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        host,
        port,
        size,
        is_master=not agent_store and rank == 0,
        timeout=timeout,
        multi_tenant=not agent_store,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"ftrain/attempt_{attempt}", store)


def local_device(device: torch.device) -> torch.device:
    """Under torchrun each rank gets its own GPU (``cuda:LOCAL_RANK``) and makes it current.

    ``trainer.device=cuda`` (or ``auto`` on a GPU host) would otherwise put every rank on
    GPU 0, which NCCL refuses.
    """
    if device.type != "cuda" or device.index is not None or _world_size() <= 1:
        return device
    rank = _env("LOCAL_RANK", number=True) if "LOCAL_RANK" in os.environ else 0
    local = torch.device("cuda", rank)
    torch.cuda.set_device(local)
    return local


def checkpoint_group(timeout_s: float = 600):
    """A new gloo process group of every rank, for the collectives of checkpoint saves
    that run in a background thread (an async sharded save): on the default group they
    could interleave with the training step's collectives in a different order on each
    rank. Collective: every rank calls it at the same point, in its main thread.
    ``None`` outside a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _device(group=None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_any(flag: bool) -> bool:
    """True on every rank if it is true on any rank (a stop request on one stops all)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1 if flag else 0], device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def broadcast_int(value: int | None, src: int = 0, group=None) -> int | None:
    """Rank ``src``'s value on every rank (``None`` travels as -1); ``group``: a process
    group of every rank other than the default one (e.g. :func:`checkpoint_group`)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([-1 if value is None else value], dtype=torch.int64, device=_device(group))
    dist.broadcast(t, src, group=group)
    v = int(t.item())
    return None if v == -1 else v


def broadcast_json(value: object, src: int = 0, group=None) -> object:
    """Rank ``src``'s JSON-able ``value`` on every rank (UTF-8 bytes in a uint8 tensor; no
    pickle). Outside a process group: ``value``."""
    import json

    if not (dist.is_available() and dist.is_initialized()):
        return value
    dev = _device(group)
    raw = json.dumps(value).encode() if dist.get_rank() == src else b""
    n = broadcast_int(len(raw), src, group)
    buf = torch.zeros(n, dtype=torch.uint8, device=dev)
    if dist.get_rank() == src:
        buf[:] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dev)
    dist.broadcast(buf, src, group=group)
    return json.loads(bytes(buf.cpu().numpy()))


def all_mean(values: dict[str, float]) -> dict[str, float]:
    """Average each value over ranks (for evaluation metrics)."""
    if not (dist.is_available() and dist.is_initialized()) or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return dict(zip(keys, t.tolist(), strict=True))


def gather_json(value: object, group=None) -> list | None:
    """Every rank's JSON-able ``value``, in rank order, on rank 0 (``None`` elsewhere).

    Travels as UTF-8 JSON bytes in uint8 tensors (no pickle): one all-gather of the lengths,
    one of the padded payloads. Outside a process group: ``[value]``.
    """
    import json

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    raw = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    dev = _device(group)
    size = torch.tensor([raw.numel()], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(int(s.item()) for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[: raw.numel()] = raw.to(dev)
    parts = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    if dist.get_rank() != 0:
        return None
    return [
        json.loads(bytes(p[: int(n.item())].cpu().numpy()))
        for p, n in zip(parts, sizes, strict=True)
    ]
