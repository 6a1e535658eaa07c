"""The training loop: a small function over ``(state, step, batches, save, evaluate, record)``.

::

    while state.step < max_steps:
        batch = next(batches)              # carries the cursor of the batch after it
        state, metrics = step(state, batch)
        record / heartbeat / maybe evaluate
        save(state, ...)                   # the save policy decides; commits are atomic
        stop requested? -> save(force) and return "stopped"
    save(state, force) and return "finished"

Consistency comes from the state, not from the loop: ``state`` is always a completed
step boundary, so whatever happens — a signal, an exception in the next step, a crash
during a save — the state handed to ``save`` is whole. On an exception the loop makes an
*emergency save* of the last completed state and re-raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from tensordict import TensorDictBase

from ftrain.signals import StopFlag

__all__ = ["LoopResult", "SaveFn", "train_loop"]

# save(state, metrics, *, force, reason) -> True if a checkpoint was saved (or queued)
SaveFn = Callable[..., bool]


@dataclass
class LoopResult:
    """How the loop ended: ``finished`` (max_steps reached) or ``stopped`` (a stop request)."""

    state: TensorDictBase
    status: str
    reason: str | None = None
    last_metrics: dict[str, float] = field(default_factory=dict)


class _Meter:
    """Tokens/s over the steps since the last log line; sums on-device, syncs only when logging."""

    def __init__(self) -> None:
        self.tokens: torch.Tensor | int = 0
        self.t0 = time.perf_counter()

    def add(self, tokens: torch.Tensor) -> None:
        self.tokens = self.tokens + tokens

    def rate(self) -> float:
        now = time.perf_counter()
        rate = float(self.tokens) / max(now - self.t0, 1e-9)
        self.tokens, self.t0 = 0, now
        return rate


def _host(metrics: Mapping[str, torch.Tensor]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        v = v.item() if isinstance(v, torch.Tensor) else v
        out[k] = v
    return out


def _noop_record(kind: str, **fields) -> None:
    return None


def train_loop(
    state: TensorDictBase,
    step: Callable,
    batches: Iterable,
    *,
    max_steps: int,
    save: SaveFn | None = None,
    evaluate: Callable[[TensorDictBase], dict[str, float]] | None = None,
    eval_every: int | None = None,
    record: Callable[..., None] | None = None,
    log_every: int = 1,
    stop: StopFlag | None = None,
    agree: Callable[[bool], bool] | None = None,
    donate: bool = False,
) -> LoopResult:
    """Advance ``state`` with ``step`` over ``batches`` until ``max_steps`` or a stop request.

    Args:
        state: the state to start from (fresh or restored).
        step: ``step(state, batch) -> (state, metrics)``, e.g. from :func:`ftrain.make_step`.
        batches: an iterable of batches (``ftrain.data.Loader.iter_from(state["data"])``).
        max_steps: stop when ``state["step"]`` reaches this.
        save: ``save(state, metrics, *, force, reason) -> bool``; called after every step
            (its policy decides), with ``force=True`` at the end, on stop and on error.
        evaluate: ``evaluate(state) -> {"val_loss": ...}``, called every ``eval_every`` steps.
        record: ``record(kind, **fields)``: step records (every ``log_every`` steps), events.
        stop: a :class:`ftrain.signals.StopFlag`, checked at every step boundary.
        agree: combine the local stop decision across ranks (any rank stopping stops all).
        donate: the step updates buffers in place; then a failure *inside* a step leaves no
            consistent state to save, and the emergency save is skipped.

    Returns:
        A :class:`LoopResult` with the final state.

    Raises:
        Whatever the step, data or save raised, after an emergency save.

    Example:
        >>> import ftrain, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> tx = ftrain.optim.sgd(0.1)
        >>> step = ftrain.make_step(model, lambda m, b: m(b["x"]).pow(2).mean(), tx)
        >>> batches = iter(lambda: {"x": torch.ones(4, 2)}, None)
        >>> result = train_loop(ftrain.init_state(model, tx, seed=0), step, batches, max_steps=3)
        >>> result.status, int(result.state["step"])
        ('finished', 3)
    """
    record = record or _noop_record
    save = save or (lambda *a, **k: False)
    it = iter(batches)
    meter = _Meter()
    last: dict[str, float] = {}  # the newest *logged* metrics (host floats)
    current: dict = {}  # metrics of the step `state` is at: what a save records with it
    in_step = False
    try:
        while int(state["step"]) < max_steps:
            if _stop_now(stop, agree):
                reason = (
                    stop.reason if stop is not None else None
                ) or "stop requested by another rank"
                save(state, current, force=True, reason=reason)
                return LoopResult(state, "stopped", reason, last)
            batch = next(it)
            in_step = True
            state, metrics = step(state, batch)
            in_step = False
            n = int(state["step"])
            current = dict(metrics.items())  # tensors: read only if a save happens
            meter.add(metrics["tokens"])
            if n % log_every == 0 or n == max_steps:
                last = _host(metrics)
                last["tokens_per_s"] = meter.rate()
                record("step", step=n, **last)
            if evaluate is not None and eval_every and n % eval_every == 0:
                ev = evaluate(state)
                record("eval", step=n, **ev)
                last.update(ev)
                current.update(ev)
            save(state, current, force=False, reason="policy")
            record("heartbeat", step=n)
    except BaseException as err:
        if not (donate and in_step):
            _emergency_save(save, state, current, err, record)
        raise
    save(state, current, force=True, reason="final")
    return LoopResult(state, "finished", None, last)


def _stop_now(stop: StopFlag | None, agree: Callable[[bool], bool] | None) -> bool:
    local = stop is not None and stop.requested
    return agree(local) if agree is not None else local


def _emergency_save(save: SaveFn, state, last, err: BaseException, record) -> None:
    try:
        saved = save(state, last, force=True, reason="emergency")
        record("emergency_save", step=int(state["step"]), saved=bool(saved), error=repr(err))
    except Exception as save_err:  # the original error matters more; report both
        record(
            "emergency_save",
            step=int(state["step"]),
            saved=False,
            error=repr(err),
            save_error=repr(save_err),
        )
