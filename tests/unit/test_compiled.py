"""make_step(compile=True): one graph, no breaks, eager's numbers, a compile only per layout.

Compiling takes ~10-60 s on a loaded 2-core CPU, so these tests are few, tiny and slow.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from tensordict import TensorDict
from torch._dynamo.callback import callback_handler
from torch._dynamo.utils import counters

import ftrain
import ftrain.compiled
from ftrain import watchdog
from ftrain.recipes.gpt2 import GPT, GPTConfig, lm_loss
from ftrain.recipes.mlp_regression.model import MLP, make_data, mse_loss
from ftrain.state.tree import flatten
from ftrain.step import _split_batch

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tx():
    sched = ftrain.optim.schedule.warmup_cosine(1e-2, 2, 10)
    return ftrain.optim.chain(ftrain.optim.clip_by_global_norm(1.0), ftrain.optim.adamw(sched))


def _mlp():
    return MLP(8, 32, 1, generator=torch.Generator().manual_seed(0))


def _tokens(batch: int, seed: int) -> TensorDict:
    tok = torch.randint(0, 256, (batch, 17), generator=torch.Generator().manual_seed(seed))
    return TensorDict(x=tok[:, :-1], y=tok[:, 1:], batch_size=[batch])


def _max_diff(a, b) -> float:
    pairs = zip(flatten(a)[1], flatten(b)[1], strict=True)
    return max(float((x - y).abs().max()) for x, y in pairs if x.is_floating_point())


def _explain(step, state, batch):
    _, micro = _split_batch(batch, 1)
    out = step.core.explain(
        flatten(state["params"]), flatten(state["buffers"]), state["opt"], micro
    )
    # explain resets Dynamo, compile callbacks included: the watchdog's is back
    assert watchdog._dynamo_compile_started in callback_handler.start_callbacks
    return out


def test_compiled_mlp_matches_eager_and_recompiles_only_for_new_shapes(capsys):
    model, tx = _mlp(), _tx()
    eager = ftrain.make_step(model, mse_loss, tx)
    compiled = ftrain.make_step(model, mse_loss, tx, compile=True)
    a = b = ftrain.init_state(model, tx, seed=0)
    graphs = []
    for i in range(3):
        a, ma = eager(a, make_data(16, seed=i))
        b, mb = compiled(b, make_data(16, seed=i))
        graphs.append(counters["stats"]["unique_graphs"])
        assert ("compile_s" in mb.keys()) == (i == 0)  # the compile is reported once
        for name in ("loss", "grad_norm", "lr"):
            torch.testing.assert_close(mb[name], ma[name], rtol=1e-5, atol=1e-6)
    assert _max_diff(a, b) < 1e-5
    assert compiled.core.compiles == 1 and compiled.core.compile_seconds > 0
    assert graphs[0] == graphs[-1], "Dynamo recompiled for the same shapes (lr, count changed)"
    err = capsys.readouterr().err
    assert err.count("compiled the step in") == 1 and "graphs, not one" not in err
    b, _ = compiled(b, make_data(8, seed=9))  # a new batch shape: one more compile
    b, _ = compiled(b, make_data(8, seed=10))
    assert compiled.core.compiles == 2


def test_a_graph_break_in_the_loss_is_said_not_passed_over(capsys):
    """A print in the user's loss split the step at the forward: Dynamo ran the forward
    and backward eagerly and compiled only the update, while ftrain said "compiled the
    step" and nothing else. The step's graphs and the break's reason are said now."""

    def chatty_loss(model, batch):
        print("in the loss")  # a graph break
        return mse_loss(model, batch)

    model, tx = _mlp(), _tx()
    step = ftrain.make_step(model, chatty_loss, tx, compile=True)
    state, _ = step(ftrain.init_state(model, tx, seed=0), make_data(16, seed=0))
    err = capsys.readouterr().err
    assert "compiled the step in" in err
    assert "graphs, not one: a graph break (" in err and "TORCH_LOGS=graph_breaks" in err, err


