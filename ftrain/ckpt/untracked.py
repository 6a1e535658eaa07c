"""In-place writes PyTorch does not count, made countable: optimizers' fused kernels.

An incremental save (:mod:`ftrain.ckpt.incremental`) reuses a leaf that is the same
tensor object with the same version counter. ``torch.optim``'s ``fused=True`` kernels
(``SGD``, ``Adam``, ``AdamW``, ``Adagrad``; torch 2.13) update the parameters and their
state (moments, momentum buffers) in place *without* bumping ``_version``. So a loop of
the user's that saved its parameters or optimizer state after each step had trained
leaves linked from the previous step: a committed step holding stale values that still
verified, caught by the rotating audit up to 32 saves later, and a sparse change (a few
embedding rows) missed by the fingerprint windows until then. Third-party optimizers
(bitsandbytes, apex, DeepSpeed's CPU Adam) may write through raw pointers the same way.

:func:`count_optimizer_writes` installs, once per process, a post-step hook on every
``torch.optim.Optimizer``: after a step, the parameters and state tensors of each
``fused`` group (every group of an optimizer whose ``step`` is not torch's own) get their
version counters bumped, as a ``foreach`` step bumps them. ``CheckpointManager(
incremental=True)`` installs it. It touches no values; autograd sees what a non-fused step
would have shown it (a tensor saved for backward and then stepped is "modified by an
inplace operation"). Under ``torch.compile`` the hook runs eagerly (a graph break after
the step: a compiled fused step counts nothing either), and it never raises into the
step: an optimizer whose state it cannot read is left as it is.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["count_optimizer_writes"]

log = logging.getLogger("ftrain.ckpt")
_lock = threading.Lock()
_handle = None


def count_optimizer_writes() -> None:
    """Install the post-step hook (idempotent; see the module docstring)."""
    global _handle
    with _lock:
        if _handle is None:
            _handle = register_optimizer_step_post_hook(_bump_written)


@torch._dynamo.disable  # a compiled step's fused kernels count nothing either: run eagerly
def _bump_written(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    try:
        written = _untracked_tensors(optimizer)
    except Exception:  # noqa: BLE001 - an optimizer of unknown shape: never fail its step
        log.debug("optimizer %s: state not read for version counting", type(optimizer).__name__)
        return
    try:
        torch.autograd.graph.increment_version(written)
    except RuntimeError:  # one that cannot count (inference mode): alone it is never reused
        for t in written:
            try:
                torch.autograd.graph.increment_version(t)
            except RuntimeError:
                continue


def _untracked_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The params and state tensors of the groups whose kernels may write uncounted: the
    ``fused`` ones of torch's own ``step``, every group of a ``step`` from elsewhere (a
    subclass of torch's that keeps its ``step`` counts as torch's)."""
    own_step = getattr(type(optimizer).step, "__module__", "") or ""
    foreign = not own_step.startswith("torch.")
    out: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        if not (foreign or group.get("fused")):
            continue  # torch's foreach and for-loop steps count their writes
        for p in group["params"]:
            out.append(p)
            state = optimizer.state.get(p) if isinstance(optimizer.state, Mapping) else None
            if isinstance(state, Mapping):
                out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out
