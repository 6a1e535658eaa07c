import math

import pytest
import torch

import ftrain
from ftrain.loop import NonFiniteError, train_loop
from ftrain.signals import StopFlag


def _setup():
    model = torch.nn.Linear(2, 1)
    tx = ftrain.optim.sgd(0.1)
    step = ftrain.make_step(model, lambda m, b: m(b["x"]).pow(2).mean(), tx)
    return ftrain.init_state(model, tx, seed=0), step


def adamw_setup(donate: bool = False):
    """A seeded Linear(2, 1) under AdamW: ``(state, step)``, donating if asked."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    tx = ftrain.optim.adamw(0.1)
    step = ftrain.make_step(model, lambda m, b: m(b["x"]).pow(2).mean(), tx, donate=donate)
    return ftrain.init_state(model, tx, seed=0), step


def _batches():
    while True:
        yield {"x": torch.ones(4, 2)}


def _failing_record(failing_kind: str):
    """A ``record`` whose write of ``failing_kind`` records fails (a full metrics disk)."""

    def record(kind, **fields):
        if kind == failing_kind:
            raise OSError("the metrics disk is full")

    return record


class Saves:
    def __init__(self):
        self.calls = []
        self.metrics = {}

    def __call__(self, state, metrics, *, force, reason):
        self.calls.append((int(state["step"]), force, reason))
        self.metrics[int(state["step"])] = {k: float(v) for k, v in metrics.items()}
        return force


def test_finishes_and_forces_a_final_save():
    state, step = _setup()
    saves, records = Saves(), []
    result = train_loop(
        state,
        step,
        _batches(),
        max_steps=3,
        save=saves,
        record=lambda k, **f: records.append((k, f)),
        log_every=2,
    )
    assert result.status == "finished" and int(result.state["step"]) == 3
    assert saves.calls[-1] == (3, True, "final")
    assert [f["step"] for k, f in records if k == "step"] == [2, 3]  # every log_every and the last


def test_a_finite_list_of_batches_ends_the_loop_saved_and_says_so():
    """Batches running out before max_steps raised a bare StopIteration after an
    "emergency" save (inside a generator a RuntimeError; under map() it vanished)."""
    state, step = _setup()
    saves = Saves()
    batches = [{"x": torch.ones(4, 2)}] * 3
    result = train_loop(state, step, batches, max_steps=10, save=saves)
    assert result.status == "exhausted" and int(result.state["step"]) == 3
    assert result.reason == "the batches ran out after step 3 (max_steps=10)"
    assert saves.calls[-1] == (3, True, "exhausted") and (3, True, "emergency") not in saves.calls
    assert train_loop(state, step, batches, max_steps=2, eval_every=0).status == "finished"
    empty = Saves()  # nothing to train on: nothing saved (the start is fresh or committed)
    assert train_loop(state, step, [], max_steps=5, save=empty).status == "exhausted"
    assert empty.calls == []
    assert list(map(lambda n: train_loop(state, step, batches, max_steps=n).status, [5])) == [
        "exhausted"
    ]


@pytest.mark.parametrize(
    "bad",
    [
        {"log_every": 0},
        {"max_steps": "3"},
        {"max_steps": None},
        {"max_steps": 2.5},
        {"max_steps": -1},
        {"eval_every": -1},
        {"max_steps": True},
    ],
)
def test_step_counts_that_are_not_whole_numbers_are_refused_before_a_step(bad):
    """(``eval_every=0`` is no evaluation, as ``trainer.eval_every=0`` is on the command line.)"""
    state, step = _setup()
    ran = []

    def counting(s, b):
        ran.append(1)
        return step(s, b)

    (name, value), args = next(iter(bad.items())), {"max_steps": 3} | bad
    with pytest.raises(ValueError, match=f"{name} must be a whole number >= .*got {value!r}"):
        train_loop(state, counting, _batches(), **args)
    assert ran == []


def test_stop_flag_saves_at_the_step_boundary_and_stops():
    state, step = _setup()
    saves, stop = Saves(), StopFlag()

    def stopping_batches():
        for i, b in enumerate(_batches()):
            if i == 2:
                stop.request("SIGTERM")
            yield b

    result = train_loop(state, step, stopping_batches(), max_steps=100, save=saves, stop=stop)
    assert result.status == "stopped" and result.reason == "SIGTERM"
    assert saves.calls[-1] == (3, True, "SIGTERM")


def test_exception_makes_an_emergency_save_of_the_last_completed_state():
    state, step = _setup()
    saves, records = Saves(), []

    def failing(s, b):
        if int(s["step"]) == 2:
            raise RuntimeError("boom")
        return step(s, b)

    with pytest.raises(RuntimeError, match="boom"):
        train_loop(
            state,
            failing,
            _batches(),
            max_steps=10,
            save=saves,
            record=lambda k, **f: records.append((k, f)),
        )
    assert saves.calls[-1] == (2, True, "emergency")
    assert records[-1][0] == "emergency_save" and records[-1][1]["saved"] is True


def test_other_ranks_stop_request_is_honoured_via_agree():
    state, step = _setup()
    result = train_loop(state, step, _batches(), max_steps=10, agree=lambda local: True)
    assert result.status == "stopped" and int(result.state["step"]) == 0


@pytest.mark.parametrize("name", ["SIGUSR1", "SIGHUP", "SIGQUIT", "SIGTERM"])
def test_stop_flag_signal_handler(name, capfd):
    """SIGHUP (a lost ssh session) and SIGQUIT (torchrun forwards both) killed the run
    without a save: they are stop requests like SIGTERM."""
    import signal

    sig = getattr(signal, name)
    with StopFlag() as flag:
        signal.raise_signal(sig)
        assert flag.requested and flag.reason == name
        signal.raise_signal(signal.SIGTERM)  # a second notice changes nothing
        assert flag.reason == name
    assert signal.getsignal(sig) is not flag._handle
    err = capfd.readouterr().err
    assert f"{name} received: finishing this step, saving, then exiting" in err
    assert f"SIGTERM received: already stopping ({name})" in err


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_stop_request_saves_before_an_evaluation_not_after_it(when):
    """A SIGTERM just before or during an evaluation waited for all of it before the stop
    save: an evaluation longer than the grace period (torchrun's 30 s) lost every step
    since the last commit to the SIGKILL that followed."""
    state, step = _setup()
    saves, records, evaluated, flag = Saves(), [], [], StopFlag()

    def evaluate(s):
        evaluated.append(int(s["step"]))
        if when == "during":
            flag.request("SIGTERM")
            return None  # the evaluator gave up part-way
        return {"val_loss": 1.0}

    def counting(s, b):
        if when == "before" and int(s["step"]) == 1:
            flag.request("SIGTERM")  # during step 2, before its evaluation
        return step(s, b)

    result = train_loop(
        state,
        counting,
        _batches(),
        max_steps=10,
        save=saves,
        evaluate=evaluate,
        eval_every=2,
        stop=flag,
        record=lambda kind, **f: records.append((kind, f)),
    )
    assert result.status == "stopped" and int(result.state["step"]) == 2
    assert evaluated == ([] if when == "before" else [2])
    skipped = [f for kind, f in records if kind == "eval_skipped"]
    assert [f["step"] for f in skipped] == [2] and not [k for k, _ in records if k == "eval"]
    assert saves.calls[-1] == (2, True, "SIGTERM")


@pytest.mark.parametrize(("start", "first"), [(2, [2, 4]), (3, [4])])
def test_evaluate_first_makes_up_the_start_steps_evaluation(start, first):
    """A resume from a stop save whose evaluation the stop skipped evaluates that step
    before training (only if it is an evaluation step)."""
    state, step = _setup()
    state = ftrain.replace(state, step=torch.tensor(start))
    evaluated = []

    def evaluate(s):
        evaluated.append(int(s["step"]))
        return {"val_loss": 1.0}

    kw = {"max_steps": 4, "evaluate": evaluate, "eval_every": 2}
    train_loop(state, step, _batches(), evaluate_first=True, **kw)
    assert evaluated == first
    evaluated.clear()
    train_loop(state, step, _batches(), **kw)
    assert evaluated == [4], "not asked: the start is not evaluated"


def test_saves_record_the_metrics_of_the_saved_step_and_eval_does_not_change_training():
    state, step = _setup()
    saves = Saves()
    evals = iter(range(100))
    with_eval = train_loop(
        state,
        step,
        _batches(),
        max_steps=4,
        save=saves,
        log_every=3,
        evaluate=lambda s: {"val_loss": float(next(evals))},
        eval_every=2,
    )
    without = train_loop(state, step, _batches(), max_steps=4)
    assert ftrain.tree_equal(with_eval.state, without.state)
    by_step = saves.metrics
    assert by_step[2]["val_loss"] == 0.0 and by_step[4]["val_loss"] == 1.0
    assert "val_loss" not in by_step[3], "no stale eval numbers on a step that was not evaluated"
    assert "loss" in by_step[1], "metrics of the step itself, even when it was not logged"


def test_a_step_is_counted_done_before_its_eval_and_save():
    """The heartbeat (what the redo report reads for steps with no step record) is written
    before the step's eval and save: a kill during a long eval of an unlogged step 5
    reported steps ..4 as redone, not ..5."""
    state, step = _setup()
    events = []

    def save(s, metrics, *, force, reason):
        events.append(("save", int(s["step"])))
        return force

    def evaluate(s):
        events.append(("eval", int(s["step"])))
        return {"val_loss": 0.0}

    record = lambda kind, **f: events.append((kind, f.get("step")))  # noqa: E731
    train_loop(state, step, _batches(), max_steps=5, save=save, record=record, log_every=4,
               evaluate=evaluate, eval_every=5)  # fmt: skip
    at_5 = [kind for kind, n in events if n == 5]
    assert at_5.index("heartbeat") < at_5.index("eval") < at_5.index("save"), at_5


# -- divergence: trainer.on_nonfinite --------------------------------------------------


def _diverging(at: int, metric: str = "loss"):
    """The tiny setup, whose step ``at`` reports a non-finite ``metric`` (and NaN params)."""
    state, step = _setup()

    def bad(s, b):
        new, metrics = step(s, b)
        if int(new["step"]) == at:
            metrics = metrics.clone()
            metrics[metric] = torch.tensor(float("nan"))
            new = new.apply(lambda t: t * float("nan") if t.is_floating_point() else t)
        return new, metrics

    bad.clean = step
    return state, bad


def test_nonfinite_stop_raises_naming_step_and_metric_and_saves_nothing_after():
    from ftrain.loop import NonFiniteError

    state, step = _diverging(at=3, metric="grad_norm")
    saves, records = Saves(), []
    with pytest.raises(NonFiniteError, match=r"step 3: non-finite grad_norm=nan") as err:
        train_loop(
            state,
            step,
            _batches(),
            max_steps=10,
            save=saves,
            record=lambda k, **f: records.append((k, f)),
        )
    assert err.value.step == 3 and list(err.value.values) == ["grad_norm"]
    # policy saves of steps 1 and 2, then nothing: no emergency save, no final save
    assert saves.calls == [(1, False, "policy"), (2, False, "policy")]
    bad = [f for k, f in records if k == "nonfinite"]
    assert len(bad) == 1 and bad[0]["step"] == 3 and bad[0]["action"] == "stopped"
    assert bad[0]["grad_norm"] != bad[0]["grad_norm"]  # the NaN itself is recorded
    assert not any(k == "emergency_save" for k, _ in records)


def test_nonfinite_is_the_default_stop_even_between_logged_steps():
    from ftrain.loop import NonFiniteError

    state, step = _diverging(at=3)
    with pytest.raises(NonFiniteError, match="step 3: non-finite loss=nan"):
        train_loop(state, step, _batches(), max_steps=10, log_every=100)


def test_nonfinite_skip_keeps_the_old_params_and_advances_step_and_cursor():
    state, step = _diverging(at=3)
    saves, records = Saves(), []
    cursors = []

    def batches():
        for i in range(100):
            cursors.append(i + 1)
            yield {"x": torch.ones(4, 2), "cursor": ftrain.data.init_cursor(0, i + 1)}

    result = train_loop(
        state,
        step,
        batches(),
        max_steps=5,
        save=saves,
        record=lambda k, **f: records.append((k, f)),
        on_nonfinite="skip",
    )
    s = result.state
    assert result.status == "finished" and int(s["step"]) == 5
    assert int(s["data", "position"]) == 5, "the bad batch was consumed, not re-read"
    assert all(torch.isfinite(t).all() for t in s["params"].values(True, True))
    assert [f["step"] for k, f in records if k == "nonfinite"] == [3]
    assert records[[k for k, _ in records].index("nonfinite")][1]["action"] == "skipped"
    # the skipped step's update is gone: 4 updates applied, the optimizer counted 4
    four = train_loop(state, step.clean, _batches(), max_steps=4).state
    assert ftrain.tree_equal(s["params"], four["params"])
    assert ftrain.tree_equal(s["opt"], four["opt"]), "the LR schedule's count did not move"
    assert all(m["loss"] == m["loss"] for m in saves.metrics.values()), "no NaN metrics saved"


def test_nonfinite_skip_is_deterministic_across_a_resume():
    state, step = _diverging(at=3)
    full = train_loop(state, step, _batches(), max_steps=6, on_nonfinite="skip").state
    part = train_loop(state, step, _batches(), max_steps=2, on_nonfinite="skip").state
    resumed = train_loop(part, step, _batches(), max_steps=6, on_nonfinite="skip").state
    assert ftrain.tree_equal(full, resumed)


def test_nonfinite_continue_keeps_going_and_records():
    state, step = _diverging(at=2)
    records = []
    result = train_loop(
        state,
        step,
        _batches(),
        max_steps=4,
        record=lambda k, **f: records.append((k, f)),
        on_nonfinite="continue",
    )
    assert int(result.state["step"]) == 4
    assert [f["action"] for k, f in records if k == "nonfinite"] == ["continued"] * 3
    assert not torch.isfinite(result.state["params", "weight"]).all()


def test_nonfinite_fp16_skips_are_left_to_the_loss_scaler():
    model = torch.nn.Linear(2, 1)
    tx = ftrain.optim.dynamic_loss_scale(ftrain.optim.sgd(0.1))
    step = ftrain.make_step(model, lambda m, b: m(b["x"]).pow(2).mean(), tx, precision="fp16")
    state = ftrain.init_state(model, tx, seed=0, precision="fp16")
    huge = iter([{"x": torch.full((4, 2), 1e30)}] + [{"x": torch.ones(4, 2)}] * 10)
    records = []
    result = train_loop(
        state, step, huge, max_steps=3, record=lambda k, **f: records.append((k, f))
    )
    skipped = result.state["opt", "loss_scale", "skipped"]
    assert int(skipped) >= 1, "the scaler skipped the overflowing step"
    assert not any(k == "nonfinite" for k, _ in records)


def test_fp16_steps_the_scaler_skips_past_a_scale_below_1_are_a_divergence():
    """Every forward NaN (a diverged model): the scaler skipped each step and backed its
    scale off to 0, and the run ended "done" having learned nothing. Once the scale is
    below 1 a skipped step is non-finite even unscaled: on_nonfinite applies (stop)."""
    model = torch.nn.Linear(2, 1)
    tx = ftrain.optim.dynamic_loss_scale(ftrain.optim.sgd(0.1), init_scale=4.0)
    step = ftrain.make_step(model, lambda m, b: m(b["x"]).pow(2).mean(), tx, precision="fp16")
    state = ftrain.init_state(model, tx, seed=0, precision="fp16")
    nan = iter([{"x": torch.full((4, 2), float("nan"))}] * 10)
    records = []
    with pytest.raises(NonFiniteError) as got:
        train_loop(state, step, nan, max_steps=10, record=lambda k, **f: records.append((k, f)))
    # scale 4 -> 2 -> 1 (skipped, left to the scaler) -> 0.5 at step 3: stopped there
    assert got.value.step == 3 and math.isnan(got.value.values["loss"]), got.value
    assert [f["step"] for k, f in records if k == "nonfinite"] == [3]


def test_nonfinite_rejects_bad_modes():
    state, step = _setup()
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        train_loop(state, step, _batches(), max_steps=1, on_nonfinite="ignore")
    with pytest.raises(ValueError, match="donate=True"):
        train_loop(state, step, _batches(), max_steps=1, on_nonfinite="skip", donate=True)


def _donated_run(fail_at: int, where: str, monkeypatch, own_step: bool = False):
    """Run a ``donate=True`` step that raises at step ``fail_at``, in the loss (before any
    in-place write) or in the update (after the state was marked); returns the saves."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    tx = ftrain.optim.adamw(0.1)
    steps = [0]

    def loss_fn(m, b):
        if where == "loss" and steps[0] == fail_at:
            raise RuntimeError("out of memory (simulated) in the forward")
        return m(b["x"]).pow(2).mean()

    step = ftrain.make_step(model, loss_fn, tx, donate=True)
    real = ftrain.step.update_and_apply

    def update(*args, **kwargs):
        if where == "update" and steps[0] == fail_at:
            raise RuntimeError("failed inside the update")
        return real(*args, **kwargs)

    monkeypatch.setattr(ftrain.step, "update_and_apply", update)

    def counted(s, b):
        steps[0] = int(s["step"])
        return step(s, b)

    if not own_step:
        counted.marks_donation = True  # a thin wrapper of ftrain's step keeps its promise
    saved = {}

    def save(state, metrics, *, force, reason):
        if force:  # the loop offers every step to the policy; only forced saves are kept
            saved[reason] = state.clone()  # the whole state, as a checkpoint stores it
        return force

    state = ftrain.init_state(model, tx, seed=0)
    with pytest.raises(RuntimeError):
        train_loop(state, counted, _batches(), max_steps=10, save=save, donate=True)
    return saved


def _undonated_state_at(n: int):
    state, step = adamw_setup()
    return train_loop(state, step, _batches(), max_steps=n).state


def test_a_donated_step_failing_before_its_first_write_still_makes_the_emergency_save(
    monkeypatch,
):
    saved = _donated_run(3, "loss", monkeypatch)
    assert set(saved) == {"emergency"}
    want = _undonated_state_at(3)
    got = saved["emergency"]
    assert int(got["step"]) == 3
    for key, t in want.items(True, True):
        assert torch.equal(got[key], t), key  # bit-identical to the state never donated


def test_a_donated_step_failing_after_marking_its_state_saves_nothing(monkeypatch):
    assert _donated_run(3, "update", monkeypatch) == {}


def test_a_donating_step_of_your_own_is_never_trusted_after_a_failure(monkeypatch):
    assert _donated_run(3, "loss", monkeypatch, own_step=True) == {}


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("fails", ["evaluate", "record", "save"])
def test_a_failure_after_the_step_returned_saves_the_new_state(donate, fails):
    """Evaluation, logging or the policy save failing after step 3 returned: step 3 is
    whole (with donation the input is gone), so it is the one the emergency save keeps."""
    state, step = adamw_setup(donate)
    saved = {}

    def boom(where: str, n: int) -> None:
        if where == fails and n == 3:
            raise RuntimeError(f"{where} failed")

    def save(state, metrics, *, force, reason):
        boom("save" if not force else "", int(state["step"]))
        if force:
            saved[reason] = state.clone()
        return force

    def evaluate(state):
        boom("evaluate", int(state["step"]))
        return {"val": 0.0}

    def record(kind, **fields):
        boom("record" if kind == "step" else "", fields.get("step", 0))

    with pytest.raises(RuntimeError, match=f"{fails} failed"):
        train_loop(
            state,
            step,
            _batches(),
            max_steps=10,
            save=save,
            evaluate=evaluate,
            eval_every=1,
            record=record,
            donate=donate,
        )
    assert set(saved) == {"emergency"}
    want, got = _undonated_state_at(3), saved["emergency"]
    for key, t in want.items(True, True):
        assert torch.equal(got[key], t), key


def test_a_donated_step_whose_check_fails_saves_its_result():
    """The record of a non-finite step (on_nonfinite="continue") fails: the donated input
    is gone, so the emergency save keeps the step's whole result, step 3."""
    state, step = adamw_setup(donate=True)
    saved = {}

    def batches():
        for i in range(10):
            yield {"x": torch.full((4, 2), float("nan") if i == 2 else 1.0)}

    def save(state, metrics, *, force, reason):
        if force:
            saved[reason] = int(state["step"])
            saved["loss"] = float(metrics["loss"])
        return force

    with pytest.raises(OSError, match="metrics disk"):
        train_loop(
            state,
            step,
            batches(),
            max_steps=10,
            save=save,
            record=_failing_record("nonfinite"),
            donate=True,
            on_nonfinite="continue",
        )
    assert saved["emergency"] == 3
    assert saved["loss"] != saved["loss"], "saved with step 3's own (non-finite) loss"


def test_a_stop_before_the_first_step_saves_nothing():
    """A stop requested before anything was trained (a preemption notice during start-up):
    the state is the start's, fresh or already committed; a save of a fresh step 0 would
    make a requeue with resume=none refuse to start over a checkpoint."""
    state, step = _setup()
    saves, stop = Saves(), StopFlag()
    stop.request("SIGTERM")
    result = train_loop(state, step, _batches(), max_steps=10, save=saves, stop=stop)
    assert result.status == "stopped" and int(result.state["step"]) == 0
    assert saves.calls == []


def test_a_metric_of_several_elements_from_a_users_step_is_named():
    """A step of the user's own returning a per-sample metric failed at ``.item()`` with
    'a Tensor with 4 elements cannot be converted to Scalar', naming no metric."""
    state, step = _setup()

    def per_sample(s, b):
        new, metrics = step(s, b)
        return new, {**metrics, "per_sample": torch.ones(4)}

    with pytest.raises(TypeError, match=r"the step's metric 'per_sample' has shape \(4,\)"):
        train_loop(state, per_sample, _batches(), max_steps=2)


def test_an_emergency_save_that_fails_on_the_metrics_is_made_without_them():
    """An ``evaluate`` returning a value the checkpoint cannot hold failed the policy save
    and then the emergency save with the same metrics: every step since the last commit was
    lost. A ``record`` that raises there no longer replaces the step's error either."""
    state, step = _setup()
    saved = []

    def save(s, metrics, *, force, reason):
        if any(isinstance(v, torch.Tensor) and v.dim() for v in metrics.values()):
            raise ValueError("metrics must be JSON-serialisable")
        saved.append((int(s["step"]), reason))
        return True

    with pytest.raises(ValueError, match="JSON-serialisable"):
        train_loop(
            state, step, _batches(), max_steps=10, save=save,
            record=_failing_record("emergency_save"),
            evaluate=lambda s: {"extra": torch.ones(3)}, eval_every=2,
        )  # fmt: skip
    assert saved[-1] == (2, "emergency")


def test_a_loader_given_itself_starts_at_the_states_cursor():
    """``train_loop(restored, step, loader)``: the Loader iterated from its start, so a
    resume trained on the first batches again and ended elsewhere than an unbroken run,
    without a word."""
    from ftrain.data import Loader
    from ftrain.data.sources import TensorSource
    from ftrain.rng import key

    model = torch.nn.Linear(4, 1)
    tx = ftrain.optim.sgd(0.01)
    step = ftrain.make_step(model, lambda m, b: m(b["x"].float()).pow(2).mean(), tx)
    loader = Loader(TensorSource(torch.arange(200), block_size=4), global_batch=4, key=key(0))
    whole = train_loop(ftrain.init_state(model, tx, seed=0), step, loader, max_steps=6)
    half = train_loop(ftrain.init_state(model, tx, seed=0), step, loader, max_steps=3)
    rest = train_loop(half.state, step, loader, max_steps=6)
    assert ftrain.tree_equal(rest.state, whole.state)
    loader.close()


def test_an_emergency_save_records_the_host_generators_of_the_state_it_saves(tmp_path):
    """A user's ``torch.nn.Dropout`` draws from torch's global generator: the emergency
    save recorded it as the failed step's forward had left it, so a resume with
    ``host_rng=True`` drew other masks than an unbroken run."""
    from tensordict import TensorDict

    from ftrain.ckpt import CheckpointManager

    def setup(fail_at=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)
        )
        tx, calls = ftrain.optim.sgd(0.1), []

        def loss(m, b):
            out = m(b["x"]).pow(2).mean()
            calls.append(1)
            if len(calls) == fail_at:
                raise RuntimeError("the loss failed after the forward")
            return out

        return ftrain.make_step(model, loss, tx), ftrain.init_state(model, tx, seed=0)

    def loop(step, state, manager=None):
        batches = iter(lambda: TensorDict(x=torch.ones(2, 4), batch_size=[2]), None)

        def save(s, metrics, *, force, reason):
            if manager is None or reason == "policy":
                return False
            return manager.save(s, metrics=metrics, force=force)

        return train_loop(state, step, batches, max_steps=6, save=save).state

    with pytest.warns(UserWarning, match="cursor"):
        whole = loop(*setup())
        with CheckpointManager(tmp_path, async_save=False) as m, pytest.raises(RuntimeError):
            loop(*setup(fail_at=4), manager=m)
        step, _ = setup()
        torch.manual_seed(123)  # what the resume puts back must win over this
        with CheckpointManager(tmp_path, async_save=False) as m:
            assert m.all_steps() == [3]
            resumed = m.restore(host_rng=True)
        end = loop(step, resumed)
    assert ftrain.tree_equal(end, whole)


def test_a_manager_given_as_save_has_its_emergency_save_committed_when_the_loop_raises(
    tmp_path,
):
    """An async manager's emergency save was still being written when train_loop raised:
    ``latest_step()`` said None, and a retry restarted from scratch. Given the manager
    itself, the loop saves by its policy and waits for every forced save."""
    from ftrain.ckpt import CheckpointManager

    state, step = _setup()

    def failing(s, b):
        if int(s["step"]) == 2:
            raise RuntimeError("boom")
        return step(s, b)

    with CheckpointManager(tmp_path, async_save=True, save_policy=ftrain.EveryNSteps(100)) as m:
        with pytest.raises(RuntimeError, match="boom"):
            train_loop(state, failing, _batches(), max_steps=10, save=m)
        assert m.latest_step() == 2
        done = train_loop(m.restore(), step, _batches(), max_steps=4, save=m)
        assert m.latest_step() == 4 and int(done.state["step"]) == 4