def test_compiled_donate_matches_pure_and_poisons_input():
    model, tx = _mlp(), _tx()
    pure = ftrain.make_step(model, mse_loss, tx, compile=True)
    donated = ftrain.make_step(model, mse_loss, tx, compile=True, donate=True)
    a = b = ftrain.init_state(model, tx, seed=0)
    for i in range(2):
        old = b
        a, _ = pure(a, make_data(16, seed=i))
        b, _ = donated(b, make_data(16, seed=i))
    assert _max_diff(a, b) < 1e-6  # two graphs, fused differently: equal up to rounding
    with pytest.raises(RuntimeError, match="donated"):
        donated(old, make_data(16, seed=0))
    # a state an async save still reads (pinned): the compiled in-place graph runs on a
    # copy, the saved state stays intact, and nothing is compiled again mid-run (a second,
    # out-of-place graph stalled that step for tens of seconds: a "hang" to the watchdog)
    twin = b.clone()
    kept = b.clone()
    ftrain.state.pin(b)
    c, _ = donated(b, make_data(16, seed=5))
    ftrain.state.unpin(b)
    assert donated.core.compiles == 1 and not ftrain.state.is_donated(b)
    assert _max_diff(b, kept) == 0
    d, _ = donated(twin, make_data(16, seed=5))
    assert _max_diff(c, d) == 0  # the same graph: the same bits


def test_compiled_pure_writes_into_the_buffers_of_the_state_two_steps_back():
    model, tx = _mlp(), _tx()
    eager = ftrain.make_step(model, mse_loss, tx)
    compiled = ftrain.make_step(model, mse_loss, tx, compile=True)
    a = b = ftrain.init_state(model, tx, seed=0)
    ptrs, kept = [], {}
    for i in range(6):
        a, _ = eager(a, make_data(16, seed=i))
        b, _ = compiled(b, make_data(16, seed=i))
        if i == 0:
            graphs = counters["stats"]["unique_graphs"]
        ptrs.append(flatten(b["params"])[1][0].data_ptr())
        if i == 3:  # a state the caller keeps is never written, in the graph or out
            kept = {"state": b, "copy": b.clone()}
    assert _max_diff(a, b) < 1e-5
    assert ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1], "steps 3, 4 reuse steps 1, 2's buffers"
    assert ptrs[4] == ptrs[2] and ptrs[5] != ptrs[3], "the state held after step 4 is not reused"
    assert ftrain.state.tree_equal(kept["state"], kept["copy"])
    assert counters["stats"]["unique_graphs"] == graphs, "a new pool buffer recompiled"


@pytest.mark.parametrize("recipe", ["mlp", "gpt2_tiny"])
def test_the_recipes_compile_to_one_graph_without_breaks(recipe):
    if recipe == "mlp":
        model, loss_fn, batch = _mlp(), mse_loss, make_data(16, seed=0)
    else:  # as conf/model/gpt2_tiny.yaml: dropout 0
        model = GPT(GPTConfig.tiny(dropout=0.0), generator=torch.Generator().manual_seed(0))
        loss_fn, batch = lm_loss, _tokens(4, seed=0)
    tx = _tx()
    step = ftrain.make_step(model, loss_fn, tx, compile=True)
    out = _explain(step, ftrain.init_state(model, tx, seed=0), batch)
    assert (out.graph_count, out.graph_break_count) == (1, 0), out.break_reasons


@pytest.mark.parametrize("donate", [False, True])
def test_compiled_fp16_loss_scale_skips_like_eager_without_a_graph_break(donate, monkeypatch):
    monkeypatch.setattr(ftrain.compiled, "CPP_WRAPPER", True)
    model = _mlp()
    inner = ftrain.optim.chain(ftrain.optim.clip_by_global_norm(1.0), ftrain.optim.sgd(0.05, 0.9))
    tx = ftrain.optim.dynamic_loss_scale(inner, init_scale=2.0**10)
    eager = ftrain.make_step(model, mse_loss, tx, precision="fp16")
    compiled = ftrain.make_step(model, mse_loss, tx, precision="fp16", compile=True, donate=donate)
    a = b = ftrain.init_state(model, tx, seed=0, precision="fp16")
    for i in range(3):
        batch = make_data(16, seed=i)
        if i == 1:  # overflows fp16: both skip the update and back the scale off
            batch = batch.clone().set("x", batch["x"] * 1e5)
        a, _ = eager(a, batch)
        b, _ = compiled(b, batch)
    # torch 2.13's C++ wrapper cannot emit the unscale's kernel: compiled again with
    # Python's before anything was written (the donated state's first step is still right)
    assert ftrain.tree_equal(a["opt", "loss_scale"], b["opt", "loss_scale"])
    assert int(b["opt", "loss_scale", "skipped"]) == 1
    assert _max_diff(a, b) < 1e-6
    _, micro = _split_batch(make_data(16, seed=0), 1)
    args = flatten(b["params"]), flatten(b["buffers"]), b["opt"], micro
    out = compiled.core.explain(*args, scale=b["opt", "loss_scale", "scale"])
    assert (out.graph_count, out.graph_break_count) == (1, 0), out.break_reasons


