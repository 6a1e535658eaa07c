"""Bad config values are one clear ConfigError naming the key and the fix, at load time."""

import pytest

from ftrain.config import ConfigError, load_config


@pytest.mark.parametrize(
    "override,needles",
    [
        ("checkpoint.every_steps=-1", ["checkpoint.every_steps=-1", "checkpoint.every_steps=null"]),
        ("checkpoint.every_steps=0", ["checkpoint.every_steps=0", "checkpoint.every_steps=null"]),
        ("checkpoint.every_seconds=-1", ["checkpoint.every_seconds=-1.0", "=null"]),
        ("checkpoint.every_seconds=0", ["checkpoint.every_seconds=0.0"]),
        ("checkpoint.keep_last=-1", ["checkpoint.keep_last=-1", "checkpoint.keep_last=null"]),
        ("checkpoint.keep_last=0", ["checkpoint.keep_last=0"]),
        ("checkpoint.keep_every=0", ["checkpoint.keep_every=0"]),
        ("checkpoint.keep_best=-2", ["checkpoint.keep_best=-2"]),
        ("checkpoint.compression=bogus", ["checkpoint.compression='bogus'", "zstd"]),
        ("data.val_fraction=1.0", ["data.val_fraction=1.0", "[0, 1)"]),
        ("data.val_fraction=-0.1", ["data.val_fraction=-0.1"]),
        ("schedule.warmup_steps=-5", ["schedule.warmup_steps=-5", ">= 0"]),
        ("schedule.decay_steps=0", ["schedule.decay_steps=0", "null"]),
        ("optim.lr=-1", ["optim.lr=-1.0", "> 0"]),
        ("optim.lr=0", ["optim.lr=0.0"]),
        ("optim.clip=0", ["optim.clip=0.0", "optim.clip=null"]),
        ("optim.clip=-1", ["optim.clip=-1.0"]),
        ("optim.b2=1.0", ["optim.b2=1.0"]),
        ("data=text", ["data=text needs data.path", "data.path=PATH"]),
        ("data=tokens", ["data=tokens needs data.path", "train.bin"]),
        ("model=model_schema", ["model=model_schema", "not an option", "model=gpt2_tiny"]),
        ("data=data_schema", ["data=data_schema", "data=stdlib"]),
        ("+recipe=gpt3", ["recipe=gpt3 is not an option", "pick one of: +recipe=gpt2"]),
        # a value of the wrong type is not an unknown key: its hint names the key's type
        ("optim.groups=5", ["optim.groups takes another type", "'optim.groups=[a,b]'"]),
        ("model.lora.targets=c_attn", ["model.lora.targets takes another type"]),
        ("+trainer.max_step=10", ["trainer.max_step", "max_steps"]),
        ("trainer.compile=sometimes", ["trainer.compile must be true, false or auto"]),
        ("trainer.compile=1", ["trainer.compile must be true, false or auto, got 1"]),
        ("model.lora.alpha=inf", ["model.lora.alpha", "finite"]),
        ("trainer.compile=0", ["trainer.compile must be true, false or auto, got 0"]),
        ("+checkpoint.evry_steps=3", ["checkpoint.evry_steps"]),
        ("+model.n_layers=2", ["model.n_layers"]),
        ("run.dir=", ["run.dir='' is invalid: an empty path"]),  # records in cwd, /checkpoints
        ("checkpoint.dir=", ["checkpoint.dir='' is invalid"]),
        # a value Hydra's grammar cannot read: the fix is quoting, not the key
        ("run.dir=~/tl", ["token recognition error", "quote one that holds", "$HOME/x"]),
        (  # a freeze glob's brackets unquoted: the fix named the key, which was right
            "optim.freeze=[transformer.wte.*,transformer.h.[0-1].*]",
            ["no viable alternative", "quote one that holds", '"transformer.h.[0-1].*"'],
        ),
        # quoted for Hydra, '~' was a directory named '~' under the working directory
        ("run.dir='~/tl'", ["run.dir='~/tl' is invalid", "not expanded", "./~/tl"]),
        ("checkpoint.fallback_dir='~'", ["checkpoint.fallback_dir='~' is invalid"]),
        ("run.overwrite=true", ["run.overwrite=True is invalid", "add resume=none"]),
        (
            "checkpoint.keep_best=2 trainer.eval_every=null",
            ["checkpoint.best_metric='val_loss' is invalid", "trainer.eval_every"],
        ),
        (  # both fixes named at once (the start refused the ranking for the val split next)
            "checkpoint.keep_best=2 trainer.eval_every=null data.val_fraction=0",
            ["set trainer.eval_every and a data.val_fraction above 0"],
        ),
        ("trainer.seed=18446744073709551616", ["trainer.seed=18446744073709551616", "2**64"]),
        ("trainer.seed=-1", ["trainer.seed=-1"]),
        (  # the values were named, the fix was not
            "trainer.batch_size=8 trainer.grad_accum=3",
            ["divisible by trainer.grad_accum=3", "multiple of 3", "trainer.grad_accum=2"],
        ),
        ("trainer.batch_size=8 trainer.grad_accum=1000000000000", ["trainer.grad_accum=8"]),
        (  # it was stretched to warmup_steps + 1 without a word (the library refuses it)
            "schedule.decay_steps=5",
            ["schedule.decay_steps=5 is invalid", "schedule.warmup_steps=10", "above 10"],
        ),
        ("schedule.decay_steps=3 schedule.warmup_steps=3", ["schedule.decay_steps=3"]),
        ("trainer.eval_batches=0", ["trainer.eval_batches=0", ">= 1"]),
        ("trainer.max_steps=-3", ["trainer.max_steps must be >= 0, got -3"]),  # 0 is allowed
        ("trainer.log_every=0", ["trainer.log_every must be >= 1, got 0"]),
        ("trainer.eval_batches=-1", ["trainer.eval_batches=-1"]),
        ("trainer.eval_every=-3", ["trainer.eval_every=-3", "null"]),
        ("resume=true", ["resume must be 'latest', 'none' or a step number", "resume=True"]),
        ("resume=false", ["resume=False"]),
        (
            "checkpoint.mmap_restore=true checkpoint.dir=s3://bucket/run",
            ["checkpoint.mmap_restore=True", "s3://bucket/run", "object store", "=false"],
        ),
    ],
)
def test_bad_value_is_one_clear_error(override, needles):
    with pytest.raises(ConfigError) as info:
        load_config(override.split())
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_schema_options_are_not_listed_as_choices():
    with pytest.raises(ConfigError) as info:
        load_config(["model=nope"])
    assert "gpt2_tiny" in str(info.value) and "model_schema" not in str(info.value)


