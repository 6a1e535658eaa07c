"""The step's bucketed update-and-apply boundary (ftrain/apply.py, ftrain/optim/bucketed.py).

The bucketed step must give bit for bit what the whole-tree update gives, pure or donated,
for every built-in optimizer and every transform that needs a global quantity.
"""

import weakref

import pytest
import torch
from tensordict import TensorDict

import ftrain
from ftrain import apply
from ftrain.optim import masks
from ftrain.optim.bucketed import Source, hands_on, leafwise, owns, prepare_of, sole_owners
from ftrain.state import first_difference, init_state, tree_equal
from ftrain.state.tree import flatten, new_td, structure

o = ftrain.optim

# bucket sizes: one leaf each (the model's leaves are 8-256 bytes), a few leaves, all at once
BUCKETS = [1, 200, 2**30]


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _mse(m, b):
    return ((m(b["x"]) - b["y"]) ** 2).mean()


def _batch(i, overflow=False):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(8, 4, generator=g)
    return TensorDict(x=x * 1e5 if overflow else x, y=torch.randn(8, 2, generator=g))


TXS = {
    "adamw": lambda: o.adamw(
        o.schedule.warmup_cosine(1e-2, 3, 20), weight_decay=0.1, mask=masks.ndim_at_least(2)
    ),
    "sgd_momentum": lambda: o.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "clip_adamw": lambda: o.chain(o.clip_by_global_norm(0.05), o.adamw(1e-2)),
    "clip_adamw_fused": lambda: o.chain(o.clip_by_global_norm(0.05), o.adamw(1e-2, fused=True)),
    # a reduction behind a member that changes the values: its input is computed per bucket
    "scale_clip_torch": lambda: o.chain(
        o.scale(3.0), o.clip_by_global_norm_torch(0.05), o.sgd(0.1, momentum=0.9)
    ),
    "multi_frozen": lambda: o.multi_transform(
        {
            "head": o.chain(o.clip_by_global_norm(0.02), o.adamw(1e-2)),  # clip over its label
            "body": o.sgd(0.1, momentum=0.9),
            "fixed": o.frozen(),
        },
        {"fixed": masks.glob("0.bias"), "head": masks.glob("2.*"), "body": None},
    ),
    # a label that applies its own updates (fused) beside one whose updates are added
    "multi_fused": lambda: o.multi_transform(
        {"head": o.adamw(1e-2, fused=True, mask=masks.ndim_at_least(2)), "body": o.sgd(0.1)},
        {"head": masks.glob("2.*"), "body": None},
    ),
}


def _train(tx, bucket_bytes, donate, monkeypatch, steps=4, precision="fp32", overflow_at=None):
    monkeypatch.setattr(apply, "BUCKET_BYTES", bucket_bytes)
    model = _model()
    state = init_state(model, tx, seed=0, precision=precision)
    step = ftrain.make_step(model, _mse, tx, donate=donate, precision=precision)
    for i in range(steps):
        state, _ = step(state, _batch(i, overflow=i == overflow_at))
    return state


@pytest.mark.parametrize("name", sorted(TXS))
def test_bucketed_steps_are_bit_identical_to_the_whole_tree_update(name, monkeypatch):
    tx = TXS[name]()
    assert prepare_of(tx) is not None, "every built-in composition is bucketable"
    reference = _train(tx, None, False, monkeypatch)  # the whole-tree pure step
    _check_pure(tx, monkeypatch)
    for bucket in BUCKETS:
        for donate in (False, True):
            got = _train(tx, bucket, donate, monkeypatch)
            assert tree_equal(reference, got), (bucket, donate, first_difference(reference, got))
    assert tree_equal(reference, _train(tx, None, True, monkeypatch))  # whole-tree donated


