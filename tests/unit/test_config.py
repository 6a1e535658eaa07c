import os
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from tensordict import TensorDict

from ftrain.cli.build import build_model, build_tx, check_batch
from ftrain.cli.resume import compat_diff
from ftrain.config import ConfigError, load_config, to_plain
from ftrain.optim import tree_get

CONF = Path(__file__).resolve().parents[2] / "ftrain" / "conf"
GROUPS = ["model", "optim", "schedule", "data", "checkpoint", "trainer", "dist"]


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_group_option_composes(group, option):
    extra = ["data.path=/tmp"] if (group, option) in (("data", "text"), ("data", "tokens")) else []
    cfg = load_config([f"{group}={option}", *extra])
    assert cfg[group] is not None


def test_recipe_overlay_and_builders():
    cfg = load_config(["+recipe=gpt2", "model.n_layer=1", "model.block_size=16"])
    assert cfg.run.dir == "runs/gpt2" and cfg.checkpoint.dir == "runs/gpt2/checkpoints"
    model, loss = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) > 1_000_000
    tx = build_tx(cfg)
    opt = tx.init(TensorDict.from_module(model).detach())
    assert float(tree_get(opt, "learning_rate")) == 0.0  # warmup starts at 0
    assert "clip_by_global_norm" in opt.keys() and "loss_scale" not in opt.keys()
    assert cfg.trainer.compile is False  # trainer.compile defaults off
    assert load_config(["trainer.compile=true"]).trainer.compile is True
    fp16 = build_tx(load_config(["+recipe=gpt2", "trainer.precision=fp16"]))
    assert "loss_scale" in fp16.init(TensorDict.from_module(model).detach()).keys()


