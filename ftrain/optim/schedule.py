"""Learning-rate schedules: pure functions ``count -> value`` (optax style).

A schedule has no state of its own: the optimizer's ``count`` (saved in ``state["opt"]``) is
the whole input, so the learning rate of step ``n`` is computable from a checkpoint alone.

Conventions:

* ``count`` is a Python ``int`` or a 0-d integer tensor (any device). It is the number of
  updates already applied: the first update uses ``schedule(0)``, like
  ``torch.optim.lr_scheduler.LambdaLR`` whose first step uses ``lr_lambda(0)``.
* Every schedule returns a **0-d float64 tensor** on the count's device (CPU for an ``int``).
  float64 matches the Python doubles ``torch.optim`` computes learning rates in; the value is
  rounded to the parameter dtype only when it multiplies the updates.
* Tensor counts are never read back to the host (no ``.item()``, no Python branching on
  their value): schedules are ``torch.where`` / ``clamp`` expressions, so they add no device
  synchronisation and can run inside a CUDA graph.
* Bad arguments raise ``ValueError`` naming the value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "Schedule",
    "constant",
    "cosine_decay",
    "join",
    "linear",
    "rate_of",
    "warmup_cosine",
]

Count = int | torch.Tensor
Schedule = Callable[[Count], torch.Tensor]
"""``schedule(count) -> 0-d float64 tensor``."""


def _as_count(count: Count) -> torch.Tensor:
    if isinstance(count, torch.Tensor):
        if count.ndim != 0:
            raise ValueError(
                f"a schedule count must be a 0-d tensor, got shape {tuple(count.shape)}"
            )
        return count
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"a schedule count must be an int or a 0-d tensor, got {count!r}")
    return torch.tensor(count, dtype=torch.int64)


def _as_float(count: Count) -> torch.Tensor:
    return _as_count(count).to(torch.float64)


def _check_number(name: str, fn: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{fn} requires a finite number for {name}, got {name}={value!r}")
    return float(value)


def _check_steps(name: str, fn: str, value: int, *, allow_zero: bool = False) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        kind = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{fn} requires {kind} integer {name}, got {name}={value!r}")
    return value


def constant(value: float) -> Schedule:
    """A schedule that always returns ``value``.

    Args:
        value: the constant (finite).

    Returns:
        ``schedule(count) -> 0-d float64 tensor``.

    Raises:
        ValueError: if ``value`` is not a finite number.

    Example:
        >>> constant(3e-4)(10)
        tensor(0.0003, dtype=torch.float64)
    """
    value = _check_number("value", "constant", value)

    def schedule(count: Count) -> torch.Tensor:
        c = _as_count(count)
        return torch.full((), value, dtype=torch.float64, device=c.device)

    return schedule


def linear(init: float, end: float, transition_steps: int) -> Schedule:
    """Linear interpolation from ``init`` (count 0) to ``end`` (count ``transition_steps``).

    Counts below 0 give ``init``, counts at or beyond ``transition_steps`` give ``end``.

    Args:
        init: the value at count 0.
        end: the value from count ``transition_steps`` on.
        transition_steps: positive number of steps of the ramp.

    Returns:
        ``schedule(count) -> 0-d float64 tensor``.

    Raises:
        ValueError: if a value is not finite or ``transition_steps`` is not a positive int.

    Example:
        >>> warmup = linear(0.0, 1e-3, transition_steps=100)
        >>> float(warmup(50))
        0.0005
    """
    init = _check_number("init", "linear", init)
    end = _check_number("end", "linear", end)
    steps = _check_steps("transition_steps", "linear", transition_steps)

    def schedule(count: Count) -> torch.Tensor:
        frac = (_as_float(count) / steps).clamp(0.0, 1.0)
        return init + (end - init) * frac

    return schedule


def cosine_decay(init: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Cosine decay from ``init`` to ``alpha * init`` over ``decay_steps`` (optax semantics).

    ``value(c) = init * ((1 - alpha) * 0.5 * (1 + cos(pi * min(c, decay_steps) / decay_steps))
    + alpha)``.

    Args:
        init: the value at count 0.
        decay_steps: positive number of steps of the decay; later counts stay at the end value.
        alpha: the final value as a fraction of ``init``.

    Returns:
        ``schedule(count) -> 0-d float64 tensor``.

    Raises:
        ValueError: if ``decay_steps`` is not a positive int or a value is not finite.

    Example:
        >>> float(cosine_decay(1.0, decay_steps=10)(5))
        0.5
    """
    init = _check_number("init", "cosine_decay", init)
    alpha = _check_number("alpha", "cosine_decay", alpha)
    steps = _check_steps("decay_steps", "cosine_decay", decay_steps)

    def schedule(count: Count) -> torch.Tensor:
        c = _as_float(count).clamp(0.0, steps)
        cosine = 0.5 * (1.0 + torch.cos(math.pi * c / steps))
        return init * ((1.0 - alpha) * cosine + alpha)

    return schedule


