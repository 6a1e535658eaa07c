"""The training loop: a small function over ``(state, step, batches, save, evaluate, record)``.

::

    while state.step < max_steps:
        batch = next(batches)              # carries the cursor of the batch after it
        new, metrics = step(state, batch)
        non-finite loss/grad norm? -> stop (raise, save nothing) | skip | continue
        state = new; record / heartbeat / maybe evaluate
        save(state, ...)                   # the save policy decides; commits are atomic
        stop requested? -> save(force) and return "stopped"
    save(state, force) and return "finished"

Consistency comes from the state, not from the loop: ``state`` is always a completed
step boundary, so whatever happens — a signal, an exception in the next step, a crash
during a save — the state handed to ``save`` is whole. On an exception the loop makes an
*emergency save* of the last completed state and re-raises.

**Divergence** (``on_nonfinite``). After every step the loop reads the step's ``loss``
and ``grad_norm`` on the host. That is one device sync per step; on a step that is
logged anyway (``log_every``) the logged values are reused, so with the default
``log_every=1`` it costs nothing extra. Steps that fp16 loss scaling already skipped
(``state["opt"]["loss_scale"]["skipped"]`` grew: the update was dropped and the scale
backed off) are not checked: that is the scaler's normal work, not divergence. Otherwise
a non-finite value means:

- ``stop`` (default): record ``nonfinite``, raise :class:`NonFiniteError`, and save
  *nothing* — neither the non-finite state nor an emergency save — so the newest committed
  checkpoint stays the last finite one and retention is not triggered by a diverged run;
- ``skip``: discard the update as fp16 loss scaling does: params, buffers, optimizer state
  (so also the LR schedule's count), loss scale and key chain stay those of the state
  before the step, while ``step`` and the data cursor advance past the bad batch. The run
  stays deterministic: a resume replays the same batch with the same keys and skips it
  again. Needs ``donate=False`` (a donated step has already overwritten the old state);
- ``continue``: keep the non-finite state (the old behaviour), but record ``nonfinite``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from tensordict import TensorDictBase

from ftrain.ckpt.hostrng import Mark
from ftrain.optim.base import tree_get
from ftrain.signals import StopFlag
from ftrain.state.init import is_donated
from ftrain.step import _new_state
from ftrain.watchdog import Watchdog

log = logging.getLogger(__name__)

__all__ = ["NONFINITE_MODES", "LoopResult", "NonFiniteError", "SaveFn", "train_loop"]

NONFINITE_MODES = ("stop", "skip", "continue")

# save(state, metrics, *, force, reason) -> True if a checkpoint was saved (or queued)
SaveFn = Callable[..., bool]


@dataclass
class LoopResult:
    """How the loop ended: ``finished`` (max_steps reached, ``reason="done"``), ``stopped``
    (a stop request; ``reason`` names it, e.g. ``"SIGTERM"``) or ``exhausted`` (a finite
    ``batches`` ran out first; ``reason`` says at which step; the state was saved if the
    loop trained a step)."""

    state: TensorDictBase
    status: str
    reason: str | None = None
    last_metrics: dict[str, float] = field(default_factory=dict)
    # the metrics the final or stop save recorded with ``state`` (its step's own)
    saved_metrics: dict = field(default_factory=dict)


class _Meter:
    """Throughput over the steps since the last log line; sums on-device, syncs only when logging.

    Counts ``tokens`` when the step's metrics carry them (the loss returned a token count),
    else ``samples``: the rate is named for what was counted (``tokens_per_s`` or
    ``samples_per_s``), never samples under the name of tokens.
    """

    def __init__(self) -> None:
        self.count: torch.Tensor | int = 0
        self.steps = 0
        self.unit: str | None = None
        self.t0 = time.perf_counter()

    def add(self, metrics: Mapping) -> None:
        self.steps += 1
        keys = metrics.keys()
        unit = "tokens" if "tokens" in keys else "samples" if "samples" in keys else None
        if unit is not None:
            self.unit = unit
            self.count = self.count + metrics[unit]

    def rates(self) -> dict[str, float]:
        now = time.perf_counter()
        elapsed = max(now - self.t0, 1e-9)
        out = {"steps_per_s": self.steps / elapsed}
        if self.unit is not None:
            out[f"{self.unit}_per_s"] = float(self.count) / elapsed
        self.count, self.steps, self.t0 = 0, 0, now
        return out


_END = object()  # next(batches, _END): the end of a finite iterable of batches


def _host(metrics: Mapping[str, torch.Tensor]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor) and v.numel() != 1:  # a step of the user's own
            raise TypeError(
                f"the step's metric {k!r} has shape {tuple(v.shape)}: each metric must be one "
                "number (reduce it in the step, e.g. .mean())"
            )
        out[k] = v.item() if isinstance(v, torch.Tensor) else v
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
    on_nonfinite: str = "stop",
    watchdog: Watchdog | None = None,
    evaluate_first: bool = False,
) -> LoopResult:
    """Advance ``state`` with ``step`` over ``batches`` until ``max_steps`` or a stop request.

    Args:
        state: the state to start from (fresh or restored).
        step: ``step(state, batch) -> (state, metrics)``, e.g. from :func:`ftrain.make_step`.
        batches: an iterable of batches (``ftrain.data.Loader.iter_from(state["data"])``;
            a ``Loader`` itself starts at the state's cursor too).
        max_steps: stop when ``state["step"]`` reaches this.
        save: ``save(state, metrics, *, force, reason) -> bool``; called after every step
            (its policy decides), with ``force=True`` at the end, on stop and on error. Or
            a :class:`ftrain.CheckpointManager`: its policy, the step's metrics recorded,
            and every forced save committed before the loop returns or raises (a save
            function of your own that calls an async manager's ``save`` returns first).
        evaluate: ``evaluate(state) -> {"val_loss": ...}``, called every ``eval_every`` steps;
            not called once a stop is requested (the stop save comes first), and it may
            return ``None`` to say it gave up part-way on one (recorded as ``eval_skipped``).
        record: ``record(kind, **fields)``: step records (every ``log_every`` steps), events
            (``nonfinite``, ``emergency_save``, ``eval``, ``heartbeat``).
        stop: a :class:`ftrain.signals.StopFlag`, checked at every step boundary.
        agree: combine the local stop decision across ranks (any rank stopping stops all).
        donate: the step updates buffers in place; then a failure *inside* a step after its
            first in-place write leaves no consistent state to save, and the emergency save
            is skipped. ftrain's own step marks the state just before that write, so a
            failure before it (in the forward or backward, e.g. out of memory) still saves
            the whole state it started from; a step of your own is never trusted so.
        on_nonfinite: ``"stop"``, ``"skip"`` or ``"continue"`` on a non-finite ``loss`` or
            ``grad_norm`` (see the module docstring).
        watchdog: a :class:`ftrain.watchdog.Watchdog`; the loop starts it, feeds it at every
            phase and stops it when it returns.
        evaluate_first: evaluate the starting state before the first step (if its step is
            an evaluation step): a resume from a stop save whose evaluation the stop
            skipped, so the run's evaluations are an unbroken run's.

    Returns:
        A :class:`LoopResult` with the final state.

    Raises:
        NonFiniteError: ``on_nonfinite="stop"`` and a step's loss or grad norm is not finite
            (nothing is saved).
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
    _check_mode(on_nonfinite, donate)
    _check_counts(max_steps=max_steps, log_every=log_every, eval_every=eval_every)
    run = _Run(
        step=step,
        save=_save_fn(save),
        record=record or _noop_record,
        evaluate=evaluate,
        eval_every=eval_every,
        log_every=log_every,
        max_steps=max_steps,
        donate=donate,
        on_nonfinite=on_nonfinite,
        watchdog=watchdog or _NoWatchdog(),
        stop=stop,
        agree=agree,
        evaluate_first=evaluate_first,
    )
    run.watchdog.start()
    try:
        return run.loop(state, _batches_from(batches, state))
    finally:
        run.watchdog.stop()


def _save_fn(save) -> SaveFn:
    """``save`` as the loop calls it. A :class:`ftrain.CheckpointManager` given itself
    saves by its policy after each step, and a forced save (the end, a stop, an emergency)
    is waited for: the loop returns or raises with it committed (``latest_step()`` right
    after an async emergency save said ``None``, and a failed write was recorded as
    saved)."""
    if save is None:
        return lambda *a, **k: False
    if callable(save) or not (hasattr(save, "save") and hasattr(save, "wait")):
        return save
    manager = save

    def into_manager(state, metrics, *, force: bool, reason: str) -> bool:
        saved = manager.save(state, metrics=metrics, force=force)
        if force:
            manager.wait()
        return saved

    return into_manager


def _batches_from(batches: Iterable, state: TensorDictBase) -> Iterator:
    """The batch stream: a :class:`ftrain.data.Loader` given itself starts at the state's
    cursor, as ``loader.iter_from(state["data"])`` does (iterated from its start, a resume
    trained on the first batches again, silently)."""
    iter_from = getattr(batches, "iter_from", None)
    if callable(iter_from) and "data" in state.keys():
        return iter_from(state["data"])
    return iter(batches)


def _check_mode(on_nonfinite: str, donate: bool) -> None:
    if on_nonfinite not in NONFINITE_MODES:
        raise ValueError(f"on_nonfinite must be one of {NONFINITE_MODES}, got {on_nonfinite!r}")
    if on_nonfinite == "skip" and donate:
        raise ValueError(
            "on_nonfinite='skip' keeps the state before a bad step, but donate=True "
            "overwrites it in place; use donate=False or on_nonfinite='stop'"
        )


def _check_counts(*, max_steps, log_every, eval_every) -> None:
    """Step counts are whole numbers: ``log_every=0`` raised ZeroDivisionError after the
    first step, ``max_steps="3"`` a comparison TypeError, ``max_steps=2.5`` ran 3 steps."""
    for name, value, least in (
        ("max_steps", max_steps, 0),
        ("log_every", log_every, 1),
        ("eval_every", eval_every, 0),  # 0 or None: no evaluation, as in the config
    ):
        if name == "eval_every" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")


class _NoWatchdog:
    """Stands in for a :class:`Watchdog` when there is none (no branches in the loop)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def phase(self, name, state, metrics, *, safe) -> None: ...

    def beat(self) -> None: ...


@dataclass
class _Run:
    """The loop's fixed parts: ``loop`` is the loop itself; one iteration is the step,
    ``_continue_from`` (checks) and ``_after_step`` (record, evaluate, save)."""

    step: Callable
    save: SaveFn
    record: Callable[..., None]
    evaluate: Callable | None
    eval_every: int | None
    log_every: int
    max_steps: int
    donate: bool
    on_nonfinite: str
    watchdog: Watchdog | _NoWatchdog
    stop: StopFlag | None = None
    agree: Callable[[bool], bool] | None = None
    evaluate_first: bool = False
    meter: _Meter = field(default_factory=lambda: _Meter())
    last: dict = field(default_factory=dict)  # the newest *logged* metrics (host floats)
    current: dict = field(default_factory=dict)  # metrics of the step `state` is at

    def loop(self, state, it) -> LoopResult:
        wd, in_step, returned, stop = self.watchdog, False, None, self.stop
        start, mark = int(state["step"]), None
        try:
            if self.evaluate_first:
                self._maybe_evaluate(state, start)
            while int(state["step"]) < self.max_steps:
                wd.phase("agree", state, self.current, safe=True)
                if _stop_now(stop, self.agree):
                    reason = (
                        stop.reason if stop is not None else None
                    ) or "stop requested by another rank"
                    # nothing trained (a stop before the first step, e.g. a signal during
                    # start-up): the state is the start's, fresh or already committed
                    if int(state["step"]) > start:
                        wd.phase("save", state, self.current, safe=True)
                        self.save(state, self.current, force=True, reason=reason)
                    return LoopResult(state, "stopped", reason, self.last, dict(self.current))
                wd.phase("data", state, self.current, safe=True)
                mark = (int(state["step"]), Mark())  # the host generators of this state
                batch = next(it, _END)
                if batch is _END:  # a finite iterable: the data's end, saved as an end
                    return self._exhausted(state, trained=int(state["step"]) > start)
                in_step = True
                wd.phase("step", state, self.current, safe=not self.donate)
                new, metrics = returned = self.step(state, batch)
                # from here on `state` is the step's result: a failure in the record, the
                # evaluation or the save saves it (a donated input is gone by now)
                (state, logged), in_step = self._continue_from(state, new, metrics), False
                returned = None
                self._after_step(state, logged)
            wd.phase("save", state, self.current, safe=True)
            # inside the try: a final save that fails gets the emergency retry, as any save
            self.save(state, self.current, force=True, reason="final")
        except NonFiniteError:
            raise  # nothing is saved: the newest committed checkpoint is the last finite one
        except BaseException as err:
            if self.donate and in_step and returned is not None:
                # failed checking a donated step's result (a logger, the host read): the
                # input is gone, the result whole (donation refuses on_nonfinite="skip")
                (state, metrics), in_step = returned, False
                self.current = dict(metrics.items())  # the saved step's own metrics
            if not (self.donate and in_step) or _still_whole(self.step, state):
                wd.phase("save", state, self.current, safe=True)
                if mark is not None and mark[0] == int(state["step"]):
                    mark[1].put_back()  # the save records the saved state's generators
                _emergency_save(self.save, state, self.current, err, self.record)
            raise
        return LoopResult(state, "finished", "done", self.last, dict(self.current))

    def _exhausted(self, state, *, trained: bool) -> LoopResult:
        """``batches`` ran out before ``max_steps``: the state saved (``force``; not when
        nothing was trained: the start's state is fresh or committed already) and the
        loop's end said so (a bare StopIteration escaped, after an "emergency" save)."""
        n = int(state["step"])
        reason = f"the batches ran out after step {n} (max_steps={self.max_steps})"
        if trained:
            self.watchdog.phase("save", state, self.current, safe=True)
            self.save(state, self.current, force=True, reason="exhausted")
        return LoopResult(state, "exhausted", reason, self.last, dict(self.current))

    def _continue_from(self, state, new, metrics):
        """Check the step's metrics; returns the state to continue from (``new``, or
        ``state`` where a non-finite step is skipped) and whether the step is logged."""
        n = int(new["step"])
        logged = n % self.log_every == 0 or n == self.max_steps
        host = _host(metrics) if logged else None
        bad = _nonfinite(state, new, metrics, host)
        self.meter.add(metrics)
        if bad:
            self._on_bad(n, bad)
        if logged:
            self.last = dict(host)
            self.last.update(self.meter.rates())
        if bad and self.on_nonfinite == "skip":
            return _skipped(state, new), logged  # keep the metrics of the params we keep
        self.current = dict(metrics.items())  # tensors: read only if a save happens
        return new, logged

    def _after_step(self, state, logged: bool) -> None:
        """Record, evaluate, offer a save: after the step ``state`` continues from."""
        n = int(state["step"])
        # the step is done: a hang in a logger from here on saves this state (even donated)
        self.watchdog.phase("record", state, self.current, safe=True)
        if logged:
            self.record("step", step=n, **self.last)
        # the step ran: said before its eval and save, so a kill during them (of a step
        # with no step record, log_every > 1) still counts it among the steps redone
        self.record("heartbeat", step=n)
        self.watchdog.beat()
        self._maybe_evaluate(state, n)
        self.watchdog.phase("save", state, self.current, safe=True)
        self.save(state, self.current, force=False, reason="policy")
        self.watchdog.beat()
        self.watchdog.phase("record", state, self.current, safe=True)  # out of the save

    def _on_bad(self, n: int, bad: dict[str, float]) -> None:
        action = {"stop": "stopped", "skip": "skipped", "continue": "continued"}
        self.record("nonfinite", step=n, action=action[self.on_nonfinite], **bad)
        if self.on_nonfinite == "stop":
            raise NonFiniteError(n, bad)

    def _maybe_evaluate(self, state, n: int) -> None:
        if self.evaluate is None or not self.eval_every or n % self.eval_every:
            return
        if _stop_now(self.stop, self.agree):
            # the stop save first: an evaluation may outlast the grace period (torchrun's
            # 30 s, a scheduler's warning), and SIGKILL then lost every step since a commit
            reason = self.stop.reason if self.stop is not None else None
            self.record("eval_skipped", step=n, reason=reason or "stop requested by another rank")
            return
        self.watchdog.phase("eval", state, self.current, safe=True)
        ev = self.evaluate(state)
        self.watchdog.beat()
        if ev is None:  # the evaluator gave up part-way on a stop request
            self.record("eval_skipped", step=n, reason="stop requested during the evaluation")
            return
        self.record("eval", step=n, **ev)
        self.last.update(ev)
        self.current.update(ev)


_CHECKED = ("loss", "grad_norm")


def _nonfinite(old, new, metrics, host: dict | None) -> dict[str, float]:
    """The checked metrics that are not finite (``{}``: all fine, or fp16 loss scaling
    skipped the step while its scale could still back off).

    A step the scaler skipped is its business (as GradScaler's, even a one-off forward
    overflow) until the scale has backed off below 1: then the loss or gradients are not
    finite even unscaled, a divergence. Before, such a run skipped every step to the end
    with its scale at 0 and ended "done", exit 0, having learned nothing. One host read
    for all of them (``host`` when the step is logged anyway).
    """
    names = [k for k in _CHECKED if k in metrics.keys()]
    if not names or (_amp_skipped(old, new) and not _scale_spent(new)):
        return {}
    if host is not None:
        values = [float(host[k]) for k in names]
    else:
        device = metrics[names[0]].device
        values = torch.stack([metrics[k].detach().float().reshape(()).to(device) for k in names])
        values = values.tolist()
    return {k: v for k, v in zip(names, values, strict=True) if not math.isfinite(v)}


def _amp_skipped(old, new) -> bool:
    """fp16 loss scaling skipped this step's update itself (``loss_scale.skipped`` grew)."""
    try:  # the counter of ftrain.optim.dynamic_loss_scale, wherever it sits in opt
        path = ("loss_scale", "skipped")
        return bool(tree_get(new["opt"], path) != tree_get(old["opt"], path))
    except (KeyError, ValueError):  # a custom state without (one) loss-scale counter
        return False


def _scale_spent(new) -> bool:
    """The loss scale after a skipped step is below 1: backing off further cannot help."""
    try:
        return bool(tree_get(new["opt"], ("loss_scale", "scale")) < 1)
    except (KeyError, ValueError):
        return False


def _skipped(old, new):
    """The state before the step, with the step count and data cursor of the state after it."""
    parts = {k: old[k] for k in old.keys()}
    for k in ("step", "data"):
        if k in new.keys():
            parts[k] = new[k]
    return _new_state(**parts)


class NonFiniteError(RuntimeError):
    """A step's loss or grad norm was not finite and ``on_nonfinite="stop"``.

    Attributes:
        step: the step whose result was not finite (it was not kept).
        values: the non-finite metrics, e.g. ``{"loss": nan}``.
    """

    def __init__(self, step: int, values: dict[str, float]) -> None:
        self.step, self.values = step, dict(values)
        shown = ", ".join(f"{k}={v}" for k, v in values.items())
        super().__init__(
            f"step {step}: non-finite {shown}; stopped (trainer.on_nonfinite=stop) without "
            f"saving it, so the newest committed checkpoint is the last finite step. Lower the "
            f"learning rate, add clipping (optim.clip) or use on_nonfinite=skip"
        )


def _stop_now(stop: StopFlag | None, agree: Callable[[bool], bool] | None) -> bool:
    local = stop is not None and stop.requested
    return agree(local) if agree is not None else local


def _still_whole(step: Callable, state) -> bool:
    """A donated state that a failed step never wrote (ftrain's step marks a state before
    its first in-place write; another step gives no such promise, so it is never trusted)."""
    return getattr(step, "marks_donation", False) and not is_donated(state)


def _emergency_save(save: SaveFn, state, last, err: BaseException, record) -> None:
    """Save the last finished state; the original error matters more than the save's or
    the record's (a ``record`` that raised here replaced it). A save that fails with the
    step's metrics is tried once more without them: a metric the checkpoint cannot hold
    (an ``evaluate`` returning a tensor of 3) failed the policy save and then this one,
    and every step since the last commit was lost."""
    fields: dict = {"step": int(state["step"]), "error": repr(err)}
    try:
        fields["saved"] = bool(save(state, last, force=True, reason="emergency"))
    except Exception as save_err:
        fields |= {"saved": False, "save_error": repr(save_err)}
        if last:
            try:
                fields["saved"] = bool(save(state, {}, force=True, reason="emergency"))
                fields["without_metrics"] = True
            except Exception:  # noqa: BLE001 - the first failure is the one reported
                pass
    try:
        record("emergency_save", **fields)
    except Exception as record_err:  # noqa: BLE001 - never replaces the step's error
        log.warning("ftrain: could not record the emergency save (%r): %s", record_err, fields)
