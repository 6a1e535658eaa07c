"""Start from a local HF GPT-2, export to HF, evaluate, diff two runs: the real CLIs.

transformers models are built from a GPT2Config (nothing is downloaded; HF_HUB_OFFLINE=1).
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import ftrain
from ftrain import load_params
from ftrain.ckpt import CheckpointManager
from ftrain.cli.build import build_model
from ftrain.config import load_config
from ftrain.recipes.gpt2 import GPT, GPTConfig

from .conftest import TINY, records

os.environ["HF_HUB_OFFLINE"] = "1"
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2"]


def _transformers():
    return pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install 'ftrain[test]')"
    )


@pytest.fixture
def tool(forkserver):
    """``python -m MODULE ARGS`` (a child of the session's fork server: see conftest)."""

    def run(module, *args, env=None):
        return forkserver.run(list(map(str, args)), env or dict(os.environ), 240, module=module)

    return run


def _params(run_dir, step=None):
    with CheckpointManager(Path(run_dir) / "checkpoints", async_save=False) as m:
        return m.restore(step)["params"]


def _model(overrides):
    return build_model(load_config([*TINY, *overrides]))[0].eval()


def _x(n=32, seed=5):
    return torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def run8(tmp_path_factory, cache_dir, forkserver):
    """8 steps, checkpoints (and evals) at 4 and 8."""
    run = tmp_path_factory.mktemp("run8") / "run"
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir)
    args = [f"run.dir={run}", *TINY, "trainer.max_steps=8", "checkpoint.every_steps=4"]
    proc = forkserver.run(args, env, 240)
    assert proc.returncode == 0, proc.stderr
    return run


@pytest.fixture
def env(cache_dir):
    return dict(os.environ, FTRAIN_CACHE_DIR=cache_dir)


def _tree(path):
    return {p: p.stat().st_mtime_ns for p in sorted(Path(path).rglob("*"))}


