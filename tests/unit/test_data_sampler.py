"""The pure sampler: resumable and elastic sample streams (property-based)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftrain.data import cursor_values, epoch_order, init_cursor, sample
from ftrain.rng import STREAM_DATA, fold_in, generator, key

BASE = key(1234)


def run(cursor, steps, *, world, global_batch, num_samples, drop_last=False, shuffle=True, k=BASE):
    """Simulate ``world`` ranks in one process; return (global batches, final cursor)."""
    batches = []
    for _ in range(steps):
        parts, nexts = [], []
        for rank in range(world):
            idx, nxt = sample(
                cursor,
                k,
                rank=rank,
                world=world,
                global_batch=global_batch,
                num_samples=num_samples,
                shuffle=shuffle,
                drop_last=drop_last,
            )
            assert idx.shape == (global_batch // world,)
            parts.append(idx)
            nexts.append(cursor_values(nxt))
        assert len(set(nexts)) == 1, "all ranks must agree on the next cursor"
        batches.append(torch.cat(parts).tolist())
        cursor = init_cursor(*nexts[0])  # as if saved and restored from a checkpoint
    return batches, cursor


worlds = st.sampled_from([1, 2, 4])


@settings(max_examples=300, deadline=None)
@given(
    num_samples=st.integers(1, 60),
    per_rank=st.integers(1, 6),
    world_a=worlds,
    world_b=worlds,
    steps=st.integers(1, 30),
    cut=st.integers(0, 30),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
)
def test_interrupted_resume_equals_uninterrupted_across_world_sizes(
    num_samples, per_rank, world_a, world_b, steps, cut, drop_last, shuffle
):
    global_batch = per_rank * 4  # divisible by 1, 2 and 4
    if drop_last and num_samples < global_batch:
        num_samples = global_batch
    cut = min(cut, steps)
    kw = {"global_batch": global_batch, "num_samples": num_samples}
    kw |= {"drop_last": drop_last, "shuffle": shuffle}
    full, _ = run(init_cursor(), steps, world=1, **kw)
    first, resume_at = run(init_cursor(), cut, world=world_a, **kw)
    rest, _ = run(resume_at, steps - cut, world=world_b, **kw)
    assert first + rest == full  # sample by sample, in order


@settings(max_examples=150, deadline=None)
@given(
    num_samples=st.integers(1, 50),
    batch_a=st.integers(1, 9),
    batch_b=st.integers(1, 9),
    cut=st.integers(0, 12),
)
def test_wrap_stream_is_independent_of_global_batch(num_samples, batch_a, batch_b, cut):
    """With wrap, a resume with another global batch continues the same sample stream."""
    kw = {"num_samples": num_samples, "world": 1}
    first, resume_at = run(init_cursor(), cut, global_batch=batch_a, **kw)
    rest, _ = run(resume_at, 10, global_batch=batch_b, **kw)
    stream = [i for b in first + rest for i in b]
    epochs = -(-len(stream) // num_samples) + 1
    expected = torch.cat([epoch_order(BASE, e, num_samples) for e in range(epochs)]).tolist()
    assert stream == expected[: len(stream)]


@settings(max_examples=40, deadline=None)
@given(num_samples=st.integers(1, 40), global_batch=st.integers(1, 12))
def test_wrap_reads_every_sample_once_per_epoch(num_samples, global_batch):
    batches, cursor = run(
        init_cursor(), 3 * num_samples, world=1, global_batch=global_batch, num_samples=num_samples
    )
    stream = [i for b in batches for i in b]
    for e in range(len(stream) // num_samples):
        assert sorted(stream[e * num_samples : (e + 1) * num_samples]) == list(range(num_samples))
    assert cursor_values(cursor) == divmod(len(stream), num_samples)


def test_epoch_order_follows_the_documented_key_chain():
    for epoch in (0, 1, 7):
        g = generator(fold_in(fold_in(BASE, STREAM_DATA), epoch))
        assert torch.equal(epoch_order(BASE, epoch, 37), torch.randperm(37, generator=g))
    assert not torch.equal(epoch_order(BASE, 0, 37), epoch_order(BASE, 1, 37))
    assert not torch.equal(epoch_order(key(1), 0, 37), epoch_order(key(2), 0, 37))
    assert epoch_order(BASE, 3, 5, shuffle=False).tolist() == [0, 1, 2, 3, 4]


def test_sampler_does_not_touch_global_rng():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    sample(init_cursor(), BASE, global_batch=4, num_samples=1000)
    assert torch.equal(before, torch.get_rng_state())


def test_epoch_rollover_wrap():
    order0, order1 = epoch_order(BASE, 0, 10).tolist(), epoch_order(BASE, 1, 10).tolist()
    idx, nxt = sample(init_cursor(0, 8), BASE, global_batch=4, num_samples=10)
    assert idx.tolist() == order0[8:] + order1[:2]
    assert cursor_values(nxt) == (1, 2)
    _, nxt = sample(init_cursor(0, 6), BASE, global_batch=4, num_samples=10)
    assert cursor_values(nxt) == (1, 0), "a cursor at the end of an epoch is normalised"


def test_epoch_rollover_drop_last():
    order0, order1 = epoch_order(BASE, 0, 10).tolist(), epoch_order(BASE, 1, 10).tolist()
    idx, nxt = sample(init_cursor(0, 4), BASE, global_batch=4, num_samples=10, drop_last=True)
    assert idx.tolist() == order0[4:8]
    assert cursor_values(nxt) == (1, 0), "two leftover samples are dropped"
    idx, nxt = sample(init_cursor(0, 8), BASE, global_batch=4, num_samples=10, drop_last=True)
    assert idx.tolist() == order1[:4] and cursor_values(nxt) == (1, 4)


def test_batch_larger_than_dataset_wraps_over_several_epochs():
    idx, nxt = sample(init_cursor(), BASE, global_batch=7, num_samples=3, shuffle=False)
    assert idx.tolist() == [0, 1, 2, 0, 1, 2, 0] and cursor_values(nxt) == (2, 1)


def test_position_beyond_a_shrunk_dataset_starts_the_next_epoch():
    idx, nxt = sample(init_cursor(2, 50), BASE, global_batch=2, num_samples=10, shuffle=False)
    assert idx.tolist() == [0, 1] and cursor_values(nxt) == (3, 2)


def test_sample_is_pure():
    cursor = init_cursor(1, 3)
    a = sample(cursor, BASE, global_batch=4, num_samples=20)
    b = sample(cursor, BASE, global_batch=4, num_samples=20)
    assert cursor_values(cursor) == (1, 3)
    assert torch.equal(a[0], b[0]) and cursor_values(a[1]) == cursor_values(b[1])
    assert a[1] is not cursor


def test_cursor_layout():
    c = init_cursor()
    assert c.batch_size == torch.Size([])
    assert set(c.keys()) == {"epoch", "position"}
    assert all(c[k].dtype == torch.int64 and c[k].dim() == 0 for k in ("epoch", "position"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world": 3, "global_batch": 8}, "divisible by 3"),
        ({"rank": 2, "world": 2}, "rank < world"),
        ({"global_batch": 0}, "positive multiple"),
        ({"num_samples": 0}, "no samples"),
        ({"num_samples": 3, "drop_last": True}, "drop_last"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, match):
    args = {"global_batch": 4, "num_samples": 10} | kwargs
    with pytest.raises(ValueError, match=match):
        sample(init_cursor(), BASE, **args)


def test_bad_cursor_raises():
    with pytest.raises(TypeError, match="init_cursor"):
        sample({"epoch": 0}, BASE, global_batch=2, num_samples=4)
    with pytest.raises(ValueError, match=">= 0"):
        init_cursor(0, -1)


def test_rank_starts_are_where_sample_reads():
    """The resume report gave the raw cursor: after a shrunk dataset (data.allow_changed)
    it named a position past the end, and in a 2-rank run a rank position past the epoch
    (the sampler reads the next epoch there)."""
    from ftrain.data.sampler import rank_starts
    from ftrain.rng import key

    cases = [
        (init_cursor(1, 20), 1, 4, 20, False, [(2, 0)]),  # shrunk to 20 samples
        (init_cursor(0, 20), 2, 4, 22, False, [(0, 20), (1, 0)]),  # rank 1 wraps
        (init_cursor(0, 4), 2, 4, 22, False, [(0, 4), (0, 6)]),
        (init_cursor(0, 0), 4, 8, 3, False, [(0, 0), (0, 2), (1, 1), (2, 0)]),  # 3 epochs
    ]
    for cursor, world, batch, n, drop, want in cases:
        got = rank_starts(cursor, world=world, global_batch=batch, num_samples=n, drop_last=drop)
        assert got == want, (cursor, got)
        for r, (e, p) in enumerate(got):  # the first sample each rank reads is that one
            idx, _ = sample(
                cursor,
                key(0),
                rank=r,
                world=world,
                global_batch=batch,
                num_samples=n,
                drop_last=drop,
            )
            assert idx[0] == epoch_order(key(0), e, n)[p]
    dropped = rank_starts(
        init_cursor(0, 18), world=2, global_batch=4, num_samples=20, drop_last=True
    )
    assert dropped == [(1, 0), (1, 2)]  # the tail of 2 is dropped: the next epoch