def test_keyed_dropout_still_runs_compiled_with_the_eager_masks():
    model = GPT(GPTConfig.tiny(n_layer=1), generator=torch.Generator().manual_seed(0))
    assert model.config.dropout > 0
    tx = ftrain.optim.adamw(1e-3)
    state = ftrain.init_state(model, tx, seed=0)
    a, _ = ftrain.make_step(model, lm_loss, tx)(state, _tokens(2, seed=0))
    b, _ = ftrain.make_step(model, lm_loss, tx, compile=True)(state, _tokens(2, seed=0))
    assert _max_diff(a, b) < 1e-5  # the same keyed masks: only rounding differs


def test_batchnorm_running_stats_update_in_the_compiled_graph_as_in_eager():
    """A forward that writes its buffers in place crashed the compiled step with a
    452-line trace from torch.func: the buffers now enter the transform as inputs."""
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(
        MLP(8, 16, 16, generator=gen), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1)
    )
    tx = ftrain.optim.sgd(0.05, 0.9)  # Adam would amplify the rounding of b2's zero gradient
    eager = ftrain.make_step(model, mse_loss, tx)
    compiled = ftrain.make_step(model, mse_loss, tx, compile=True)
    a = b = ftrain.init_state(model, tx, seed=0)
    for i in range(2):
        a, _ = eager(a, make_data(16, seed=i))
        b, _ = compiled(b, make_data(16, seed=i))
    assert int(b["buffers", "1", "num_batches_tracked"]) == 2
    assert not torch.equal(b["buffers", "1", "running_mean"], torch.zeros(16))
    assert _max_diff(a, b) < 1e-5


def test_compile_refuses_what_it_cannot_put_in_one_graph():
    model, tx = _mlp(), _tx()
    with pytest.raises(ValueError, match="compile=True"):
        ftrain.make_step(model, mse_loss, tx, compile=True, clip=1.0)


def test_compile_auto_compiles_only_runs_that_repay_it_and_can_be_one_graph():
    from ftrain.compiled import AUTO_MIN_STEPS, should_compile

    assert should_compile("auto", AUTO_MIN_STEPS) == (
        True,
        f"compiling the step: a {AUTO_MIN_STEPS:,}-step run repays the compile",
    )
    assert should_compile("auto", AUTO_MIN_STEPS - 1)[0] is False
    assert should_compile("auto", 10**6, world_size=2) == (
        False,
        "eager: a 2-rank, shard=none step is not one graph",
    )
    assert should_compile("auto", 10**6, shard="optimizer")[0] is False
    assert should_compile(True, 1) == (True, "trainer.compile=true")
    assert should_compile(False, 10**6) == (False, "trainer.compile=false")


