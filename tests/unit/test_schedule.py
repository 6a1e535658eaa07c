"""Tests for ftrain.optim.schedule: values at the boundaries, argument errors, no host sync."""

from __future__ import annotations

import math
import re

import pytest
import torch

from ftrain.optim import schedule


def value(s, count) -> float:
    out = s(count)
    assert isinstance(out, torch.Tensor) and out.ndim == 0 and out.dtype == torch.float64
    return out.item()


def test_constant():
    s = schedule.constant(3e-4)
    assert [value(s, c) for c in (0, 1, 10**9)] == [3e-4] * 3


def test_linear_boundaries_and_clamping():
    s = schedule.linear(1.0, 0.0, transition_steps=4)
    assert [value(s, c) for c in (-3, 0, 1, 2, 4, 5, 1000)] == [1.0, 1.0, 0.75, 0.5, 0.0, 0.0, 0.0]
    up = schedule.linear(0.0, 2e-3, transition_steps=100)
    assert value(up, 50) == pytest.approx(1e-3, rel=1e-15)


def test_cosine_decay_boundaries():
    s = schedule.cosine_decay(2.0, decay_steps=10)
    assert value(s, 0) == 2.0
    assert value(s, 5) == pytest.approx(1.0, rel=1e-15)
    assert value(s, 10) == pytest.approx(0.0, abs=1e-15)
    assert value(s, 11) == value(s, 10)
    a = schedule.cosine_decay(2.0, decay_steps=10, alpha=0.1)
    assert value(a, 0) == 2.0 and value(a, 10) == pytest.approx(0.2, rel=1e-15)
    for c in range(11):  # the documented formula, everywhere
        expected = 2.0 * (0.9 * 0.5 * (1 + math.cos(math.pi * c / 10)) + 0.1)
        assert value(a, c) == pytest.approx(expected, rel=1e-15)


def test_warmup_cosine_boundaries():
    s = schedule.warmup_cosine(1e-3, warmup_steps=10, decay_steps=110, end=1e-5, init=1e-4)
    assert value(s, 0) == pytest.approx(1e-4, rel=1e-15)
    assert value(s, 5) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4), rel=1e-15)
    assert value(s, 9) < value(s, 10)
    assert value(s, 10) == pytest.approx(1e-3, rel=1e-15)  # peak exactly at the boundary
    assert value(s, 60) == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5), rel=1e-15)  # half-way
    assert value(s, 110) == pytest.approx(1e-5, rel=1e-12)  # decay_steps includes warmup
    assert value(s, 10**6) == value(s, 110)
    values = [value(s, c) for c in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_warmup_cosine_without_warmup_starts_at_peak():
    s = schedule.warmup_cosine(1.0, warmup_steps=0, decay_steps=4)
    assert value(s, 0) == 1.0 and value(s, 2) == pytest.approx(0.5, rel=1e-15)


def test_join_switches_at_boundaries_with_relative_counts():
    s = schedule.join(
        [schedule.constant(1.0), schedule.linear(0.5, 0.0, 10), schedule.constant(7.0)],
        boundaries=[3, 13],
    )
    got = [value(s, c) for c in (0, 2, 3, 8, 12, 13, 100)]
    assert got == pytest.approx([1.0, 1.0, 0.5, 0.25, 0.05, 7.0, 7.0], rel=1e-15)
    assert value(schedule.join([schedule.constant(2.0)], []), 5) == 2.0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_tensor_counts_match_int_counts(dtype):
    s = schedule.warmup_cosine(1e-3, warmup_steps=3, decay_steps=9, end=1e-4)
    for c in range(12):
        assert torch.equal(s(torch.tensor(c, dtype=dtype)), s(c))


def test_schedules_never_read_the_count_back():
    """A meta-device count has no values: any .item() / bool() / host read would raise."""
    count = torch.tensor(7, device="meta")
    schedules = [
        schedule.constant(1.0),
        schedule.linear(0.0, 1.0, 5),
        schedule.cosine_decay(1.0, 5),
        schedule.warmup_cosine(1.0, 2, 9),
        schedule.join([schedule.constant(1.0), schedule.constant(2.0)], [3]),
    ]
    for s in schedules:
        out = s(count)
        assert out.device.type == "meta" and out.ndim == 0 and out.dtype == torch.float64


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: schedule.constant(float("nan")), "value=nan"),
        (
            lambda: schedule.linear(0.0, 1.0, 0),
            "positive integer transition_steps, got transition_steps=0",
        ),
        (lambda: schedule.linear(0.0, 1.0, 2.5), "transition_steps=2.5"),
        (lambda: schedule.linear(float("inf"), 1.0, 5), "init=inf"),
        (lambda: schedule.cosine_decay(1.0, 0), "positive integer decay_steps, got decay_steps=0"),
        (lambda: schedule.cosine_decay(1.0, -5), "decay_steps=-5"),
        (lambda: schedule.cosine_decay(1.0, 5, alpha=float("nan")), "alpha=nan"),
        (lambda: schedule.warmup_cosine(1.0, -1, 10), "warmup_steps=-1"),
        (lambda: schedule.warmup_cosine(1.0, 10, 10), "decay_steps=10 and warmup_steps=10"),
        (lambda: schedule.warmup_cosine("1e-3", 1, 10), "peak='1e-3'"),
        (lambda: schedule.join([], []), "schedules=[]"),
        (lambda: schedule.join([schedule.constant(1.0)], [3]), "len(boundaries)=1"),
        (lambda: schedule.join([schedule.constant(1.0)] * 3, [5, 2]), "boundaries=[5, 2]"),
        (lambda: schedule.join([schedule.constant(1.0)] * 2, [-1]), "boundaries=-1"),
        (lambda: schedule.join([schedule.constant(1.0), 0.1], [1]), "schedules[1]=0.1"),
    ],
)
def test_bad_arguments_name_the_value(make, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        make()


def test_bad_counts():
    s = schedule.constant(1.0)
    with pytest.raises(TypeError, match="count"):
        s(1.5)
    with pytest.raises(ValueError, match="0-d"):
        s(torch.tensor([1, 2]))