def test_valid_edges_and_null_are_accepted():
    cfg = load_config(
        [
            "checkpoint.every_steps=null",
            "checkpoint.keep_last=null",
            "checkpoint.every_steps=1",
            "checkpoint.compression=zstd:3",
            "data.val_fraction=0.0",
            "schedule.warmup_steps=0",
            "optim.clip=null",
            "+recipe=gpt2",
            "+my_recipe_key=1",  # a key outside ftrain's groups is the recipe's business
            "trainer.compile=auto",
        ]
    )
    assert cfg.checkpoint.every_steps == 1 and cfg.my_recipe_key == 1
    assert cfg.trainer.compile == "auto"
    assert load_config(["trainer.compile=auto", "dist.shard=optimizer"]).dist.shard == "optimizer"


def test_init_from_and_from_hf_are_exclusive_and_checked():
    assert load_config(["init.from_hf=models/gpt2"]).init.from_hf == "models/gpt2"
    with pytest.raises(ConfigError, match="set only one"):
        load_config(["init.from=runs/base", "init.from_hf=models/gpt2"])
    with pytest.raises(ConfigError, match="init.from_hf=''"):
        load_config(["init.from_hf=''"])
    with pytest.raises(ConfigError, match="two keys, from and from_hf"):
        load_config(["+init.frm=x"])


@pytest.mark.parametrize("group", ["model", "data", "trainer"])
@pytest.mark.parametrize("value", [None, "gpt2", 3])
def test_eval_refuses_a_recorded_config_without_a_usable_section(group, value):
    """A checkpoint whose recorded config has a null or non-mapping group (damaged, or
    forged with its checksums recomputed) is a ConfigError, not an AttributeError."""
    from ftrain.cli.evaluate import eval_config
    from ftrain.config import to_plain

    recorded = to_plain(load_config([]))
    recorded[group] = value
    with pytest.raises(ConfigError, match=f"no usable '{group}' section"):
        eval_config(recorded, [])