def _cosine_between(start: float, end: float, steps: int) -> Schedule:
    def schedule(count: Count) -> torch.Tensor:
        c = _as_float(count).clamp(0.0, steps)
        return end + (start - end) * 0.5 * (1.0 + torch.cos(math.pi * c / steps))

    return schedule


def warmup_cosine(
    peak: float, warmup_steps: int, decay_steps: int, end: float = 0.0, init: float = 0.0
) -> Schedule:
    """Linear warmup from ``init`` to ``peak``, then cosine decay from ``peak`` to ``end``.

    As in optax's ``warmup_cosine_decay_schedule``, ``decay_steps`` is the total length of the
    schedule *including* the warmup: the value is ``init`` at count 0, ``peak`` at count
    ``warmup_steps`` and ``end`` from count ``decay_steps`` on.

    Args:
        peak: the value at the end of the warmup.
        warmup_steps: non-negative number of warmup steps (0: start at ``peak``).
        decay_steps: total schedule length, greater than ``warmup_steps``.
        end: the final value.
        init: the value at count 0.

    Returns:
        ``schedule(count) -> 0-d float64 tensor``.

    Raises:
        ValueError: for non-finite values, a negative ``warmup_steps`` or
            ``decay_steps <= warmup_steps``.

    Example:
        >>> s = warmup_cosine(1e-3, warmup_steps=10, decay_steps=110, end=1e-5)
        >>> float(s(0)), float(s(10)), float(s(110))
        (0.0, 0.001, 1e-05)
    """
    peak = _check_number("peak", "warmup_cosine", peak)
    end = _check_number("end", "warmup_cosine", end)
    init = _check_number("init", "warmup_cosine", init)
    warmup_steps = _check_steps("warmup_steps", "warmup_cosine", warmup_steps, allow_zero=True)
    decay_steps = _check_steps("decay_steps", "warmup_cosine", decay_steps)
    if decay_steps <= warmup_steps:
        raise ValueError(
            "warmup_cosine requires decay_steps (the total length, warmup included) greater "
            f"than warmup_steps, got {decay_steps=} and {warmup_steps=}"
        )
    decay = _cosine_between(peak, end, decay_steps - warmup_steps)
    if warmup_steps == 0:
        return decay
    return join([linear(init, peak, warmup_steps), decay], [warmup_steps])


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run ``schedules[i]`` from ``boundaries[i-1]`` to ``boundaries[i]`` (optax ``join_schedules``).

    Each schedule sees the count relative to its own start: from count ``boundaries[i-1]`` on,
    the value is ``schedules[i](count - boundaries[i-1])``.

    Args:
        schedules: one or more schedules.
        boundaries: ``len(schedules) - 1`` non-negative, non-decreasing integer counts.

    Returns:
        ``schedule(count) -> 0-d float64 tensor``.

    Raises:
        ValueError: if the lengths disagree or the boundaries are not non-negative,
            non-decreasing ints.

    Example:
        >>> s = join([constant(1.0), constant(0.1)], boundaries=[100])
        >>> float(s(99)), float(s(100))
        (1.0, 0.1)
    """
    schedules = list(schedules)
    boundaries = list(boundaries)
    if not schedules:
        raise ValueError(f"join requires at least one schedule, got {schedules=}")
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join requires len(boundaries) == len(schedules) - 1, got {len(boundaries)=} "
            f"and {len(schedules)=}"
        )
    for b in boundaries:
        _check_steps("boundaries", "join", b, allow_zero=True)
    if any(b > a for b, a in zip(boundaries, boundaries[1:], strict=False)):
        raise ValueError(f"join requires non-decreasing boundaries, got {boundaries=}")
    for i, s in enumerate(schedules):
        if not callable(s):
            raise ValueError(f"join requires callable schedules, got schedules[{i}]={s!r}")

    def schedule(count: Count) -> torch.Tensor:
        c = _as_count(count)
        value = torch.as_tensor(schedules[0](c), dtype=torch.float64, device=c.device)
        for b, s in zip(boundaries, schedules[1:], strict=True):
            nxt = torch.as_tensor(s(c - b), dtype=torch.float64, device=c.device)
            value = torch.where(c < b, value, nxt)
        return value

    return schedule


def rate_of(learning_rate: float | Schedule) -> Schedule:
    """``count -> rate`` for a constant rate or a schedule: a 0-d float64 tensor on the
    count's device (what ``scale_by_learning_rate`` and ``adamw(fused=True)`` evaluate).

    Example:
        >>> float(rate_of(0.1)(torch.tensor(3)))
        0.1
    """
    if callable(learning_rate):

        def scheduled(count: Count) -> torch.Tensor:
            device = count.device if isinstance(count, torch.Tensor) else None
            return torch.as_tensor(learning_rate(count), dtype=torch.float64, device=device)

        return scheduled
    value = float(learning_rate)

    def constant_rate(count: Count) -> torch.Tensor:
        device = count.device if isinstance(count, torch.Tensor) else None
        return torch.full((), value, dtype=torch.float64, device=device)

    return constant_rate
