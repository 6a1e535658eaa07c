"""Checkpoints inside a run: async saves vs donated steps, failed saves retried, host RNG restored."""

import threading

import pytest
import torch

import ftrain
from ftrain.state import first_difference, is_pinned


def _setup():
    model = torch.nn.Linear(4, 2)
    tx = ftrain.optim.adamw(1e-2)
    step = ftrain.make_step(model, lambda m, b: m(b["x"]).pow(2).mean(), tx, donate=True)
    return ftrain.init_state(model, tx, seed=0), step, {"x": torch.ones(8, 4)}


def test_in_flight_save_pins_the_state_against_donation(tmp_path, monkeypatch):
    state, step, batch = _setup()
    state, _ = step(state, batch)
    mgr = ftrain.CheckpointManager(tmp_path, async_save=True)
    release = threading.Event()
    real_write = mgr._write

    def slow_write(*args):
        release.wait(30)
        real_write(*args)

    monkeypatch.setattr(mgr, "_write", slow_write)
    expected = state.clone()
    assert mgr.save(state, force=True)
    assert is_pinned(state)
    later, _ = step(state, batch)  # must not overwrite the tensors the writer still reads
    assert first_difference(state, expected) is None
    release.set()
    mgr.wait()
    assert not is_pinned(state)
    assert first_difference(mgr.restore(1), expected) is None
    after, _ = step(later, batch)  # unpinned states are donated as usual
    with pytest.raises(RuntimeError, match="donated"):
        step(later, batch)
    mgr.close()


def test_saving_a_donated_state_is_refused(tmp_path):
    state, step, batch = _setup()
    step(state, batch)
    with (
        ftrain.CheckpointManager(tmp_path, async_save=False) as mgr,
        pytest.raises(RuntimeError, match="donated"),
    ):
        mgr.save(state, force=True)


def test_a_failed_save_can_be_retried_for_the_same_step(tmp_path, monkeypatch):
    state, step, batch = _setup()
    mgr = ftrain.CheckpointManager(tmp_path, async_save=False)
    real = mgr._write_to

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mgr, "_write_to", failing)
    with pytest.raises(ftrain.CheckpointSaveError):
        mgr.save(state, force=True)
    monkeypatch.setattr(mgr, "_write_to", real)
    assert mgr.save(state, force=True), "the emergency/final save of the same step must retry"
    assert mgr.all_steps() == [0]
    mgr.close()


def test_resume_puts_back_the_host_rng_states_for_user_code(tmp_path):
    import random

    from ftrain.cli.resume import _restore_host_rng
    from ftrain.dist import World

    state, _, _ = _setup()
    torch.manual_seed(123)
    random.seed(7)
    with ftrain.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(state, force=True)
        expected = (torch.rand(3), random.random())
        torch.manual_seed(999)
        random.seed(1)
        _restore_host_rng(mgr.metadata(0), World(0, 1))
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