def _check_pure(tx, monkeypatch):
    """The bucketed pure step (which writes new params into its own update temporaries)
    leaves every leaf of its input as it was."""
    monkeypatch.setattr(apply, "BUCKET_BYTES", 1)
    model = _model()
    state = init_state(model, tx, seed=0)
    step = ftrain.make_step(model, _mse, tx)
    for i in range(3):
        snapshot = state.clone()
        new, _ = step(state, _batch(i))
        assert tree_equal(state, snapshot), first_difference(state, snapshot)
        state = new


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "adamw_fused"])
def test_fp16_loss_scale_skip_is_bit_identical_bucketed(fused, monkeypatch):
    inner = o.adamw(1e-2, fused=True) if fused else o.sgd(0.05, momentum=0.9)
    tx = o.dynamic_loss_scale(o.chain(o.clip_by_global_norm(0.5), inner), init_scale=2.0**10)
    run = dict(steps=5, precision="fp16", overflow_at=2)
    reference = _train(tx, None, False, monkeypatch, **run)
    assert int(reference["opt", "loss_scale", "skipped"]) == 1, "step 2 must overflow"
    for bucket in BUCKETS:
        for donate in (False, True):
            got = _train(tx, bucket, donate, monkeypatch, **run)
            assert tree_equal(reference, got), (bucket, donate, first_difference(reference, got))


def _leaves(state, part):
    return dict(zip(*flatten(state[part]), strict=True))


def test_donated_step_writes_into_the_input_buffers_bucket_by_bucket(monkeypatch):
    monkeypatch.setattr(apply, "BUCKET_BYTES", 1)
    seen = []
    real = apply.spans_of

    def spans_of(params, bucket_bytes):
        seen.append(real(params, bucket_bytes))
        return seen[-1]

    monkeypatch.setattr(apply, "spans_of", spans_of)
    model, tx = _model(), TXS["adamw"]()
    state = init_state(model, tx, seed=0)
    step = ftrain.make_step(model, _mse, tx, donate=True)
    before = {
        part: {k: t.data_ptr() for k, t in _leaves(state, part).items()}
        for part in ("params", "opt")
    }
    new, _ = step(state, _batch(0))
    assert len(seen[-1]) == len(flatten(state["params"])[0]) == 4, "one bucket per leaf"
    for part in ("params", "opt"):
        after = {k: t.data_ptr() for k, t in _leaves(new, part).items()}
        big = [k for k, t in _leaves(new, part).items() if t.ndim > 0]
        assert big and all(after[k] == before[part][k] for k in big), part
    with pytest.raises(RuntimeError, match="donated"):
        step(state, _batch(1))


@pytest.mark.parametrize("name", ["clip_adamw", "clip_adamw_fused"])
def test_pinned_state_is_never_written_by_a_bucketed_donated_step(name, monkeypatch):
    from ftrain.state import pin

    monkeypatch.setattr(apply, "BUCKET_BYTES", 1)
    model, tx = _model(), TXS[name]()
    state = init_state(model, tx, seed=0)
    pin(state)
    snapshot = state.clone()
    ftrain.make_step(model, _mse, tx, donate=True)(state, _batch(0))
    assert tree_equal(state, snapshot), first_difference(state, snapshot)


@pytest.mark.parametrize("bucket", [None, 1])
@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw_fused"])
def test_a_skipped_fp16_step_shares_no_moment_with_a_pinned_state(fused, bucket, monkeypatch):
    """Pinned (an async save in flight), the next step runs out of place; an fp16 overflow
    there returned the old moments' tensors, so the donated step after wrote a later step's
    moments into the state still being saved."""
    from ftrain.state import pin

    monkeypatch.setattr(apply, "BUCKET_BYTES", bucket)
    model = _model()
    tx = o.dynamic_loss_scale(o.adamw(1e-2, fused=fused), init_scale=1.0)
    step = ftrain.make_step(model, _mse, tx, donate=True, precision="fp16")
    saved, _ = step(init_state(model, tx, seed=0, precision="fp16"), _batch(0))
    pin(saved)
    snapshot = saved.clone()
    skipped, _ = step(saved, _batch(1, overflow=True))
    assert int(skipped["opt", "loss_scale", "skipped"]) == 1, "the overflow must skip"
    step(skipped, _batch(2))  # donated: written in place
    assert tree_equal(saved, snapshot), first_difference(saved, snapshot)