def test_eval_checks_what_evaluation_uses_not_the_runs_training_keys():
    """A run trained with grad_accum=4 evaluates at any batch size; eval_every=0 (no
    evaluation while training) does not stop it from being evaluated afterwards."""
    from ftrain.cli.evaluate import eval_config
    from ftrain.config import to_plain

    recorded = to_plain(load_config(["trainer.grad_accum=4", "trainer.eval_every=0"]))
    assert eval_config(recorded, ["trainer.batch_size=6"]).trainer.batch_size == 6
    # Hydra's "+key" spelling: it was accepted, then ignored (the recorded value, exit 0)
    cfg = eval_config(recorded, ["+trainer.eval_batches=2", "++data.val_fraction=0.5"])
    assert cfg.trainer.eval_batches == 2 and cfg.data.val_fraction == 0.5
    with pytest.raises(ConfigError, match="trainer.precision must be fp32, bf16 or fp16"):
        eval_config(recorded, ["trainer.precision=fp64"])


@pytest.mark.parametrize("group", ["optim", "model", "+data"])
def test_a_list_given_to_a_one_option_group_is_refused_naming_the_sweep(group):
    """optim=[adamw,sgd] merged both options (the last won) and trained one run silently."""
    name = group.lstrip("+")
    options = {"optim": "[adamw,sgd]", "model": "[gpt2,gpt2_tiny]", "data": "[tokens,text]"}
    with pytest.raises(ConfigError, match=rf"the {name} group takes one option.*-m {name}="):
        load_config([f"{name}={options[name]}"])


@pytest.mark.parametrize("group", ["model", "optim", "schedule", "data", "resume"])
def test_removing_a_group_every_run_needs_is_a_named_refusal(group):
    """~model failed with omegaconf's MissingMandatoryValue from deep in the checks."""
    with pytest.raises(ConfigError, match=rf"{group} cannot be removed \(~{group}\)"):
        load_config([f"~{group}"])


@pytest.mark.parametrize(
    "override",
    ["trainer.max_steps=99999999999999999999", "schedule.decay_steps=99999999999999999999"],
)
def test_whole_numbers_past_int64_are_refused_at_start(override):
    """They passed every check and crashed in torch (OverflowError) after the run began."""
    with pytest.raises(ConfigError, match=r"past the 64-bit range.*below 2\*\*63"):
        load_config([override])


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("run.name=", r"run\.name='' is invalid: an empty name"),  # run.dir was runs/
        ("data.cache_dir=", r"data\.cache_dir='' is invalid: an empty path"),  # was ./
        ("+optim.groups.top.lr=abc", r"optim\.groups\.top\.lr='abc' is invalid"),
        ("+optim.groups.top.weight_decay=[1]", r"optim\.groups\.top\.weight_decay=.* invalid"),
    ],
)
def test_empty_names_and_mistyped_group_settings_are_named(override, needle):
    """An empty run.name put the run in runs/ beside every other run; a group setting of the
    wrong type was omegaconf's ValidationError naming optim.lr, not the group's key."""
    group = ["+optim.groups.top.params=[transformer.ln_f.*]"] if "groups" in override else []
    with pytest.raises(ConfigError, match=needle):
        load_config([*group, override])


def test_a_run_that_ends_inside_its_warmup_is_warned_about():
    """`trainer.max_steps=3` with the default 10 warmup steps trained and exited 0 with
    only "at least schedule.warmup_steps + 1" on the start line: it never reached optim.lr."""
    from ftrain.cli.startup import warmup_past_the_end

    def warned(*overrides):
        return warmup_past_the_end(load_config(["model=gpt2_tiny", *overrides]))

    line = warned("trainer.max_steps=3")
    assert line.startswith("warning: schedule.warmup_steps=10 is not below trainer.max_steps=3")
    assert warned("trainer.max_steps=10") is not None
    assert warned("trainer.max_steps=11") is None
    assert warned("trainer.max_steps=0") is None  # nothing trains
    assert warned("trainer.max_steps=3", "schedule=constant") is None