@pytest.mark.parametrize(
    "override,needle",
    [
        ("trainer.max_step=3", "trainer.max_step"),
        ("trainer.max_steps=abc", "could not be converted to Integer"),
        ("model=nope", "Could not find 'model/nope'"),
        ("resume=sometimes", "resume must be"),
        ("trainer.precision=fp8", "fp32, bf16 or fp16"),
        ("trainer.grad_accum=3", "divisible"),
        # JSON (every checkpoint's metadata) has no inf or nan: a run saved nothing
        ("trainer.hang_timeout_s=inf", r"trainer.hang_timeout_s=inf is not a finite number"),
        ("optim.clip=inf", r"optim.clip=inf is not a finite number"),
        ("+mine.tags=[1,nan]", r"mine.tags\[1\]=nan is not a finite number"),
        ("+mine.x=-inf", r"mine.x=-inf is not a finite number.*use null"),
        ("dist.backend=glooo", r"dist.backend='glooo' is invalid: must be one of auto, gloo"),
        ("dist.timeout_s=0", r"dist.timeout_s=0 is invalid: .* > 0"),
        ("model=null", r"model=null: a config group takes one of its options, never null"),
        ("+optim.groups.top.params=[]", r"optim.groups.top.params=\[\] is invalid: .*one glob"),
        # an option inside a list got the generic "check the key" hint
        ("logger=[jsonl,nope]", r"fix: logger=nope is not an option; pick one of: logger=csv"),
        # a logger's key without choosing it: "Key 'tensorboard' is not in struct"
        ("logger.tensorboard.flush_secs=5", r"fix: the logger 'tensorboard' is not chosen: add"),
        ("logger.mine.x=5", r"fix: 'mine' is not a logger of ftrain's .*\+logger.mine._target_"),
        # the built-in GPT-2's shape rules lived only in its constructor: a sweep trained
        # model.n_head=4 before finding model.n_head=3 impossible
        ("model.n_head=3", r"model.n_embd must be divisible by n_head, got n_embd=64 and n_head=3"),
        ("optim.eps=1e-300", r"optim.eps=1e-300 is invalid: must be at least 1.18e-38"),
        # finite in float64, inf once applied in float32: NaN at step 3 (trained 2 steps)
        ("optim.lr=1e300", r"optim.lr=1e\+300 is invalid: .* at most 3.403e\+38, float32's"),
        ("model.dropout=1.0", r"model.dropout must be in \[0, 1\), got dropout=1.0 \(model=gpt2"),
    ],
)
def test_bad_config_is_one_clear_error(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config([override])


def test_compat_diff_separates_safe_and_unsafe_changes():
    a = to_plain(load_config([]))
    b = to_plain(load_config(["trainer.max_steps=999", "optim.lr=0.1", "checkpoint.every_steps=7"]))
    bad, safe = compat_diff(a, b)
    assert bad == ["optim.lr: 0.0006 -> 0.1"]
    assert "trainer.max_steps: 200 -> 999" in safe and "checkpoint.every_steps: 100 -> 7" in safe
    # the compiled step matches the eager one: switching it on resume is safe
    bad, safe = compat_diff(a, to_plain(load_config(["trainer.compile=true"])))
    assert bad == [] and safe == ["trainer.compile: False -> True"]
    # resume=N says which step this start restores: not a change to the run
    assert compat_diff(a, to_plain(load_config(["resume=4"]))) == ([], [])
    # groups in another order: the first matching group takes a parameter (a reorder
    # compared as no change, then failed the restore with dozens of layout lines)
    a_, b_ = "+optim.groups.a.params=[h.*.attn.*]", "+optim.groups.b.params=[h.3.*]"
    x, y = (to_plain(load_config(g)) for g in ([a_, b_], [b_, a_]))
    assert compat_diff(x, y)[0] == [
        "optim.groups order: ['a', 'b'] -> ['b', 'a'] (the first matching group takes a parameter)"
    ]
    assert compat_diff(x, x) == ([], [])
    # one place spelled relative or absolute is no change; another place is
    rel, absolute = (
        to_plain(load_config(["run.dir=runs/x"])),
        to_plain(load_config([f"run.dir={os.path.abspath('runs/x')}"])),
    )
    assert compat_diff(rel, absolute) == ([], [])
    assert compat_diff(rel, to_plain(load_config(["run.dir=runs/y"])))[1]
    # settings of LoRA while it is off before and after change nothing a step computes
    off = to_plain(load_config(["model.lora.alpha=8", "model.lora.targets=[c_proj]"]))
    assert compat_diff(a, off) == ([], [])
    # a setting the chosen option does not read (its start-up warning says so)
    for unread in (["optim.momentum=0.9"], ["optim.nesterov=true"]):
        assert compat_diff(a, to_plain(load_config(unread))) == ([], []), unread
    sgd = to_plain(load_config(["optim=sgd"]))
    assert compat_diff(sgd, to_plain(load_config(["optim=sgd", "optim.momentum=0.5"])))[0]
    on = ["model.lora.rank=4"]
    assert compat_diff(
        to_plain(load_config(on)), to_plain(load_config([*on, "model.lora.alpha=8"]))
    )[0]


def test_checkpoint_incremental_and_storage_reach_the_manager(tmp_path):
    from ftrain.cli.build import build_manager

    cfg = load_config([f"checkpoint.dir={tmp_path}", "checkpoint.incremental=false"])
    assert build_manager(cfg).incremental is False
    assert build_manager(load_config([f"checkpoint.dir={tmp_path}"])).incremental is True


def test_storage_secrets_are_redacted_in_the_plain_config():
    cfg = load_config(
        ["+checkpoint.storage.endpoint=http://h:9", "+checkpoint.storage.secret_access_key=s"]
    )
    assert cfg.checkpoint.storage.secret_access_key == "s"  # the run itself uses it
    assert to_plain(cfg)["checkpoint"]["storage"] == {
        "endpoint": "http://h:9",
        "secret_access_key": "<redacted>",
    }


def test_storage_options_split_into_store_and_client_keys():
    from ftrain.ckpt.location import CheckpointLocationError, split_storage_options

    config, client = split_storage_options(
        {"endpoint": "http://h", "conditional_put": "etag", "allow_http": True, "timeout": "9s"}
    )
    assert config == {"endpoint": "http://h", "conditional_put": "etag"}
    assert client == {"allow_http": True, "timeout": "9s"}
    assert split_storage_options({"skip_signature": True})[0] == {"skip_signature": "true"}
    with pytest.raises(CheckpointLocationError, match="region"):
        split_storage_options({"region": ["us-east-1"]})


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("s3://b/ck#fallback", "holds '#' (a fragment)"),
        ("s3://b/ck?versionId=3", "holds '?' (a query)"),
        ("gs://b/run%2F1", "holds '%' (a percent-escape)"),
        ("s3://b/old/../ck", "has a '..' path segment"),
        ("s3://b/./ck", "has a '.' path segment"),
        ("az://b//ck", "has an empty path segment"),
    ],
)
def test_object_urls_the_store_would_read_as_another_place_are_refused(url, needle):
    """obstore dropped ``#...``/``?...``, decoded ``%xx`` and resolved ``..``: a fallback
    at ``s3://b/ck#fallback`` was the primary's own prefix, and every commit set its own
    step aside (all_steps stayed empty)."""
    from ftrain.ckpt import CheckpointManager
    from ftrain.ckpt.location import CheckpointLocationError, parse_location

    with pytest.raises(CheckpointLocationError, match=re.escape(needle)) as e:
        parse_location(url)
    assert repr(url) in str(e.value) and "BUCKET/PREFIX" in str(e.value)
    with pytest.raises(CheckpointLocationError, match=re.escape(needle)):
        CheckpointManager("s3://b/ck", fallback_directory=url)


class _Samples:
    def __len__(self):
        return 100