def test_only_a_failed_cpp_wrapper_compile_is_retried_with_pythons(monkeypatch, capsys, tmp_path):
    """Inductor failing at the first call: with the C++ wrapper on, compiled again with
    Python's (nothing ran yet); with it off the error is the user's, raised once."""
    from torch._inductor.exc import InductorError

    real, calls = ftrain.compiled._compile, []

    def failing_cpp(core, cpp_wrapper):
        calls.append(cpp_wrapper)
        if cpp_wrapper or len(calls) > 2:

            def fail(*args):
                raise InductorError(RuntimeError("cannot emit this kernel"), None)

            return fail
        return real(core, cpp_wrapper)

    monkeypatch.setattr(ftrain.compiled, "_compile", failing_cpp)
    model, tx = _mlp(), _tx()
    monkeypatch.setattr(ftrain.compiled, "CPP_WRAPPER", True)
    step = ftrain.make_step(model, mse_loss, tx, compile=True)
    new, _ = step(ftrain.init_state(model, tx, seed=0), make_data(16, seed=0))
    assert calls == [True, False] and int(new["step"]) == 1
    assert "the C++ wrapper failed" in capsys.readouterr().err
    monkeypatch.setattr(ftrain.compiled, "CPP_WRAPPER", False)
    step = ftrain.make_step(model, mse_loss, tx, compile=True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind"))
    with pytest.raises(InductorError):  # an empty cache: not the cause, compiled once
        step(ftrain.init_state(model, tx, seed=0), make_data(16, seed=0))
    assert calls == [True, False, False], "a real failure is not compiled twice"
    (tmp_path / "ind" / "kernel.py").write_text("")
    with pytest.raises(InductorError):  # a cache with files: once more in a new one
        step(ftrain.init_state(model, tx, seed=0), make_data(16, seed=0))
    assert calls == [True, False, False, False, False]
    # it failed there too: back to the old cache, the new one removed
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "ind")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ind"]
    assert "back to" in capsys.readouterr().err


def test_a_donated_state_whose_compile_failed_is_still_whole(monkeypatch):
    """The compile runs inside the call that was to write the donated state: a failure
    there ran nothing, so the state is not marked donated and the loop's emergency save
    writes it (ftrain.loop trusts the mark)."""
    from torch._inductor.exc import InductorError

    def failing(core, cpp_wrapper):
        def fail(*args):
            raise InductorError(RuntimeError("out of memory while compiling"), None)

        return fail

    model, tx = _mlp(), _tx()
    step = ftrain.make_step(model, mse_loss, tx, compile=True, donate=True)
    state = ftrain.init_state(model, tx, seed=0)
    saved = {}

    def save(s, metrics, *, force, reason):
        if force:
            saved[reason] = s.clone()
        return force

    with monkeypatch.context() as m:
        m.setattr(ftrain.compiled, "_compile", failing)
        with pytest.raises(InductorError):
            ftrain.train_loop(
                state, step, iter([make_data(16, seed=0)]), max_steps=1, save=save, donate=True
            )
    assert not ftrain.state.is_donated(state)
    assert ftrain.state.tree_equal(saved["emergency"], state)
    new, _ = step(state, make_data(16, seed=0))  # compiles for real this time
    assert int(new["step"]) == 1 and ftrain.state.is_donated(state)


def test_a_loss_raising_while_a_new_layout_is_traced_leaves_the_donated_state_whole():
    """The user's loss raising while Dynamo traces a new batch shape ran no kernel: the
    donated state is not marked, so the loop's emergency save still writes it."""

    def strict_loss(model, batch):
        if batch["x"].shape[0] != 16:
            raise ValueError("a partial batch")
        return mse_loss(model, batch)

    model, tx = _mlp(), _tx()
    step = ftrain.make_step(model, strict_loss, tx, compile=True, donate=True)
    saved = {}

    def save(s, metrics, *, force, reason):
        if force:
            saved[reason] = (s.clone(), ftrain.state.is_donated(s))
        return force

    batches = [make_data(16, seed=0), make_data(16, seed=1), make_data(8, seed=2)]
    with pytest.raises(ValueError, match="a partial batch"):
        ftrain.train_loop(
            ftrain.init_state(model, tx, seed=0),
            step,
            iter(batches),
            max_steps=3,
            save=save,
            donate=True,
        )
    state, donated = saved["emergency"]
    assert not donated and int(state["step"]) == 2
    twin = ftrain.init_state(model, tx, seed=0)
    for batch in batches[:2]:
        twin, _ = ftrain.make_step(model, strict_loss, tx)(twin, batch)
    assert _max_diff(state, twin) < 1e-5


def test_a_loss_that_leaves_torch_fails_the_compiled_step_with_a_note_saying_why():
    """``.numpy()`` in the loss trains eagerly; compiled it failed with "Cannot access data
    pointer of Tensor that doesn't have storage" and no word of the tracing."""

    def numpy_loss(model, batch):
        weight = float(model(batch["x"]).detach().numpy().mean())
        loss, aux = mse_loss(model, batch)
        return loss * weight, aux

    model, tx = _mlp(), _tx()
    step = ftrain.make_step(model, numpy_loss, tx, compile=True)
    with pytest.raises(Exception) as raised:  # noqa: PT011 - whatever torch raises
        step(ftrain.init_state(model, tx, seed=0), make_data(16, seed=0))
    note = " ".join(getattr(raised.value, "__notes__", []))
    assert "first compiled call" in note and "(.numpy(), .tolist()" in note
    eager = ftrain.make_step(model, numpy_loss, tx)
    assert int(eager(ftrain.init_state(model, tx, seed=0), make_data(16, seed=0))[0]["step"]) == 1


