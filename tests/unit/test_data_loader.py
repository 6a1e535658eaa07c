"""The prefetching loader: exact resume, restart, errors, validation batches."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from ftrain.data import Loader, TensorSource, cursor_values, init_cursor, val_batches
from ftrain.rng import key

BLOCK = 4


def source(n_samples=37):
    # sample i's x starts with token i * BLOCK, so a batch's first column names its samples
    return TensorSource(torch.arange(n_samples * BLOCK + 1), block_size=BLOCK)


def ids(batch):
    return (batch["x"][:, 0] // BLOCK).tolist()


def make(src, **kw):
    args = {"global_batch": 6, "key": key(7), "prefetch": 3} | kw
    return Loader(src, **args)


def test_batch_layout():
    with make(source()) as loader:
        batch = next(loader.iter_from(init_cursor()))
    assert batch.batch_size == torch.Size([])
    assert set(batch.keys()) == {"x", "y", "cursor"}
    assert batch["x"].shape == batch["y"].shape == (6, BLOCK) and batch["x"].dtype == torch.int64
    assert torch.equal(batch["x"][:, 1:], batch["y"][:, :-1])
    assert cursor_values(batch["cursor"]) == (0, 6)


def test_step_401_after_resume_reads_step_401s_batch():
    """Train 460 steps, 'crash', restore the state of step 400: step 401 gets its batch again."""
    src = source()
    states, batches = {0: init_cursor()}, {}
    with make(src) as loader:
        it = loader.iter_from(states[0])
        for step in range(1, 461):
            batch = next(it)
            batches[step] = batch
            states[step] = batch["cursor"]  # the step commits: state["data"] = batch["cursor"]
    # resume from the checkpoint of step 400, on 2 ranks with the same global batch
    parts = []
    for rank in range(2):
        with make(src, rank=rank, world=2) as loader:
            it = loader.iter_from(states[400].clone())
            parts.append([next(it) for _ in range(60)])
    for i, step in enumerate(range(401, 461)):
        x = torch.cat([parts[0][i]["x"], parts[1][i]["x"]])
        y = torch.cat([parts[0][i]["y"], parts[1][i]["y"]])
        assert torch.equal(x, batches[step]["x"]) and torch.equal(y, batches[step]["y"]), step
        assert cursor_values(parts[1][i]["cursor"]) == cursor_values(states[step])


def test_prefetch_and_synchronous_give_the_same_stream():
    src = source()
    with make(src, prefetch=0) as a, make(src, prefetch=5) as b:
        ia, ib = a.iter_from(init_cursor()), b.iter_from(init_cursor())
        for _ in range(20):
            assert ids(next(ia)) == ids(next(ib))


def test_restart_from_a_cursor_discards_read_ahead_and_joins_the_thread():
    src = source()
    loader = make(src, prefetch=4)
    it = loader.iter_from(init_cursor())
    seen = [next(it) for _ in range(10)]
    thread = it._thread
    assert thread is not None and thread.is_alive()
    it2 = loader.iter_from(seen[2]["cursor"])  # back to "step 3", like a restore
    assert not thread.is_alive(), "restarting must join the old prefetch thread"
    with pytest.raises(RuntimeError, match="closed"):
        next(it)
    for expected in seen[3:]:
        assert ids(next(it2)) == ids(expected)
    loader.close()
    loader.close()  # idempotent
    assert not any(t.name == "ftrain-data-prefetch" and t.is_alive() for t in threading.enumerate())


def test_iterator_does_not_modify_the_given_cursor():
    cursor = init_cursor(0, 6)
    with make(source()) as loader:
        it = loader.iter_from(cursor)
        next(it), next(it)
    assert cursor_values(cursor) == (0, 6)


def test_epoch_rollover_through_the_loader():
    src = source(10)
    with make(src, global_batch=4, shuffle=False) as loader:
        it = loader.iter_from(init_cursor())
        got = [ids(next(it)) for _ in range(3)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


class Broken(TensorSource):
    def get(self, indices):
        if int(indices.max()) >= 20:
            raise OSError("disk went away")
        return super().get(indices)


def test_reader_errors_surface_in_the_consumer():
    src = Broken(torch.arange(40 * BLOCK + 1), block_size=BLOCK)
    with make(src, shuffle=False, global_batch=5) as loader:
        it = loader.iter_from(init_cursor())
        assert len([next(it) for _ in range(4)]) == 4
        with pytest.raises(RuntimeError, match="prefetch thread failed") as e:
            next(it)
        assert isinstance(e.value.__cause__, OSError)


def test_loader_validates_arguments_up_front():
    with pytest.raises(ValueError, match="divisible by 4"):
        make(source(), global_batch=6, world=4)
    with pytest.raises(ValueError, match="prefetch"):
        make(source(), prefetch=-1)


def test_val_batches_are_fixed_and_leave_training_alone():
    src = source(37)
    torch.manual_seed(0)
    rng_before = torch.get_rng_state()
    first = [ids(b) for b in val_batches(src, 3, 4)]
    second = [ids(b) for b in val_batches(src, 3, 4)]
    assert first == second and torch.equal(rng_before, torch.get_rng_state())
    flat = [i for b in first for i in b]
    assert len(set(flat)) == 12 and max(flat) > 30, "spread over the split"
    halves = [[ids(b) for b in val_batches(src, 3, 4, rank=r, world=2)] for r in range(2)]
    assert [a + b for a, b in zip(*halves, strict=True)] == first
    small = [ids(b) for b in val_batches(source(5), 2, 4)]
    assert small == [[0, 1, 2, 3], [4, 0, 1, 2]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_arrive_on_device():
    with make(source(), device="cuda") as loader:
        batch = next(loader.iter_from(init_cursor()))
    assert (
        batch["x"].is_cuda
        and batch["y"].is_cuda
        and batch["cursor", "position"].device.type == "cpu"
    )


def test_float_token_ids_are_a_data_error_not_an_embedding_traceback():
    """A custom source returning float inputs reached F.embedding: a traceback from the
    model ("Expected tensor for argument #1 'indices' to have one of ... Long, Int")."""
    from ftrain.data import TokenRangeError

    class FloatSource(TensorSource):
        def get(self, indices):
            return super().get(indices).apply(lambda t: t.float())

    src = FloatSource(torch.arange(81), block_size=BLOCK)
    loader = make(src, global_batch=10, vocab_size=256, shuffle=False)
    with loader.iter_from(init_cursor()) as it, pytest.raises(TokenRangeError) as err:
        next(it)
    assert "holds torch.float32 inputs and torch.float32 targets: token ids must be integers" in (
        str(err.value)
    )
    plain = make(src, global_batch=10, shuffle=False)  # no vocabulary: a regression's floats
    with plain.iter_from(init_cursor()) as it:
        assert next(it)["x"].dtype == torch.float32


class Reshaped(TensorSource):
    """A source of your own whose get cuts or drops what the contract promises."""

    def __init__(self, tokens, cut, **kw):
        super().__init__(tokens, **kw)
        self.cut = cut

    def get(self, indices):
        return self.cut(super().get(indices))


@pytest.mark.parametrize(
    ("cut", "said", "tokens_only"),
    [
        (lambda xy: xy[1:], "x (9, 4), y (9, 4) for 10 samples", False),  # a row missing
        (lambda xy: xy.exclude("y"), "y missing (not a tensor)", False),
        (lambda xy: xy.set("y", xy["y"][:, :2]), "x (10, 4), y (10, 2)", True),  # y cut short
        (lambda xy: xy.apply(lambda t: t.repeat(1, 2)), "x (10, 8), y (10, 8)", True),  # > block
    ],
)
def test_a_source_batch_of_the_wrong_shape_is_refused_naming_the_shapes(cut, said, tokens_only):
    """A custom source whose get lost a row or cut y short trained on a shifted or
    mismatched batch without a word (the loader checked ids, not shapes); evaluation too.
    Without a vocabulary only the rows are checked (a regression's y may be [n, 1])."""
    from ftrain.data import SampleShapeError

    src = Reshaped(torch.arange(81), cut, block_size=BLOCK)
    for vocab in (None, 256):
        loader = make(src, global_batch=10, vocab_size=vocab, shuffle=False)
        with loader.iter_from(init_cursor()) as it:
            if vocab is None and tokens_only:
                assert next(it)["x"].shape[0] == 10
                continue
            with pytest.raises(SampleShapeError) as err:
                next(it)
        msg = str(err.value)
        assert said in msg and "Reshaped.get() returned" in msg, msg
        assert "epoch 0, position 0" in msg
        assert ("(10, T), T <= block_size = 4" if vocab else "x and y of 10 rows") in msg, msg
    with pytest.raises(SampleShapeError, match="evaluation batch 0"):
        next(val_batches(src, 2, 10, vocab_size=256))


def test_token_windows_shorter_than_block_size_are_warned_about_once():
    """A source whose windows came one token short trained on shorter contexts without a
    word; a padding source's batches may be shorter by design: one warning, not an error."""
    src = Reshaped(torch.arange(81), lambda xy: xy.apply(lambda t: t[:, :-1]), block_size=BLOCK)
    loader = make(src, global_batch=10, vocab_size=256, shuffle=False, prefetch=0)
    said = r"windows of 3 tokens, fewer than its block_size=4"
    with pytest.warns(UserWarning, match=said), loader.iter_from(init_cursor()) as it:
        batches = [next(it) for _ in range(3)]
    assert [b["x"].shape for b in batches] == [(10, 3)] * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per loader
        with loader.iter_from(init_cursor()) as it:
            next(it)


def test_a_source_without_block_size_needs_x_and_y_of_one_two_dim_shape():
    """Duck-typed sources declaring no block_size: any window length, but x and y alike."""
    from tensordict import TensorDict

    from ftrain.data import SampleShapeError, check_sample_shapes

    class Bare:
        pass

    ok = TensorDict(x=torch.zeros(3, 7, dtype=torch.long), y=torch.zeros(3, 7, dtype=torch.long))
    assert check_sample_shapes(Bare(), ok, 3, "here", tokens=True) is None
    flat = TensorDict(x=torch.zeros(3, dtype=torch.long), y=torch.zeros(3, dtype=torch.long))
    other = TensorDict(x=ok["x"], y=torch.zeros(3, 6, dtype=torch.long))
    for bad, n in ((ok, 4), (flat, 3), (other, 3)):
        with pytest.raises(
            SampleShapeError, match=rf"one shape \[len\(indices\), T\] = \({n}, T\)"
        ):
            check_sample_shapes(Bare(), bad, n, "here", tokens=True)
    regression = TensorDict(x=torch.zeros(3, 8), y=torch.zeros(3, 1))
    assert check_sample_shapes(Bare(), regression, 3, "here", tokens=False) is None


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("bad", [300, -1])
def test_a_token_id_outside_the_vocabulary_is_a_data_error_naming_it(prefetch, bad):
    """A token id the model has no embedding row for failed deep inside F.embedding (or
    as a CUDA device assert); the loader names it, where it was read and the fix."""
    from ftrain.data import DataFormatError

    tokens = torch.arange(81) % 200
    tokens[30] = bad  # in sample 7 of 20
    src = TensorSource(tokens, block_size=BLOCK)
    loader = make(src, global_batch=10, prefetch=prefetch, vocab_size=256, shuffle=False)
    with loader.iter_from(init_cursor()) as it, pytest.raises(DataFormatError) as err:
        next(it)
    msg = str(err.value)
    assert f"token id {bad} is outside the model's vocabulary [0, 256)" in msg
    assert "epoch 0, position 0" in msg and "data.dtype" in msg
    assert ("model.vocab_size above 300" in msg) == (bad == 300)  # no bigger model for -1
    ok = make(src, global_batch=10, prefetch=prefetch, vocab_size=256, shuffle=False)
    with ok.iter_from(init_cursor(0, 10)) as it:  # not checked past the vocabulary: fine
        assert next(it)["x"].shape == (10, BLOCK)


def test_val_batches_check_the_vocabulary_too():
    from ftrain.data import DataFormatError

    tokens = torch.arange(41)
    src = TensorSource(tokens, block_size=BLOCK)
    assert len(list(val_batches(src, 2, 4, vocab_size=37))) == 2  # samples 0-8 of 10
    with pytest.raises(DataFormatError, match="token id 36 is outside .* evaluation batch 1"):
        list(val_batches(src, 2, 4, vocab_size=36))


def test_ignored_targets_pass_the_vocabulary_check():
    """-100 is F.cross_entropy's ignore index: a source masking padding in its targets
    trained before the check and still does."""
    from ftrain.data import check_token_ids

    x, y = torch.tensor([[1, 2, 3]]), torch.tensor([[2, 3, -100]])
    check_token_ids(TensorSource(torch.arange(9), block_size=BLOCK), x, y, 256, "here")


def test_a_stream_dropped_without_close_stops_its_thread():
    """``for batch in loader: ... break`` in a function: the thread held the iterator (and
    the loader held it too), so every such loop left a thread polling for good."""
    import gc
    import time

    def first_batches():
        loader = Loader(
            TensorSource(torch.arange(10_000), block_size=8), global_batch=4, key=key(0)
        )
        for i, _ in enumerate(loader):
            if i == 2:
                break

    before = {t for t in threading.enumerate() if t.name == "ftrain-data-prefetch"}
    for _ in range(3):
        first_batches()
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = {t for t in threading.enumerate() if t.name == "ftrain-data-prefetch"}
        if not alive - before:
            break
        time.sleep(0.05)
    assert not alive - before, f"{len(alive - before)} prefetch threads left running"
