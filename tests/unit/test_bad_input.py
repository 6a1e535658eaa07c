"""Bad input found by probing the command line: each is one clear message naming the key
and the fix (exit 2 in the CLI), never a traceback or a value silently taken."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from ftrain.cli.build import build_model, build_sources, check_block_size
from ftrain.cli.evaluate import eval_config
from ftrain.config import ConfigError, load_config
from ftrain.lora import apply_lora
from ftrain.metrics.loggers import LoggerError, check_loggers


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        # "." put the run in runs/ itself (every run's parent), ".." and "../x" outside it
        (["run.name=."], "run.name='.' is invalid: a name under runs/"),
        (["run.name=.."], "run.name='..' is invalid"),
        (["run.name=../escaped"], "run.name='../escaped' is invalid"),
        (["run.name=/abs"], "run.name='/abs' is invalid"),
        (["optim=sgd", "optim.momentum=1.5"], "optim.momentum=1.5 is invalid: must be in [0, 1)"),
        (["dist.backend=cpu:glooo"], "dist.backend='cpu:glooo' is invalid"),
        (["dist.backend=:"], "dist.backend=':' is invalid"),
        # any non-zero number ran as true
        (["trainer.donate=2"], "trainer.donate='2' is invalid: a switch takes true or false"),
        (["checkpoint.async_save=3"], "checkpoint.async_save='3' is invalid"),
        (["run.overwrite=-1", "resume=none"], "run.overwrite='-1' is invalid"),
        (
            ["checkpoint.keep_best=2", "checkpoint.best_metric="],
            "checkpoint.keep_best ranks steps by a metric, and none is named",
        ),
        # the generic "check the key" hint was the wrong fix for these
        (["trainer.max_steps=null"], "fix: trainer.max_steps takes another type"),
        (["dist.backend=cpu:gloo,cuda:nccl"], "quote a value that holds one"),
    ],
)
def test_bad_values_are_refused_with_the_key_and_the_fix(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [["run.name=group/exp1"], ["trainer.donate=true"], ["trainer.donate=1"],
     ["dist.backend='cpu:gloo,cuda:nccl'"], ["optim=sgd", "optim.momentum=0.9"]],
)  # fmt: skip
def test_the_good_neighbours_of_those_values_pass(overrides):
    load_config(overrides)


@pytest.mark.parametrize("target", ["os.getcwd", "builtins.dict"])
def test_a_data_target_that_is_not_a_source_factory_is_named(target):
    """It was a traceback at the first use of what it returned (AttributeError 'str' ...
    'describe'), or from inspect.signature of a builtin."""
    cfg = load_config([f"data._target_={target}"])
    with pytest.raises(ConfigError, match=rf"data._target_='{target}' is not a data source"):
        build_sources(cfg)


def test_a_model_without_parameters_is_refused_at_start():
    cfg = load_config(["model._target_=torch.nn.Identity"])
    with pytest.raises(ConfigError, match=r"the model \(Identity\) has no parameters"):
        build_model(cfg)


def test_a_lora_rank_past_the_layers_dimensions_is_refused():
    """rank 100000 on 64-wide layers built 281M adapter parameters on a 218k model."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"LoRA rank 5 exceeds 0's smallest dimension"):
        apply_lora(m, rank=5, alpha=8, targets=["0"], generator=torch.Generator())
    apply_lora(m, rank=4, alpha=8, targets=["0"], generator=torch.Generator())


def test_a_model_block_size_below_1_names_the_model_key():
    """It blamed data.block_size, with "use data.block_size=0 or less" as the fix."""
    with pytest.raises(ConfigError, match=r"^model\.block_size(=0 is invalid| must be a positive)"):
        check_block_size(load_config(["model.block_size=0", "data.block_size=1"]))


def test_a_logger_target_that_cannot_be_imported_is_one_line(capsys):
    """Hydra's get_method printed its own three lines before ftrain's message."""
    with pytest.raises(LoggerError) as err:
        check_loggers({"mine": {"_target_": "nonexist.Mod"}})
    assert "\n" not in str(err.value) and "nonexist.Mod" in str(err.value)
    assert capsys.readouterr().out == ""


def test_eval_overrides_past_int64_are_refused():
    """OverflowError in the loader: the training start's 64-bit check did not apply."""
    recorded = load_config([])
    with pytest.raises(ConfigError, match="past the 64-bit range"):
        eval_config(OmegaConf.to_container(recorded), ["trainer.eval_batches=10" + "0" * 22])
