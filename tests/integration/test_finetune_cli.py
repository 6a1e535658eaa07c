"""Fine-tuning through the real CLI: init.from a base run, LoRA, frozen globs, groups, export."""

import signal
from pathlib import Path

import pytest
import torch

from ftrain import lora
from ftrain.ckpt import CheckpointManager
from ftrain.config import load_config
from ftrain.state import first_difference
from ftrain.state.tree import flatten, path_str

from .conftest import TINY, records
from .test_cli import _committed, _wait_for_step

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2"]


def _restore(run_dir, step=None):
    return CheckpointManager(Path(run_dir) / "checkpoints", async_save=False).restore(step)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, cache_dir, forkserver):
    """A base run of 4 steps, committed at step 4."""
    import os

    run = tmp_path_factory.mktemp("base") / "run"
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir)
    args = [f"run.dir={run}", *TINY, "trainer.max_steps=4", "checkpoint.every_steps=4"]
    proc = forkserver.run(args, env, 240)
    assert proc.returncode == 0, proc.stderr
    return run


def test_lora_from_a_base_run_trains_adapters_only(cli, base_run, tmp_path):
    run = tmp_path / "lora"
    out = cli(
        run,
        *LORA,
        f"init.from={base_run}:4",
        "trainer.max_steps=4",
        "checkpoint.every_steps=2",
        check=0,
    )
    assert f"initialised params from {base_run / 'checkpoints'} step 4" in out.stdout
    assert "initialised fresh" in out.stdout and "parameter groups: default:" in out.stdout
    assert "keep their random initialisation" not in out.stdout  # the base was loaded
    (start,) = records(run, "start")  # which base step it came from is on record too
    assert any(f"{base_run / 'checkpoints'} step 4" in n for n in start["notes"])
    base, tuned = _restore(base_run, 4), _restore(run, 4)
    bkeys, bleaves = flatten(base["params"])
    tuned_params = dict(
        zip(map(path_str, flatten(tuned["params"])[0]), flatten(tuned["params"])[1], strict=True)
    )
    for k, t in zip(bkeys, bleaves, strict=True):  # the base weights are untouched
        assert torch.equal(tuned_params[path_str(k)], t), path_str(k)
    adapters = [p for p in tuned_params if lora.is_adapter(p)]
    assert len(adapters) == 2 * 12 and any(
        tuned_params[p].abs().sum() > 0 for p in adapters if p.endswith("lora_B")
    )
    moments = [path_str(k) for k in flatten(tuned["opt"])[0] if k[-1] != "count" and "mu" in k]
    assert moments and all(lora.is_adapter(m) for m in moments)  # no moments for the base

    # its adapters into a run of another alpha would be rescaled: refused before training
    rescaled = [*LORA[:1], "model.lora.alpha=64", f"init.from={run}", "trainer.max_steps=1"]
    out = cli(tmp_path / "rescaled", *rescaled, check=2)
    assert "trained with model.lora.alpha=8, this run has model.lora.alpha=64" in out.stderr