def test_a_backend_failure_says_the_cache_may_be_damaged_not_that_the_loss_is_wrong():
    """A damaged Inductor cache (truncated .py/.so files) fails every start with
    BackendCompilerFailed; the note blamed the loss's tracing (.numpy(), .tolist())."""
    from torch._dynamo.exc import BackendCompilerFailed

    from ftrain.compiled import _note_for

    damaged = BackendCompilerFailed(print, RuntimeError("Failed to import x.py"), None)
    assert "a damaged cache is ruled out unless" in _note_for(damaged)
    assert "TORCHINDUCTOR_CACHE_DIR" in _note_for(damaged)
    assert "(.numpy(), .tolist()" in _note_for(RuntimeError("no storage"))
    assert _note_for(MemoryError()) is None


def test_a_backend_failure_with_a_cache_that_holds_files_moves_to_a_new_cache(
    tmp_path, monkeypatch, capsys
):
    """The caller compiles once more in a new empty cache beside the old one, said with
    both paths; an empty cache (nothing to blame) or one whose parent refuses a new
    directory is not retried."""
    from torch._dynamo.exc import BackendCompilerFailed

    from ftrain.compiled import _into_a_fresh_cache

    failed = BackendCompilerFailed(
        print, AttributeError("module 'x' has no attribute 'call'"), None
    )
    old = tmp_path / "cache"
    old.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(old))
    assert _into_a_fresh_cache(failed) is None  # empty: the cache is not the cause
    (old / "kernel.py").write_text("")
    new = _into_a_fresh_cache(failed)[1]
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == new == f"{old}.fresh"
    assert os.listdir(new) == []
    err = capsys.readouterr().err
    assert f"compile cache at {old} (AttributeError: module 'x' has no attribute 'call')" in err
    assert f"in the cache at {new}" in err and f"{old} is damaged" in err
    # a later start reuses it: the restarts of a supervisor do not each make a cold one
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(old))
    assert _into_a_fresh_cache(failed) == (str(old), new, False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "cache.fresh"]