def _recorder(log):
    """A leafwise identity that records, per bucket, how many earlier buckets' gradients
    are still alive."""
    refs = []

    def flat(keys, u, state, params):
        log.append(sum(r() is not None for r in refs))
        refs.extend(weakref.ref(t) for t in u)
        return list(u), state

    return o.make_transform("recorder", lambda p: TensorDict(), flat, prepare=leafwise(flat, "r"))


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("donate", [False, True])
def test_each_buckets_gradients_are_freed_before_the_next_bucket(donate, fused, monkeypatch):
    monkeypatch.setattr(apply, "BUCKET_BYTES", 1)
    log = []
    model, tx = _model(), o.chain(_recorder(log), o.adamw(1e-2, fused=fused))
    state = init_state(model, tx, seed=0)
    ftrain.make_step(model, _mse, tx, donate=donate)(state, _batch(0))
    assert log == [0, 0, 0, 0], "no earlier bucket's gradient may still be alive"


def test_a_transform_without_prepare_runs_on_the_whole_tree(monkeypatch):
    plain = o.GradientTransformation(lambda p: TensorDict(), lambda u, s, p=None: (u * 0.5, s))
    tx = o.chain(plain, o.sgd(0.1, momentum=0.9))
    assert prepare_of(tx) is None
    reference = _train(tx, None, False, monkeypatch)
    assert tree_equal(reference, _train(tx, 1, True, monkeypatch))


def test_a_per_bucket_state_entry_that_is_not_per_leaf_is_refused(monkeypatch):
    """The contract: state that is not per leaf is 0-d. A vector entry would be written by
    the first bucket and read, already overwritten, by the next; the step refuses it."""

    def flat(keys, u, state, params):
        return list(u), new_td({"seen": state["seen"] + len(u)})

    counter = o.make_transform(
        "counter", lambda p: new_td({"seen": torch.zeros(2)}), flat, prepare=leafwise(flat, "c")
    )
    tx = o.chain(counter, o.sgd(0.1))
    monkeypatch.setattr(apply, "BUCKET_BYTES", 1)
    model = _model()
    step = ftrain.make_step(model, _mse, tx, donate=True)
    with pytest.raises(RuntimeError, match="came from two buckets"):
        step(init_state(model, tx, seed=0), _batch(0))


def test_spans_cut_consecutive_leaves_by_bytes():
    leaves = [torch.zeros(4), torch.zeros(4), torch.zeros(16), torch.zeros(1)]
    assert apply.spans_of(leaves, 32) == [[0, 1], [2], [3]]
    assert apply.spans_of(leaves, 1) == [[0], [1], [2], [3]]
    assert apply.spans_of(leaves, 2**20) == [[0, 1, 2, 3]]


# ----------------------------------------------------------------------------- owned updates


def _bodies(tx, seed=0):
    """``(body, keys, grads, params)`` of ``tx``'s bucketed update on the test model."""
    state = init_state(_model(), tx, seed=0)
    keys, params = flatten(state["params"])
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=g) for p in params]
    body = prepare_of(tx)(Source.of(keys, grads, params, [list(range(len(keys)))]), state["opt"])
    return body, keys, grads, params