@pytest.mark.long  # CI keeps the SIGKILL variant below (the harder path, the same resume)
def test_lora_run_stopped_and_resumed_is_bit_identical(cli, base_run, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    common = [*LORA, f"init.from={base_run}", "checkpoint.every_steps=3"]
    cli(whole, *common, "trainer.max_steps=6", check=0)
    cli(split, *common, "trainer.max_steps=3", check=0)
    out = cli(split, *common, "trainer.max_steps=6", check=0)
    assert "resumed from step 3" in out.stdout and "initialised params" not in out.stdout
    assert first_difference(_restore(whole, 6), _restore(split, 6)) is None
    # the frozen base is linked, not rewritten: the records say how much each save wrote
    later = [r for r in records(whole, "committed") if r["step"] == 6][0]
    assert later["linked_bytes"] > later["written_bytes"] > 0, later


@pytest.mark.slow
def test_lora_run_sigkilled_and_resumed_is_bit_identical(cli, popen_cli, base_run, tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    common = [*LORA, f"init.from={base_run}", "checkpoint.every_steps=4"]
    cli(whole, *common, "trainer.max_steps=12", check=0)
    proc = popen_cli(killed, *common, "trainer.max_steps=400", "checkpoint.async_save=false")
    _wait_for_step(killed, proc, 6)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _committed(killed) and max(_committed(killed)) < 12
    cli(killed, *common, "trainer.max_steps=12", check=0)
    assert first_difference(_restore(whole, 12), _restore(killed, 12)) is None


def _model(overrides):
    from ftrain.cli.build import build_model

    return build_model(load_config([*TINY, *overrides]))[0]


def test_merge_lora_export_loads_into_the_plain_model_with_equal_logits(
    cli, forkserver, base_run, tmp_path
):
    from safetensors.torch import load_model

    run = tmp_path / "lora"
    cli(
        run,
        *LORA,
        f"init.from={base_run}",
        "trainer.max_steps=3",
        "checkpoint.every_steps=3",
        check=0,
    )
    out = tmp_path / "merged.safetensors"
    args = ["export", str(run / "checkpoints"), str(out), "--merge-lora"]
    done = _ckpt_tool(forkserver, args)
    assert done.returncode == 0, done.stderr
    assert "exported step 3" in done.stdout and "12 LoRA modules merged" in done.stdout
    plain = _model([])
    load_model(plain, str(out), strict=True)  # every name of the plain model, nothing more
    adapted = _model(LORA)
    _restore(run, 3)["params"].to_module(adapted)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(x), adapted.eval()(x), rtol=1e-5, atol=1e-5)
    again = _ckpt_tool(forkserver, args)  # never overwrites
    assert again.returncode == 2 and "exists" in again.stderr
    base = [str(base_run / "checkpoints"), str(tmp_path / "b.safetensors"), "--merge-lora"]
    plain_run = _ckpt_tool(forkserver, ["export", *base])
    assert plain_run.returncode == 2 and "no LoRA adapters" in plain_run.stderr
    for alpha in ("nan", "inf", "0", "-2"):  # merged NaN, inf or nothing before
        bad = _ckpt_tool(forkserver, [*args[:2], str(tmp_path / "a.safetensors"), args[3],
                                      "--lora-alpha", alpha])  # fmt: skip
        assert bad.returncode == 2 and "must be a finite number > 0" in bad.stderr, bad.stderr
    other = [*args[:2], str(tmp_path / "a.safetensors"), args[3], "--lora-alpha", "16"]
    wrong = _ckpt_tool(forkserver, other)  # the run's 8 is what it was trained with
    assert wrong.returncode == 2 and "model.lora.alpha=8; drop --lora-alpha" in wrong.stderr
    same = _ckpt_tool(forkserver, [*other[:-1], "8"])
    assert same.returncode == 0, same.stderr
    unmerged = _ckpt_tool(forkserver, [*args[:2], str(tmp_path / "u.st"), "--lora-alpha", "8"])
    assert unmerged.returncode == 2 and "only with --merge-lora" in unmerged.stderr
    (tmp_path / "afile").write_text("x")
    under_a_file = _ckpt_tool(forkserver, ["export", args[1], str(tmp_path / "afile" / "x.st")])
    assert under_a_file.returncode == 2 and "is not a directory" in under_a_file.stderr
    assert "Traceback" not in under_a_file.stderr


def _ckpt_tool(forkserver, args):
    """``python -m ftrain.ckpt ARGS`` (forked: see conftest)."""
    import os

    return forkserver.run(args, dict(os.environ), 240, module="ftrain.ckpt")


def test_freeze_globs_groups_and_their_errors(cli, base_run, tmp_path):
    run = tmp_path / "frozen"
    out = cli(
        run,
        "optim.freeze=[transformer.wte.*,transformer.h.0.*]",
        "+optim.groups.top.params=[transformer.h.3.*]",
        "+optim.groups.top.lr=1e-3",
        "trainer.max_steps=2",
        "checkpoint.every_steps=2",
        check=0,
    )
    assert "frozen: 13 tensors" in out.stdout and "top: 12 tensors" in out.stdout
    # no init.from: the frozen tensors stay random (a forgotten init.from, most likely)
    assert "warning: 13 frozen parameters" in out.stdout and "no init.from" in out.stdout
    opt_paths = [path_str(k) for k in flatten(_restore(run, 2)["opt"])[0]]
    assert not [p for p in opt_paths if ".wte." in p or ".h.0." in p]
    assert [p for p in opt_paths if p.startswith("multi_transform.top.") or p.startswith("top.")]
    typo = cli(tmp_path / "typo", "optim.freeze=[transformer.h0.*]", "trainer.max_steps=1", check=2)
    assert "optim.freeze pattern 'transformer.h0.*' matches no parameter" in typo.stderr
    missing = cli(
        tmp_path / "missing", f"init.from={tmp_path / 'nope'}", "trainer.max_steps=1", check=2
    )
    assert "init.from=" in missing.stderr and "no such checkpoint directory" in missing.stderr
    for tail in ("abc", "-1"):  # RUN:STEP of a run that exists: "looks like a URL" before
        word = cli(tmp_path / "w", f"init.from={run}:{tail}", "trainer.max_steps=1", check=2)
        assert f"the part after ':' must be a step number, got '{tail}'" in word.stderr
        assert "URL" not in word.stderr and "Traceback" not in word.stderr, word.stderr
    bad_group = cli(
        tmp_path / "g", "+optim.groups.default.params=[x]", "trainer.max_steps=1", check=2
    )
    assert "plain name other than default/frozen" in bad_group.stderr


def test_a_restart_before_the_first_commit_reads_the_base_step_it_read_before(
    cli, popen_cli, tmp_path
):
    """init.from=RUN (no step) means the base's newest step. A fine-tune killed before its
    first commit re-read the base on its restart: the base had committed a newer step
    meanwhile, and the restarted run trained from another base than the steps it redid.
    The step the earlier start read is read again (and recorded)."""
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    cli(base, "trainer.max_steps=2", "checkpoint.every_steps=2", check=0)
    ft = [*LORA, f"init.from={base}", "checkpoint.every_steps=100"]
    first = popen_cli(tuned, *ft, "trainer.max_steps=200")
    _wait_for_step(tuned, first, 2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert _committed(tuned) == []
    cli(base, "trainer.max_steps=4", "checkpoint.every_steps=2", check=0)  # the base goes on
    again = cli(tuned, *ft, "trainer.max_steps=2", check=0)
    assert f"{base / 'checkpoints'} step 2" in again.stdout, again.stdout
    assert "as this run's earlier start read" in again.stdout
    assert [r["init_step"] for r in records(tuned, "start")] == [2, 2]
    fresh = cli(tmp_path / "other", *ft, "trainer.max_steps=1", check=0)  # another run: newest
    assert f"{base / 'checkpoints'} step 4" in fresh.stdout, fresh.stdout
    over = cli(tuned, *ft, "trainer.max_steps=1", "resume=none", "run.overwrite=true", check=0)
    assert f"{base / 'checkpoints'} step 4" in over.stdout, "starting over: the newest"