def test_eval_reproduces_the_recorded_val_loss(tool, run8, env, tmp_path):
    recorded = {r["step"]: r["val_loss"] for r in records(run8, "eval")}
    assert set(recorded) == {4, 8}
    before = _tree(run8)
    for step in (4, 8):
        out = tool("ftrain.eval", run8, "--step", step, "--json", env=env)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert got["step"] == step and got["batches"] == 2 and got["samples"] == 8
        assert got["note"] is None and "note" not in out.stderr
        assert got["val_loss"] == pytest.approx(recorded[step], rel=1e-6, abs=1e-6)
        assert got["perplexity"] == pytest.approx(torch.tensor(recorded[step]).exp().item())
    assert _tree(run8) == before  # read-only: no lock, index, sweep or new file
    # the newest step by default, a human line, an override of the eval batches
    out = tool("ftrain.eval", run8, "trainer.eval_batches=1", env=env)
    assert (
        out.returncode == 0
        and out.stdout.startswith("step 8: val_loss ")
        and "1 batches" in out.stdout
    )
    # more batches than the split holds: the samples repeat, and the tool says so (as a
    # training run does; it said nothing)
    out = tool("ftrain.eval", run8, "trainer.eval_batches=60", "--json", env=env)
    assert out.returncode == 0 and "samples repeat in every evaluation" in out.stderr, out.stderr
    assert "samples repeat" in json.loads(out.stdout)["note"]
    # no optimizer state needed: a copy of the checkpoints without opt/ evaluates the same
    bare = tmp_path / "bare"
    shutil.copytree(run8 / "checkpoints", bare)
    for opt in bare.glob("step_*/opt"):
        shutil.rmtree(opt)
    out = tool("ftrain.eval", f"{bare}:4", "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["val_loss"] == pytest.approx(recorded[4], rel=1e-6, abs=1e-6)


def test_eval_errors_name_the_fix(tool, run8, env, tmp_path):
    out = tool("ftrain.eval", run8, "model.n_layer=2", env=env)
    assert out.returncode == 2 and "the model is the checkpoint's" in out.stderr
    out = tool("ftrain.eval", run8, "data.nope=1", env=env)
    assert out.returncode == 2 and "nope" in out.stderr
    out = tool("ftrain.eval", run8, "--step", 5, env=env)
    assert out.returncode == 1 and "available: [4, 8]" in out.stderr
    out = tool("ftrain.eval", f"{run8}:4", "--step", 8, env=env)  # it evaluated step 8
    assert out.returncode == 2 and "names step 4 but --step 8" in out.stderr
    out = tool("ftrain.eval", tmp_path / "absent", env=env)
    assert out.returncode == 1 and "no such checkpoint directory" in out.stderr
    out = tool("ftrain.eval", "r1:abc", env=env)  # a step that is not a number
    assert out.returncode == 2 and "RUN:STEP takes a step number, got 'abc'" in out.stderr
    out = tool("ftrain.eval", f"{run8}:abc", env=env)  # of a run that exists: exit 1 before
    assert out.returncode == 2 and "the part after ':' must be a step number" in out.stderr
    out = tool("ftrain.eval", f"{run8}:abc:5", env=env)  # :5 split off, RUN:abc the same
    assert out.returncode == 2 and "must be a step number, got 'abc'" in out.stderr, out.stderr
    # the tokenized val data cached into the checkpoint directory eval only reads
    out = tool("ftrain.eval", run8, f"data.cache_dir={run8 / 'checkpoints' / 'cache'}", env=env)
    assert out.returncode == 2 and "is inside the checkpoint directory" in out.stderr
    assert not (run8 / "checkpoints" / "cache").exists()
    assert "evaluates a model's params" not in out.stderr, out.stderr
    # the value checks of a training start apply (they were tracebacks)
    for bad, needle in [
        ("trainer.precision=fp64", "trainer.precision must be fp32, bf16 or fp16"),
        ("data.val_fraction=1.0", "data.val_fraction=1.0 is invalid"),
        ("data.block_size=1000", "data.block_size=1000 is invalid"),
        ("data._target_=os.getcwd", "data.name and data._target_ are the run's"),
        ("data.name=tokens", "data.name and data._target_ are the run's"),
    ]:
        out = tool("ftrain.eval", run8, bad, env=env)
        assert out.returncode == 2 and needle in out.stderr, (bad, out.stderr)
        assert "Traceback" not in out.stderr, out.stderr


def test_export_hf_loads_in_transformers_with_equal_logits(tool, run8, tmp_path):
    transformers = _transformers()
    out = tmp_path / "hf"
    done = tool("ftrain.ckpt", "export", run8 / "checkpoints", out, "--step", 4, "--format", "hf")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["n_positions"] == 32 and config["vocab_size"] == 256 and config["n_layer"] == 4
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf.lm_head.weight is hf.transformer.wte.weight
    ours = load_params(_model([]), _params(run8, 4))
    with torch.no_grad():
        torch.testing.assert_close(hf(_x()).logits, ours(_x()), rtol=1e-5, atol=1e-5)
    again = tool("ftrain.ckpt", "export", run8 / "checkpoints", out, "--format", "hf")
    assert again.returncode == 2 and "exists" in again.stderr


def _save_hf(path, n_positions=64, vocab_size=256, seed=0):
    transformers = _transformers()
    config = transformers.GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=64,
        n_layer=4,
        n_head=4,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # non-trivial biases and norms
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn(p.shape) * 0.1)
    model.save_pretrained(path)
    return model


def test_init_from_hf_with_lora_then_merged_hf_export(tool, cli, tmp_path):
    transformers = _transformers()
    hf = _save_hf(tmp_path / "gpt2")
    run = tmp_path / "lora"
    out = cli(
        run,
        *LORA,
        f"init.from_hf={tmp_path / 'gpt2'}",
        "trainer.max_steps=2",
        "checkpoint.every_steps=2",
        check=0,
    )
    assert f"initialised params from HF GPT-2 {tmp_path / 'gpt2'}: 52 tensors loaded" in out.stdout
    assert "position embeddings cropped from 64 to 32" in out.stdout and "24 new" in out.stdout
    params = _params(run, 2)
    # the base is frozen under LoRA, so step 2 still holds exactly the HF weights:
    # a plain GPT with them computes the HF model's logits (a missed transpose would not)
    plain = _model([])
    base = {k: v for k, v in params.flatten_keys(".").items() if ".lora_" not in k}
    load_params(plain, base)
    with torch.no_grad():
        torch.testing.assert_close(plain(_x()), hf(_x()).logits, rtol=1e-5, atol=1e-5)
    # export: adapters need --merge-lora; merged, transformers computes the LoRA model
    unmerged = tool("ftrain.ckpt", "export", run / "checkpoints", tmp_path / "x", "--format", "hf")
    assert unmerged.returncode == 2 and "add --merge-lora" in unmerged.stderr
    merged_dir = tmp_path / "merged"
    done = tool(
        "ftrain.ckpt", "export", run / "checkpoints", merged_dir, "--format", "hf", "--merge-lora"
    )
    assert done.returncode == 0 and "12 LoRA modules merged" in done.stdout, done.stderr
    adapted = load_params(_model(LORA), params)
    merged = transformers.GPT2LMHeadModel.from_pretrained(merged_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(_x()).logits, adapted(_x()), rtol=1e-5, atol=1e-5)