@pytest.mark.parametrize(
    "batch, accum, world, needle",
    [
        (101, 1, 1, "trainer.batch_size=101 is larger than the training split (100 samples"),
        (3, 1, 2, "trainer.batch_size=3 (the global batch) does not split over 2 ranks; use a"),
        (4, 4, 2, "gives each of the 2 ranks 2 samples, not divisible by trainer.grad_accum=4"),
        # a resume keeps its batch size: the fix that keeps it is named too
        (9, 1, 4, "to keep this batch size (a resume), launch 3 ranks (a divisor of 9)"),
        (3, 1, 2, "launch 1 rank (a divisor of 3)"),
        (12, 4, 2, "to keep this batch size (a resume), trainer.grad_accum=3"),
        (12, 4, 8, "launch 3 ranks (a divisor of 12)"),  # 6 ranks: shares of 2, not by 4
    ],
)
def test_a_batch_the_data_or_the_ranks_cannot_take_is_refused(batch, accum, world, needle):
    """Before: the two multi-rank cases passed start-up and failed on every rank (the
    grad_accum one after an emergency save)."""
    trainer = OmegaConf.create({"batch_size": batch, "grad_accum": accum})
    with pytest.raises(ConfigError, match=re.escape(needle)):
        check_batch(trainer, _Samples(), world)
    check_batch(OmegaConf.create({"batch_size": 8, "grad_accum": 2}), _Samples(), 2)  # fine


def test_an_empty_training_split_is_named_not_given_batch_size_zero():
    """A source of no samples was told "use trainer.batch_size=0 or less"."""

    class Empty:
        block_size = 64

        def __len__(self):
            return 0

        def describe(self):
            return {"kind": "mine"}

    with pytest.raises(ConfigError, match=r"the training split holds no sample \(mine of data"):
        check_batch(OmegaConf.create({"batch_size": 8, "grad_accum": 1}), Empty(), 1)


@pytest.mark.parametrize(
    "overrides, warned",
    [
        (["optim.momentum=0.9"], "optim.momentum=0.9 is not used by optim=adamw"),
        (["optim=sgd", "optim.b1=0.8", "optim.eps=0.001"], "optim.b1=0.8, optim.eps=0.001 are"),
        (["schedule=constant", "schedule.warmup_steps=100"], "schedule.warmup_steps=100 is"),
        (["schedule=constant", "schedule.end_factor=0.5"], "by schedule=constant"),
        (["data=text", "data.path=/tmp", "data.dtype=uint32"], "data.dtype=uint32 is not used"),
        (  # a parameter group's own override, named by the group's key
            ["+optim.groups.top.params=[h.*]", "+optim.groups.top.momentum=0.9"],
            "optim.groups.top.momentum=0.9 is not used by optim=adamw",
        ),
        (["+checkpoint.storage.endpoint=http://x"], "checkpoint.storage (endpoint) is not used"),
        (["checkpoint.best_metric=loss"], "best_metric=loss is not used without"),
    ],
)
def test_a_setting_the_chosen_option_ignores_is_warned_about(overrides, warned):
    """optim=adamw with optim.momentum=0.9 (or sgd with b1, constant with warmup) trained
    as if the setting were not there, with no word."""
    from ftrain.cli.targets import unused_option_settings

    (line,) = unused_option_settings(load_config(overrides))
    assert line.startswith("warning: ") and warned in line


def test_settings_the_chosen_option_uses_are_not_warned_about():
    from ftrain.cli.targets import unused_option_settings

    for overrides in ([], ["optim=sgd", "optim.momentum=0.5"], ["schedule=constant"]):
        assert unused_option_settings(load_config(overrides)) == []
    assert unused_option_settings(load_config(["optim.b1=0.8", "schedule.warmup_steps=3"])) == []
    tokens = ["data=tokens", "data.path=/tmp", "data.dtype=uint32"]
    assert unused_option_settings(load_config(tokens)) == []
    group = ["optim=sgd", "+optim.groups.top.params=[h.*]", "+optim.groups.top.momentum=0.5"]
    assert unused_option_settings(load_config(group)) == []
    s3 = ["checkpoint.dir=s3://b/p", "+checkpoint.storage.endpoint=http://x"]
    assert unused_option_settings(load_config(s3)) == []
    best = ["checkpoint.best_metric=loss", "checkpoint.keep_best=2"]
    assert unused_option_settings(load_config(best)) == []


def test_lora_settings_without_a_rank_are_warned_about():
    """model.lora.targets/alpha with rank 0 ran a full fine-tune (optimizer state for every
    parameter) with no word; the start now says LoRA is off."""
    from ftrain.cli.finetune import unused_lora_settings

    warned = unused_lora_settings(
        load_config(["model.lora.targets=[c_attn]", "model.lora.alpha=32"])
    )
    assert warned.startswith(
        "warning: model.lora.alpha, model.lora.targets set but model.lora.rank=0"
    )
    assert unused_lora_settings(load_config([])) is None
    partial = OmegaConf.create({"model": {"lora": {"rank": 0}}})  # a user YAML's own node
    assert unused_lora_settings(partial) is None
    assert unused_lora_settings(load_config(["model.lora.rank=8", "model.lora.alpha=32"])) is None


