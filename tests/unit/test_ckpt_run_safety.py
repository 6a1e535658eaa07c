"""Checkpoints inside a run: async saves vs donated steps, failed saves retried, host RNG restored."""

import threading

import pytest
import torch

import ftrain
from ftrain.state import first_difference, is_pinned
from ftrain.state.init import is_donated, shares_pinned
from ftrain.state.tree import flatten


def _setup():
    model = torch.nn.Linear(4, 2)
    tx = ftrain.optim.adamw(1e-2)
    step = ftrain.make_step(model, lambda m, b: m(b["x"]).pow(2).mean(), tx, donate=True)
    return ftrain.init_state(model, tx, seed=0), step, {"x": torch.ones(8, 4)}


@pytest.mark.parametrize("saved", ["state", "exclude", "replace"])
def test_in_flight_save_pins_the_state_against_donation(tmp_path, monkeypatch, saved):
    """Also a TensorDict made from the state (``exclude``, ``replace``): it shares the
    buffers, and a donating step of the state overwrote them under the writer, which
    committed a later step's values that still passed their checksums."""
    state, step, batch = _setup()
    state, _ = step(state, batch)
    mgr = ftrain.CheckpointManager(tmp_path, async_save=True)
    release = threading.Event()
    real_write = mgr._write

    def slow_write(*args):
        release.wait(30)
        real_write(*args)

    monkeypatch.setattr(mgr, "_write", slow_write)
    view = {
        "state": lambda: state,
        "exclude": lambda: state.exclude("data"),
        "replace": lambda: ftrain.replace(state, step=state["step"].clone()),
    }[saved]()
    expected = view.clone()
    assert mgr.save(view, force=True)
    assert is_pinned(view) and shares_pinned(flatten(state["params"])[1])
    later, _ = step(state, batch)  # must not overwrite the tensors the writer still reads
    assert first_difference(view, expected) is None
    # the step after it writes its own buffers again, in place, the save still in flight:
    # only the rng and data leaves (never written) are shared with the saved state
    after_later, _ = step(later, batch)
    assert is_donated(later) and not shares_pinned(flatten(after_later["params"])[1])
    later = after_later
    release.set()
    mgr.wait()
    assert not is_pinned(view) and not shares_pinned(flatten(state["params"])[1])
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

    from omegaconf import OmegaConf

    from ftrain.cli.resume import host_rng_start
    from ftrain.dist import World

    cfg = OmegaConf.create({"trainer": {"seed": 5}})
    state, _, _ = _setup()
    torch.manual_seed(123)
    random.seed(7)
    with ftrain.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(state, force=True)
        expected = (torch.rand(3), random.random())
        torch.manual_seed(999)
        random.seed(1)
        said = host_rng_start(cfg, World(0, 1), mgr.metadata(0))
    assert "restored" in said
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_host_rngs_are_seeded_from_trainer_seed_per_rank_when_nothing_was_recorded():
    import random

    from omegaconf import OmegaConf

    from ftrain.cli.resume import host_rng_start
    from ftrain.dist import World

    def draws(seed, rank, meta=None):
        torch.manual_seed(999)
        random.seed(1)
        said = host_rng_start(OmegaConf.create({"trainer": {"seed": seed}}), World(rank, 2), meta)
        return said, (torch.rand(2).tolist(), random.random())

    said, a = draws(5, 0)
    assert "seeded from trainer.seed" in said
    assert draws(5, 0)[1] == a  # deterministic
    assert draws(5, 1)[1] != a and draws(6, 0)[1] != a  # per rank, per seed
    said, _ = draws(5, 1, {"step": 40, "host_rng": {"0": {}}})
    assert "none recorded for this rank" in said


def test_a_resume_on_another_cpu_thread_count_says_it_is_not_bit_identical(monkeypatch):
    """A requeue on a node with another core count resumed to other bits (torch's CPU
    reductions split by thread) without a word; now it is an accepted change, with the fix."""
    import torch

    from ftrain.cli import resume

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    (said,) = resume._thread_change({"cpu_threads": 1})
    assert said.startswith("CPU threads 1 -> 2") and "OMP_NUM_THREADS=1" in said
    assert resume._thread_change({"cpu_threads": 2}) == []
    assert resume._thread_change({}) == []  # a step written before it was recorded
    resume.check_run_metadata({"cpu_threads": 4})
    with pytest.raises(resume.CorruptCheckpointError, match="cpu_threads"):
        resume.check_run_metadata({"cpu_threads": "4"})