def test_init_from_hf_refusals(cli, tmp_path):
    _save_hf(tmp_path / "v300", vocab_size=300)
    out = cli(tmp_path / "r", f"init.from_hf={tmp_path / 'v300'}", check=2)
    assert "vocab_size=256 (HF: 300)" in out.stderr and "model.vocab_size=300" in out.stderr
    _save_hf(tmp_path / "p16", n_positions=16)
    out = cli(tmp_path / "r", f"init.from_hf={tmp_path / 'p16'}", check=2)
    assert "block_size=32 (HF: 16)" in out.stderr
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"never opened")
    out = cli(tmp_path / "r", f"init.from_hf={pickled}", check=2)
    assert "never unpickles pytorch_model.bin" in out.stderr
    out = cli(tmp_path / "r", f"init.from_hf={pickled}", f"init.from={tmp_path}", check=2)
    assert "set only one" in out.stderr
    weights = tmp_path / "v300" / "model.safetensors"
    out = cli(tmp_path / "r", f"init.from={weights}", check=2)
    assert "is a file; init.from takes a run or checkpoints directory" in out.stderr
    assert "init.from_hf" in out.stderr
    assert not list((tmp_path / "r").glob("checkpoints/step_*"))  # nothing trained


def test_init_from_hf_refuses_a_file_that_lacks_a_gpt2_tensor(cli, tmp_path):
    """A weights file without one of GPT-2's tensors loaded "fine" (that tensor left at
    its random start, one line of notes, exit 0): a full fine-tune trained a random MLP
    inside a pretrained model. Refused, naming the tensor."""
    from safetensors.torch import load_file, save_file

    _save_hf(tmp_path / "gpt2")
    weights = next((tmp_path / "gpt2").glob("*.safetensors"))
    tensors = load_file(str(weights))
    dropped = next(k for k in tensors if k.endswith("h.1.mlp.c_fc.weight"))
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(weights))
    out = cli(tmp_path / "r", f"init.from_hf={tmp_path / 'gpt2'}", check=2)
    assert "lacks 1 GPT-2 tensor(s) the model has (transformer.h.1.mlp.c_fc.weight)" in out.stderr
    assert "Traceback" not in out.stderr and not list((tmp_path / "r").glob("checkpoints/step_*"))


def test_export_keeps_bf16_in_both_formats(tool, tmp_path):
    from safetensors import safe_open

    transformers = _transformers()
    cfg = GPTConfig(block_size=16, vocab_size=96, n_layer=2, n_head=4, n_embd=32)
    model = GPT(cfg, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).eval()
    state = ftrain.init_state(model, ftrain.optim.sgd(0.1), seed=0)
    recorded = {"model": {"name": "gpt2", **cfg.__dict__}}
    with CheckpointManager(tmp_path / "ckpt", async_save=False) as m:
        m.save(state, metadata={"config": recorded}, force=True)
    flat = tool("ftrain.ckpt", "export", tmp_path / "ckpt", tmp_path / "p.safetensors")
    hf_dir = tool("ftrain.ckpt", "export", tmp_path / "ckpt", tmp_path / "hf", "--format", "hf")
    assert flat.returncode == 0 and hf_dir.returncode == 0, flat.stderr + hf_dir.stderr
    for path in (tmp_path / "p.safetensors", tmp_path / "hf" / "model.safetensors"):
        with safe_open(str(path), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}, path
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits.float(), model(x).float(), rtol=0.05, atol=0.05)


@pytest.mark.long  # ~27 s; CI checks eval and export against the recorded run instead
def test_diff_across_two_runs_and_within_one(tool, run8, cli, tmp_path):
    other = tmp_path / "seed1"
    cli(other, "trainer.max_steps=4", "checkpoint.every_steps=4", "trainer.seed=1", check=0)
    out = tool("ftrain.ckpt", "diff", f"{run8}:4", f"{other}:4")
    assert out.returncode == 1, out.stderr
    assert "~ params/transformer/wte/weight: values differ" in out.stdout
    assert f"between {run8 / 'checkpoints'}:4 and {other / 'checkpoints'}:4" in out.stdout
    same = tool("ftrain.ckpt", "diff", f"{run8}:8", run8 / "checkpoints")  # newest = 8
    assert same.returncode == 0 and same.stdout.startswith("0 of "), same.stdout + same.stderr
    within = tool("ftrain.ckpt", "diff", run8 / "checkpoints", 4, 8)  # the old form
    assert within.returncode == 1 and "arrays differ between 4 and 8" in within.stdout
    bad = tool("ftrain.ckpt", "diff", run8 / "checkpoints", 4)
    assert bad.returncode == 2 and "diff needs two steps" in bad.stderr  # a usage error