def test_a_data_setting_the_source_refuses_is_a_config_error():
    """data=stdlib data.path=X raised a ValueError traceback (exit 1); a DataPathError is
    one of the start-up errors the CLI reports as exit 2."""
    from ftrain.cli.build import build_sources
    from ftrain.data import DataPathError

    with pytest.raises(DataPathError, match="the stdlib corpus reads the Python standard"):
        build_sources(load_config(["data=stdlib", "data.path=/tmp/x"]))


def test_a_token_directory_without_val_bin_trains_when_nothing_evaluates(tmp_path):
    """No val.bin was refused even with evaluation off (the val split was always built)."""
    import numpy as np

    from ftrain.cli.build import build_sources
    from ftrain.data import DataPathError

    np.arange(2_000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    base = ["data=tokens", f"data.path={tmp_path}", "run.dir=/tmp/x"]
    train, val = build_sources(load_config([*base, "trainer.eval_every=null"]))
    assert len(train) > 0 and val is None
    with pytest.raises(DataPathError, match="no 'val.bin' in token directory"):
        build_sources(load_config([*base, "trainer.eval_every=5"]))


def test_a_device_ftrain_does_not_train_on_is_a_clear_error():
    """mps or meta failed deep inside torch (model.to, autocast)."""
    import torch

    from ftrain.cli.build import pick_device

    assert pick_device("cpu") == torch.device("cpu")
    for name, said in (("mps", "trains on cpu or cuda"), ("meta", "trains on cpu or cuda"),
                       ("gpu0", "is not a device")):  # fmt: skip
        with pytest.raises(ConfigError, match=said):
            pick_device(name)


def test_config_differences_name_each_key_with_every_ranks_value():
    """The multi-rank start check (integration: tests/integration/test_torchrun.py) lists
    at most five differing keys, with each rank's value, and a key one rank lacks."""
    from ftrain.cli.startup import _config_differences

    same = {"optim.lr": 0.001, "trainer.seed": 0}
    assert _config_differences([same, dict(same)]) is None
    msg = _config_differences([same, {"optim.lr": 0.01}])
    assert "the 2 ranks were started with different configs" in msg, msg
    assert "optim.lr: 0.001 on rank 0, 0.01 on rank 1" in msg, msg
    assert "trainer.seed: 0 on rank 0, '<absent>' on rank 1" in msg, msg
    many = [{f"k{i}": i for i in range(8)}, {f"k{i}": -i - 1 for i in range(8)}]
    assert "and 3 more key(s)" in _config_differences(many)


def test_an_evaluation_larger_than_the_val_split_is_noted_with_the_count_that_fits():
    """eval_batches x batch_size past the val split wrapped around silently: val_loss
    counted some samples twice at every evaluation."""
    import torch

    from ftrain.cli.build import eval_repeat_note
    from ftrain.data.sources import TensorSource

    val = TensorSource(torch.arange(30 * 8 + 1), block_size=8)  # 30 samples
    assert len(val) == 30
    cfg = load_config(["trainer.batch_size=4", "trainer.eval_every=10", "trainer.eval_batches=7"])
    assert eval_repeat_note(cfg, val) is None  # 28 fit
    cfg = load_config(["trainer.batch_size=4", "trainer.eval_every=10", "trainer.eval_batches=9"])
    note = eval_repeat_note(cfg, val)
    assert "evaluation reads 36 val samples" in note and "the val split holds 30" in note
    assert "trainer.eval_batches=7 reads each at most once" in note
    assert eval_repeat_note(load_config(["trainer.eval_every=null"]), val) is None
    # a val split smaller than one batch: "trainer.eval_batches=1 reads each at most once"
    tiny = TensorSource(torch.arange(3 * 8 + 1), block_size=8)
    cfg = load_config(["trainer.batch_size=4", "trainer.eval_every=10", "trainer.eval_batches=1"])
    note = eval_repeat_note(cfg, tiny)
    assert "a batch of 4 repeats them at any eval_batches: give the val split more data" in note


def test_a_bad_group_setting_is_named_by_the_groups_own_key():
    """+optim.groups.top.lr=0.0 was reported as optim.lr=0.0 with the fix 'set optim.lr'."""
    with pytest.raises(ConfigError, match=r"^optim.groups.top.lr=0.0 is invalid"):
        load_config(["+optim.groups.top.params=[a.*]", "+optim.groups.top.lr=0.0"])