@pytest.mark.long
def test_a_damaged_compile_cache_is_recompiled_into_a_new_one_not_a_failure_every_start(
    tmp_path,
):
    """Truncated .py/.so files in the Inductor cache (a full disk, a kill mid-write) made
    every start fail with BackendCompilerFailed; now the step compiles in a new cache and
    matches eager."""
    script = tmp_path / "step.py"
    script.write_text(_COMPILE_ONE_STEP)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind"))
    run = [sys.executable, str(script)]
    first = subprocess.run(run, capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0 and "same" in first.stdout, first.stderr[-3000:]
    cached = [p for p in (tmp_path / "ind").rglob("*") if p.suffix in (".py", ".so")]
    assert cached
    for p in cached:
        os.truncate(p, min(10, p.stat().st_size))
    again = subprocess.run(run, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0 and "same" in again.stdout, again.stderr[-3000:]
    assert "compiling once more in the cache at" in again.stderr
    assert "Traceback" not in again.stderr


_COMPILE_ONE_STEP = """
import torch, ftrain
from ftrain.recipes.mlp_regression.model import MLP, make_data, mse_loss
torch.set_num_threads(1)
model = MLP(8, 32, 1, generator=torch.Generator().manual_seed(0))
tx = ftrain.optim.adamw(1e-2)
s, m = ftrain.make_step(model, mse_loss, tx, compile=True)(
    ftrain.init_state(model, tx, seed=0), make_data(16, seed=0))
e, me = ftrain.make_step(model, mse_loss, tx)(ftrain.init_state(model, tx, seed=0), make_data(16, seed=0))
torch.testing.assert_close(m["loss"], me["loss"], rtol=1e-5, atol=1e-6)
print("same")
"""


def test_a_donated_compiled_step_takes_a_state_of_inference_tensors():
    """Reading the leaves' version counters (to undo the mark after a failed trace) raised
    for inference tensors, which keep none, and left the state marked."""
    model, tx = _mlp(), ftrain.optim.sgd(0.1)
    with torch.inference_mode():
        state = ftrain.init_state(model, tx, seed=0)
    step = ftrain.make_step(model, mse_loss, tx, compile=True, donate=True)
    new, _ = step(state, make_data(16, seed=0))
    assert int(new["step"]) == 1 and ftrain.state.is_donated(state)


def test_each_compiled_step_has_its_own_recompile_budget(monkeypatch, capsys):
    """Every core was one nested function, so Dynamo counted all compiled steps (a sweep's
    jobs) against one recompile limit: past it they ran eagerly, logged as compiled."""
    model, tx = _mlp(), _tx()
    for seed in range(2):
        before = counters["stats"]["unique_graphs"]
        step = ftrain.make_step(model, mse_loss, tx, compile=True)
        with torch._dynamo.config.patch(recompile_limit=1):
            step(ftrain.init_state(model, tx, seed=seed), make_data(16, seed=seed))
        assert counters["stats"]["unique_graphs"] == before + 1, f"step {seed} ran eagerly"
    assert "no new graph" not in capsys.readouterr().err
    monkeypatch.setattr(ftrain.compiled, "_compile", lambda core, cpp_wrapper: core)  # no graph
    step = ftrain.make_step(model, mse_loss, tx, compile=True)
    step(ftrain.init_state(model, tx, seed=0), make_data(16, seed=0))
    assert "Dynamo compiled no new graph for this step: it runs eagerly" in capsys.readouterr().err


def test_masked_weight_decay_compiles_once_and_a_later_recompile_is_reported(capsys):
    """The weight-decay mask's per-structure cache was empty when first traced: Dynamo
    guarded on it and compiled again at step 2, in no log and no compile_s."""
    peak = {"lr": 1e-2}  # a Python value the schedule reads: changing it fails a guard

    def schedule(count):
        return peak["lr"] / (1.0 + count)

    tx = ftrain.optim.adamw(schedule, weight_decay=0.1, mask=lambda path, t: t.ndim >= 2)
    model = _mlp()
    step = ftrain.make_step(model, mse_loss, tx, compile=True)
    state = ftrain.init_state(model, tx, seed=0)
    before = counters["stats"]["unique_graphs"]
    for i in range(3):
        state, metrics = step(state, make_data(16, seed=i))
        assert ("compile_s" in metrics.keys()) == (i == 0)
    assert counters["stats"]["unique_graphs"] == before + 1
    peak["lr"] = 5e-3
    state, metrics = step(state, make_data(16, seed=3))
    assert "compile_s" in metrics.keys() and step.core.compiles == 2
    err = capsys.readouterr().err
    assert err.count("ftrain: compiled the step in") == 1 and "recompiled the step in" in err


def test_the_start_refuses_compile_true_on_several_ranks_naming_the_fixes():
    """make_step refused compile with dp only at the first step, with a traceback."""
    from omegaconf import OmegaConf

    from ftrain.cli.run import _check_compiler
    from ftrain.config import ConfigError
    from ftrain.dist import World

    t = OmegaConf.create({"compile": True})
    with pytest.raises(ConfigError, match="this run has 2 ranks .* trainer.compile=false"):
        _check_compiler(t, torch.device("cpu"), World(0, 2))
    _check_compiler(OmegaConf.create({"compile": "auto"}), torch.device("cpu"), World(0, 2))
    _check_compiler(t, torch.device("cpu"), World())  # one rank, a compiler here: fine


def test_a_cxx_that_answers_its_version_but_cannot_build_is_a_compiler_problem():
    """Inductor's probe runs only `$CXX --version`: CXX=/bin/true passed it and the first
    step failed with a 100-line InductorError. A tiny library is built too."""
    problem = ftrain.compiled._cannot_build("/bin/true")
    assert problem is not None and "/bin/true cannot build a test library" in problem
    assert "did not run" in ftrain.compiled._cannot_build("/nonexistent/c++")
    assert ftrain.compiled.cxx_compiler_problem() is None  # this machine's g++ builds it