def test_eval_refuses_params_that_are_not_the_recorded_models(tool, run8, env, tmp_path):
    """A checkpoint without a tensor of the recorded model (here the final LayerNorm) was
    evaluated with that module's fresh weights, silently (functional_call, strict=False)."""
    from tensordict import TensorDict

    from ftrain.ckpt.readonly import read_subtree

    _, tree, attrs = read_subtree(run8 / "checkpoints", 4, only=("params", "buffers", "step"))
    params = tree["params"].clone()
    del params["transformer", "ln_f"]
    state = TensorDict(step=tree["step"], params=params, buffers=tree["buffers"], batch_size=[])
    with CheckpointManager(tmp_path / "checkpoints", async_save=False) as m:
        m.save(state, force=True, metadata={"config": attrs["config"]})
    out = tool("ftrain.eval", tmp_path, env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "missing from the state ['transformer.ln_f.bias', 'transformer.ln_f.weight']" in (
        out.stderr
    )


def test_eval_refuses_a_val_split_other_than_the_runs(cli, tool, env, tmp_path):
    """With no data.* override eval promises the run's own val split: files changed since
    (or a relative data.path read from another directory) gave other numbers, exit 0."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("a", "b"):
        (corpus / f"{name}.txt").write_text(f"{name}: the quick brown fox jumps " * 400)
    run = tmp_path / "run"
    text = ["data=text", f"data.path={corpus}", "trainer.max_steps=2", "checkpoint.every_steps=2"]
    # recorded with allow_changed=true (as after a resume on fixed data): that is the run's
    # setting, not this evaluation's, and must not skip the check for good
    cli(run, *text, "data.allow_changed=true", check=0)
    assert tool("ftrain.eval", run, env=env).returncode == 0
    (corpus / "b.txt").write_text("edited since the run " * 500)
    out = tool("ftrain.eval", run, env=env)
    assert out.returncode == 2 and "was trained with a val split of fingerprint" in out.stderr
    assert "the data changed since the run" in out.stderr, out.stderr
    # overrides of how the data is read keep the check (they skipped it, and the edited
    # corpus's numbers came back as the run's val_loss)
    out = tool("ftrain.eval", run, "data.prefetch=0", "data.allow_changed=false", env=env)
    assert out.returncode == 2 and "the data changed since the run" in out.stderr, out.stderr
    on_purpose = tool("ftrain.eval", run, f"data.path={corpus}", env=env)  # other data, asked
    assert on_purpose.returncode == 0, on_purpose.stderr
    assert tool("ftrain.eval", run, "data.allow_changed=true", env=env).returncode == 0


def test_eval_of_a_run_that_held_out_no_data_says_so(cli, tool, env, tmp_path):
    """It said "split 'val' has 0 tokens ... change val_fraction", whose fix evaluates
    tokens the run trained on."""
    run = tmp_path / "run"
    cli(run, "data.val_fraction=0", "trainer.max_steps=2", "checkpoint.every_steps=2", check=0)
    out = tool("ftrain.eval", run, env=env)
    assert out.returncode == 2 and "trained with data.val_fraction=0: it held out no data" in (
        out.stderr
    ), out.stderr


def test_eval_of_a_diverged_step_says_nan_in_strict_json(cli, tool, env, tmp_path):
    """A NaN loss had perplexity inf, and --json printed NaN/Infinity (not JSON)."""
    run = tmp_path / "run"
    diverge = ["optim.lr=1e8", "trainer.on_nonfinite=continue", "trainer.eval_every=null"]
    cli(run, *diverge, "trainer.max_steps=2", "checkpoint.every_steps=2", check=0)
    out = tool("ftrain.eval", run, "--json", env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert got["val_loss"] == "nan" and got["perplexity"] == "nan", got
    human = tool("ftrain.eval", run, env=env)
    assert "val_loss nan perplexity nan" in human.stdout, human.stdout
