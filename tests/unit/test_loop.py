import pytest
import torch

import ftrain
from ftrain.loop import train_loop
from ftrain.signals import StopFlag


def _setup():
    model = torch.nn.Linear(2, 1)
    tx = ftrain.optim.sgd(0.1)
    step = ftrain.make_step(model, lambda m, b: m(b["x"]).pow(2).mean(), tx)
    return ftrain.init_state(model, tx, seed=0), step


def _batches():
    while True:
        yield {"x": torch.ones(4, 2)}


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


def test_stop_flag_signal_handler(monkeypatch):
    import signal

    with StopFlag() as flag:
        signal.raise_signal(signal.SIGUSR1)
        assert flag.requested and flag.reason == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is not flag._handle


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
