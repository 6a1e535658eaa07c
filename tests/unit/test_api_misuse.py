"""Misuse of the library API gets a clear error naming the value and the fix (or, where
the input has a sensible meaning, that meaning) — never a torch or zarr trace, never a
silently wrong result."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import ftrain
from ftrain import optim
from ftrain.ckpt import CheckpointManager


def _state(step: int = 1) -> TensorDict:
    return TensorDict({"step": torch.tensor(step), "w": torch.arange(6.0).reshape(2, 3)}, [])


@pytest.mark.parametrize("name", ["chunk_bytes", "io_workers"])
@pytest.mark.parametrize("value", [0, -1, 10.5, True])
def test_manager_sizes_are_whole_positive_numbers(tmp_path, name, value):
    # chunk_bytes=0 used to divide by zero inside the first save
    with pytest.raises(ValueError, match=rf"{name}={value!r}\): expected a whole number"):
        CheckpointManager(tmp_path, **{name: value})


def test_a_meta_leaf_is_refused_at_save_naming_it(tmp_path):
    state = _state().set("lazy", torch.empty(4, device="meta"))
    with CheckpointManager(tmp_path, async_save=False) as m:
        with pytest.raises(ValueError, match=r"meta device .*: lazy; materialize them"):
            m.save(state)
        assert m.save(_state()) and m.all_steps() == [1]  # nothing half-done


def test_a_meta_template_restores_values_on_the_cpu(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(_state())
        template = _state(0).to("meta")
        got = m.restore(target=template)
    assert got["w"].device.type == "cpu" and torch.equal(got["w"], _state()["w"])


@pytest.mark.parametrize("only", [(), [], "", [""], ["w", ""]])
def test_an_empty_only_is_refused(tmp_path, only):
    """``only=""`` (the root group's name) restored an empty TensorDict."""
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(_state())
        said = "names no key; pass only=None" if only in ((), []) else "only=.. matches nothing"
        with pytest.raises(ValueError, match=said + r".*'step', 'w'"):
            m.restore(only=only)


@pytest.mark.parametrize(
    "grad", [torch.ones(()), torch.ones(1, 3), torch.ones(3, 2), torch.ones(2, 3).half()]
)
@pytest.mark.parametrize("make", [lambda: optim.sgd(0.1), lambda: optim.adamw(0.1)])
def test_an_update_of_another_shape_or_dtype_is_refused(make, grad):
    # a 0-d or (1, 3) gradient broadcast silently into the update and the moments
    params = TensorDict({"w": torch.ones(2, 3)}, [])
    tx = make()
    with pytest.raises(
        ValueError, match=r"the update of 'w' is .*, its parameter float32 \(2, 3\)"
    ):
        tx.update(TensorDict({"w": grad}, []), tx.init(params), params)


def test_update_without_a_state_names_the_argument():
    params = TensorDict({"w": torch.ones(2)}, [])
    with pytest.raises(TypeError, match=r"adamw.update needs the optimizer state .* NoneType"):
        optim.adamw(0.1).update(params.clone(), None, params)


@pytest.mark.parametrize(
    "kw",
    [
        {"growth_factor": 0.5},
        {"backoff_factor": 2.0},
        {"growth_interval": 2.5},
        {"growth_interval": 0},
    ],
)
def test_loss_scale_rules_are_gradscalers(kw):
    # growth_interval=2.5 ran as 2; a growth_factor below 1 shrank the scale on success
    with pytest.raises(ValueError, match="dynamic_loss_scale needs"):
        optim.dynamic_loss_scale(optim.sgd(0.1), **kw)
    optim.dynamic_loss_scale(optim.sgd(0.1), growth_interval=2000.0)  # whole: fine


@pytest.mark.parametrize(
    "step", [torch.tensor(True), torch.tensor([3]), torch.tensor(2.0), torch.tensor(1j)]
)
def test_a_step_that_is_not_a_0d_integer_is_refused(tmp_path, step):
    # torch.tensor(True) was saved as step 1, a (1,)-shaped step as a step of its own
    m = CheckpointManager(tmp_path, async_save=False)
    with pytest.raises(ValueError, match=r"state\['step'\] must be a 0-d integer tensor"):
        m.save(TensorDict({"step": step, "w": torch.ones(2)}, []))
    m.close()


def test_a_metric_of_several_elements_is_named(tmp_path):
    with CheckpointManager(tmp_path) as m:  # async: refused in save(), not in the writer
        with pytest.raises(ValueError, match=r"metric 'acc': .*shape \(2,\); log its mean"):
            m.save(_state(), metrics={"loss": 1.0, "acc": torch.tensor([0.5, 0.7])})
        assert m.save(_state(), metrics={"acc": torch.tensor([0.6])})
        # numpy scalars (sklearn's metrics) were "not JSON serializable" in the writer
        assert m.save(_state(2), metrics={"f1": np.float32(0.5), "n": np.int64(3)})
    assert CheckpointManager(tmp_path).metadata(2)["metrics"] == {"f1": 0.5, "n": 3}


@pytest.mark.parametrize("donate", [False, True])
def test_a_state_of_another_optimizer_is_named_as_such(donate):
    """An AdamW state given to an SGD step failed inside the bucketed update: "a bucketable
    transform must return every entry of its state", a transform bug by its words."""
    model = torch.nn.Linear(4, 2)
    state = ftrain.init_state(model, ftrain.optim.adamw(1e-3), seed=0)
    sgd = ftrain.optim.sgd(0.1, momentum=0.9)
    step = ftrain.make_step(model, lambda m, b: m(b["x"]).pow(2).mean(), sgd, donate=donate)
    with pytest.raises(ValueError, match="not this step's optimizer's: missing .*init_state"):
        step(state, {"x": torch.ones(3, 4)})
    fitting = ftrain.init_state(model, sgd, seed=0)
    assert int(step(fitting, {"x": torch.ones(3, 4)})[0]["step"]) == 1


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_an_optimizer_state_that_does_not_fit_the_params_is_named(change, fused):
    """A moment of shape (1, 4) for a (2, 4) weight was broadcast into it without a word
    (the step ran, every row's moment made from row 0); a float64 moment for float32
    params failed inside torch's _foreach_lerp."""
    model = torch.nn.Linear(4, 2)
    tx = ftrain.optim.adamw(1e-3, fused=fused)
    state = ftrain.init_state(model, tx, seed=0)
    opt = state["opt"].clone()
    key = next(k for k in opt.keys(True, True) if "mu" in k and k[-1] == "weight")
    opt[key] = opt[key][:1] if change == "shape" else opt[key].double()
    step = ftrain.make_step(model, lambda m, b: m(b["x"]).pow(2).mean(), tx)
    said = "(1, 4)" if change == "shape" else "torch.float64(2, 4), not torch.float32(2, 4)"
    with pytest.raises(ValueError, match=r"optimizer state does not fit its params: .*weight"):
        try:
            step(ftrain.replace(state, opt=opt), {"x": torch.ones(3, 4)})
        except ValueError as err:
            assert said in str(err) and "init_state" in str(err), err
            raise
    assert int(step(state, {"x": torch.ones(3, 4)})[0]["step"]) == 1


@pytest.mark.parametrize("step", [torch.tensor(0.0), torch.tensor([0]), torch.tensor(False)])
def test_a_step_counter_that_is_not_a_0d_integer_is_refused_at_the_step(step):
    """A float step advanced to 1.0, 2.0, ...; only the first save refused it."""
    model = torch.nn.Linear(4, 2)
    tx = ftrain.optim.sgd(0.1)
    state = ftrain.replace(ftrain.init_state(model, tx, seed=0), step=step)
    run = ftrain.make_step(model, lambda m, b: m(b["x"]).pow(2).mean(), tx)
    with pytest.raises(ValueError, match=r"state\['step'\] must be a 0-d integer tensor"):
        run(state, {"x": torch.ones(3, 4)})


def test_a_loss_that_does_not_depend_on_the_params_is_named():
    """torch's "element 0 of tensors does not require grad and does not have a grad_fn"."""
    model = torch.nn.Linear(4, 2)
    tx = ftrain.optim.sgd(0.1)
    step = ftrain.make_step(model, lambda m, b: m(b["x"]).detach().pow(2).mean(), tx)
    with pytest.raises(ValueError, match="the loss does not depend on any trained parameter"):
        step(ftrain.init_state(model, tx, seed=0), {"x": torch.ones(3, 4)})


def test_replace_keeps_the_layout():
    """``replace(state, params=torch.ones(2))`` turned the params sub-tree into one leaf."""
    state = ftrain.init_state(torch.nn.Linear(2, 1), ftrain.optim.sgd(0.1), seed=0)
    with pytest.raises(TypeError, match=r"\['params'\] from a sub-tree into a Tensor"):
        ftrain.replace(state, params=torch.ones(2))
    with pytest.raises(TypeError, match=r"\['step'\] from a Tensor into a sub-tree"):
        ftrain.replace(state, step=TensorDict({"a": torch.ones(1)}, []))
    assert int(ftrain.replace(state, step=torch.tensor(3))["step"]) == 3


def test_tree_equal_names_a_leaf_without_values():
    """torch's "Cannot copy out of meta tensor" from deep inside the comparison."""
    real = TensorDict({"w": torch.zeros(2)}, [])
    with pytest.raises(ValueError, match="w: a meta tensor has a shape and no values"):
        ftrain.tree_equal(real, TensorDict({"w": torch.zeros(2, device="meta")}, []))