@pytest.mark.parametrize("name", sorted(TXS))
def test_an_owned_bucket_gives_the_same_bits_and_leaves_the_state_alone(name):
    """Given the updates as owned, a body may write into them: same results, bit for bit,
    and no tensor of its state (old or new) is written (a trace buffer is never the next
    member's scratch)."""
    tx = TXS[name]()
    if name == "multi_frozen":  # the step passes the trainable leaves only
        tx = o.chain(o.clip_by_global_norm(0.02), o.sgd(0.1, momentum=0.9))
    body, keys, grads, params = _bodies(tx)
    idx = list(range(len(keys)))
    ref_out, ref_state = body(idx, [t.clone() for t in grads], params)
    assert owns(body)
    out, state = body(idx, grads, params, owned=True)
    assert all(torch.equal(a, b) for a, b in zip(ref_out, out, strict=True))
    assert tree_equal(ref_state, state), first_difference(ref_state, state)


def test_the_chain_hands_a_members_fresh_output_on_but_never_a_state_buffer():
    body, keys, grads, params = _bodies(o.chain(o.clip_by_global_norm(1e-3), o.adamw(1e-2)))
    kept = [t.clone() for t in grads]
    out, _ = body(list(range(len(keys))), grads, params, owned=True)
    assert not any(torch.equal(a, b) for a, b in zip(grads, kept, strict=True)), "clip in place"
    trace_body = _bodies(o.sgd(0.1, momentum=0.9))[0]
    assert owns(trace_body) and hands_on(trace_body)  # the chain's output is scale_by_lr's
    lone_trace = prepare_of(o.trace(0.9))
    assert not hands_on(lone_trace(Source.of(keys, grads, params, [[0]]), _trace_state(keys)))


def _trace_state(keys):
    return o.trace(0.9).init(init_state(_model(), o.sgd(0.1), seed=0)["params"])


class _Shared(torch.nn.Module):
    """Two parameters whose gradients autograd hands out as one tensor (``(a + b).sum()``),
    plus one whose gradient is a custom backward's saved tensor: the parameter itself."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
        self.c = torch.nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x):
        return ((self.a + self.b) * x).sum() + _ItselfAsGrad.apply(self.c)


class _ItselfAsGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        ctx.save_for_backward(w)
        return w.sum()

    @staticmethod
    def backward(ctx, grad):
        return ctx.saved_tensors[0]  # the parameter's own storage


def test_gradients_that_are_not_the_steps_own_are_never_written(monkeypatch):
    """A gradient shared by two leaves, or one that is the state's own parameter, is not
    owned: the pure step leaves its input intact and matches the whole-tree update."""
    tx = o.chain(o.clip_by_global_norm(0.1), o.adamw(1e-2))
    runs = []
    for bucket in (None, 2**30):
        monkeypatch.setattr(apply, "BUCKET_BYTES", bucket)
        model = _Shared()
        state = init_state(model, tx, seed=0)
        step = ftrain.make_step(model, lambda m, b: m(b["x"]), tx)
        for _ in range(3):
            snapshot = state.clone()
            new, _ = step(state, TensorDict(x=torch.full((3,), 0.5)))
            assert tree_equal(state, snapshot), first_difference(state, snapshot)
            state = new
        runs.append(state)
    assert tree_equal(*runs), first_difference(*runs)


def test_sole_owners_refuses_aliases_views_and_held_storage():
    a = torch.zeros(4)
    assert sole_owners([a, torch.zeros(4)], set())
    assert not sole_owners([a, a], set())
    assert not sole_owners([a[:2]], set())  # a view: its storage is larger
    assert not sole_owners([torch.zeros(()).expand(4)], set())  # stride 0
    assert not sole_owners([a], {a.untyped_storage().data_ptr()})


@pytest.mark.parametrize(
    "tx",
    [o.adamw(1e-2), o.adamw(1e-2, fused=True), o.sgd(0.1, momentum=0.9)],
    ids=["adamw", "adamw_fused", "sgd"],
)
def test_a_donated_body_updates_its_moments_in_place_with_the_pure_bits(tx):
    body, keys, grads, params = _bodies(tx)
    state = init_state(_model(), tx, seed=0)["opt"]
    body = prepare_of(tx)(Source.of(keys, grads, params, [list(range(len(keys)))]), state)
    idx = list(range(len(keys)))
    ref_out, ref_state = body(idx, [t.clone() for t in grads], params)
    old = {id(t) for t in flatten(state)[1] if t.ndim > 0}
    out, new = body(idx, grads, params, owned=True, donated=True)
    assert all(torch.equal(a, b) for a, b in zip(ref_out, out, strict=True))
    assert tree_equal(ref_state, new), first_difference(ref_state, new)
    assert {id(t) for t in flatten(new)[1] if t.ndim > 0} == old, "moments written in place"


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_a_fused_adamw_step_is_torchs_fused_adamw_bit_for_bit(donate, monkeypatch):
    """``adamw(fused=True)`` applies its updates in torch's fused AdamW kernel: the step
    lands exactly where ``torch.optim.AdamW(fused=True)`` does, bucketed or not."""
    for bucket in (1, None):
        monkeypatch.setattr(apply, "BUCKET_BYTES", bucket)
        model, ref = _model(), _model()
        tx = o.adamw(o.schedule.linear(1e-2, 1e-3, 5), b2=0.95, weight_decay=0.1, fused=True)
        state = init_state(model, tx, seed=0)
        step = ftrain.make_step(model, _mse, tx, donate=donate)
        opt = torch.optim.AdamW(ref.parameters(), 1e-2, (0.9, 0.95), weight_decay=0.1, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float(1 - 0.18 * min(s, 5)))
        for i in range(6):
            state, _ = step(state, _batch(i))
            opt.zero_grad()
            _mse(ref, _batch(i)).backward()
            opt.step()
            sched.step()
        for name, p in ref.named_parameters():
            assert torch.equal(state["params"][tuple(name.split("."))], p.detach()), name


def _nodes(td) -> list:
    from ftrain.state.tree import entries, is_node

    out = [td]
    for v in entries(td).values():
        out += _nodes(v) if is_node(v) else []
    return out


@pytest.mark.parametrize("name", sorted(TXS))
@pytest.mark.parametrize("bucket", [1, 2**30], ids=["per_leaf", "one_bucket"])
def test_a_pure_steps_new_state_shares_no_node_with_its_input(name, bucket, monkeypatch):
    """One bucket keeps the bucket's own state as the new optimizer state (no rebuild);
    either way the new state is made of new, locked nodes with the input's layout."""
    monkeypatch.setattr(apply, "BUCKET_BYTES", bucket)
    tx = TXS[name]()
    model = _model()
    state = init_state(model, tx, seed=0)
    step = ftrain.make_step(model, _mse, tx)
    for i in range(3):
        new, _ = step(state, _batch(i))
        old_ids = {id(n) for n in _nodes(state)}
        assert not any(id(n) in old_ids for n in _nodes(new))
        assert all(n.is_locked for n in _nodes(new))
        assert structure(new["opt"])[0] == structure(state["opt"])[0]  # empty sub-trees too
        state = new


def test_the_writer_keeps_a_fresh_whole_bucket_state_and_rebuilds_anything_else():
    old = TensorDict({"a": {"m": torch.zeros(2)}, "e": {}, "n": torch.tensor(0)}, []).lock_()
    flat = structure(old)

    def written(bucket_state, whole=True, in_place=False):
        w = apply._StateWriter(flat, in_place, like=old if whole else None)
        (w.write if in_place else w.take)(bucket_state)
        return w.state()

    fresh = new_td({"a": {"m": torch.ones(2)}, "e": {}, "n": torch.tensor(1)})
    assert written(fresh) is fresh
    for other in (
        written(fresh, whole=False),  # more than one bucket
        written(new_td({"a": old["a"], "e": {}, "n": torch.tensor(1)})),  # a node of the input
        written(new_td({"a": {"m": torch.ones(2)}, "n": torch.tensor(1)})),  # no empty "e"
    ):
        assert other is not fresh and structure(other)[0] == flat[0]
        assert not any(n is old["a"] for n in _nodes(other))
