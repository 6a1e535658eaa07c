"""Options built by ``_target_``, user config directories, hydra.* overrides, sweep plans,
and old checkpoints (recorded before options had targets) still comparing equal."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from ftrain import optim as ftrain_optim
from ftrain.cli.app import app_help
from ftrain.cli.build import build_model, build_sources, build_tx
from ftrain.cli.resume import compat_diff
from ftrain.cli.sweep import expand, plan_jobs, run_sweep
from ftrain.config import ConfigError, load_config, to_plain
from ftrain.optim import tree_get

USER_OPTIM = """\
_target_: ftrain.optim.sgd  # any callable(schedule, **keys) -> GradientTransformation
lr: 0.5
momentum: 0.0
"""

USER_SCHEDULE = """\
_target_: my_targets.halving
every: 2
"""

USER_TARGETS = """\
def halving(lr, horizon, *, every):
    return lambda count: lr * 0.5 ** (count // every)
"""


@pytest.fixture
def user_conf(tmp_path, monkeypatch):
    (tmp_path / "conf" / "optim").mkdir(parents=True)
    (tmp_path / "conf" / "schedule").mkdir()
    (tmp_path / "conf" / "optim" / "plain_sgd.yaml").write_text(USER_OPTIM)
    (tmp_path / "conf" / "schedule" / "halving.yaml").write_text(USER_SCHEDULE)
    (tmp_path / "my_targets.py").write_text(USER_TARGETS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"hydra.searchpath=[file://{tmp_path / 'conf'}]"


def test_a_users_optimizer_and_schedule_are_yaml_files_with_a_target(user_conf):
    cfg = load_config([user_conf, "optim=plain_sgd", "schedule=halving"])
    assert cfg.optim.clip == 1.0 and list(cfg.optim.freeze) == []  # ftrain's own keys filled
    model, _ = build_model(cfg)
    params = TensorDict.from_module(model).detach()
    tx = build_tx(cfg)
    opt = tx.init(params)
    grads = params.apply(torch.ones_like)
    lrs = []
    for _ in range(4):
        _, opt = tx.update(grads, opt, params)
        lrs.append(float(tree_get(opt, "learning_rate")))
    assert lrs == [0.5, 0.25, 0.25, 0.125]  # lr at counts 0..3 of halving(every=2), then +1


def test_user_options_are_listed_in_help(user_conf):
    text = app_help([user_conf])
    assert "optim: adamw*, plain_sgd, sgd" in text and "schedule: constant, halving," in text
    assert "_schema" not in text


def test_help_marks_the_chosen_loggers_of_the_list_default():
    """logger: [jsonl] is a list default, which Hydra does not record as a choice: the
    group listed no option marked, where the docs promise the chosen one is."""
    assert "  logger: csv, jsonl*, tensorboard, wandb" in app_help([])
    assert "  logger: csv*, jsonl*, tensorboard*, wandb" in app_help(
        ["logger=[jsonl,csv,tensorboard]"]
    )


def test_a_target_that_cannot_be_built_is_one_config_error():
    with pytest.raises(ConfigError, match=r"model._target_='nopkg.Model' could not be built"):
        build_model(load_config(["model._target_=nopkg.Model"]))
    with pytest.raises(ConfigError, match="fix: check that nopkg is importable"):
        build_model(load_config(["model._target_=nopkg.Model"]))
    # found and called, it refused a value: the fix names the values, not the import
    from omegaconf import read_write

    cfg = load_config([])  # the built-in GPT-2's shape is checked at load: past that check
    with read_write(cfg):
        cfg.model.n_head = 3
    with pytest.raises(ConfigError, match=r"fix: check the model\.\* values") as info:
        build_model(cfg)
    assert "importable" not in str(info.value)
    with pytest.raises(ConfigError, match=r"optim._target_=.*bogus"):
        build_tx(load_config(["optim.b1=0.5", "optim._target_=ftrain.optim.bogus"]))
    with pytest.raises(ConfigError, match="data._target_='nopkg.Source' cannot be imported"):
        build_sources(load_config(["data._target_=nopkg.Source"]))


def test_builtin_options_build_the_same_objects_as_before():
    cfg = load_config(["optim=sgd", "schedule=constant", "optim.lr=0.2"])
    model, _ = build_model(cfg)
    opt = build_tx(cfg).init(TensorDict.from_module(model).detach())
    assert float(tree_get(opt, "learning_rate")) == pytest.approx(0.2)
    ref, _ = build_model(load_config([]))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))


def test_optim_fused_builds_torchs_fused_adam_and_is_refused_where_there_is_none(user_conf):
    cfg = load_config(["optim.fused=true", "schedule=constant"])
    model, _ = build_model(cfg)
    params = TensorDict.from_module(model).detach()
    grads = params.apply(lambda t: torch.full_like(t, 0.01) + t * 0.1)
    got = build_tx(cfg).update(grads, build_tx(cfg).init(params), params)[0]
    o, mask = ftrain_optim, ftrain_optim.masks.ndim_at_least(2)
    for fused in (True, False):
        want = o.chain(
            o.clip_by_global_norm(1.0),
            o.adamw(o.schedule.constant(6e-4), 0.9, 0.95, 1e-8, 0.1, mask, fused=fused),
        )
        same = (got == want.update(grads, want.init(params), params)[0]).all()
        assert bool(same) is fused, "optim.fused=true must build the fused kernel's chain"
    for bad in (
        ["optim=sgd", "optim.fused=true"],
        [user_conf, "optim=plain_sgd", "+optim.fused=1"],
    ):
        with pytest.raises(ConfigError, match=r"optim.fused=true, but optim._target_=.*fused"):
            build_tx(load_config(bad))


@pytest.mark.parametrize(
    "overrides",
    [[], ["optim=sgd", "schedule=constant"], ["data=text", "data.path=/tmp"], ["+recipe=gpt2"]],
)
def test_a_checkpoint_recorded_before_targets_is_compatible(overrides):
    current = to_plain(load_config(overrides))
    old = to_plain(load_config(overrides))
    for group in ("model", "optim", "schedule", "data"):
        del old[group]["_target_"]
    del old["model"]["loss"]
    assert compat_diff(old, current) == ([], [])
    # optim.fused came later still: absent is "false", a safe change to adamw's default
    del old["optim"]["fused"]
    changed = ["optim.fused: False -> True"] if current["optim"]["fused"] else []
    assert compat_diff(old, current) == ([], changed)


def test_a_changed_or_forged_target_is_an_incompatible_change():
    current = to_plain(load_config([]))
    forged = to_plain(load_config([]))
    forged["model"]["_target_"] = "evil.Model"
    bad, _ = compat_diff(forged, current)
    assert bad == ["model._target_: 'evil.Model' -> 'ftrain.cli.targets.gpt2'"]


@pytest.mark.parametrize(
    "override,needle",
    [
        ("hydra.sweep.dir=x", "applies to sweeps only"),
        ("hydra.job.chdir=true", "never changes the working directory"),
        ("hydra/launcher=basic", "runs its jobs itself"),
        ("hydra.output_subdir=.hydra", "hydra.run.dir, hydra.searchpath"),
    ],
)
def test_hydra_settings_ftrain_does_not_act_on_are_refused(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config([override])


def test_hydra_run_dir_is_run_dir():
    cfg = load_config(["hydra.run.dir=/tmp/elsewhere"])
    assert cfg.run.dir == "/tmp/elsewhere" and cfg.checkpoint.dir == "/tmp/elsewhere/checkpoints"
    with pytest.raises(ConfigError, match="different run directories"):
        load_config(["hydra.run.dir=/tmp/a", "run.dir=/tmp/b"])


def test_schema_is_never_an_option():
    with pytest.raises(ConfigError) as info:
        load_config(["optim=optim_schema"])
    assert "optim=optim_schema is the typed schema" in str(info.value)
    assert "Available options in 'optim':\n\tadamw\n\tsgd" in str(info.value)


def test_sweep_expansion_and_job_dirs():
    assert expand(["trainer.seed=range(2)", "+recipe=gpt2"]) == [
        ["trainer.seed=0", "+recipe=gpt2"],
        ["trainer.seed=1", "+recipe=gpt2"],
    ]
    jobs = plan_jobs(["optim=glob(*)", "trainer.max_steps=7"])
    assert [j.cfg.optim.name for j in jobs] == ["adamw", "sgd"]
    assert [j.cfg.run.dir for j in jobs] == [
        "runs/default/multirun/optim=adamw",
        "runs/default/multirun/optim=sgd",
    ]
    assert jobs[1].cfg.checkpoint.dir == "runs/default/multirun/optim=sgd/checkpoints"
    custom = plan_jobs(
        ["optim.lr=1e-3,2e-3", "hydra.sweep.dir=/tmp/s", "hydra.sweep.subdir=${hydra.job.num}"]
    )
    assert [j.cfg.run.dir for j in custom] == ["/tmp/s/0", "/tmp/s/1"]
    # ${now:...} is read once per sweep, as Hydra does: per job, the clock ticking between
    # two jobs' composes spread one sweep over several directories
    timed = plan_jobs(["trainer.seed=range(3)", "hydra.sweep.dir=/tmp/s/${now:%H-%M-%S-%f}"])
    assert len({str(Path(j.cfg.run.dir).parent) for j in timed}) == 1
    # only the clock is frozen: a sweep dir that names a swept key still follows it
    assert [j.cfg.run.dir for j in plan_jobs(["run.name=a,b"])] == [
        "runs/a/multirun",
        "runs/b/multirun",
    ]
    by_lr = plan_jobs(["optim.lr=0.1,0.01", "hydra.sweep.dir=out/lr${optim.lr}"])
    assert [j.cfg.run.dir for j in by_lr] == ["out/lr0.1/optim.lr=0.1", "out/lr0.01/optim.lr=0.01"]
    # W&B at its defaults: one run name per job, grouped by the sweep (all were "default")
    wandb = [j.cfg.logger.wandb for j in plan_jobs(["optim.lr=1e-3,2e-3", "logger=[wandb]"])]
    assert [(w.name, w.group) for w in wandb] == [
        ("default/optim.lr=0.001", "default"),
        ("default/optim.lr=0.002", "default"),
    ]
    mine = plan_jobs(["optim.lr=1e-3,2e-3", "logger=[wandb]", "logger.wandb.group=g"])
    assert [j.cfg.logger.wandb.group for j in mine] == ["g", "g"]


def test_sweep_refusals():
    with pytest.raises(ConfigError, match="would share runs/default/multirun .*job.num"):
        plan_jobs(["trainer.max_steps=1,2"])  # max_steps is not part of a job's dir name
    with pytest.raises(ConfigError, match="hydra.sweep.dir=DIR instead"):
        plan_jobs(["run.dir=x", "optim.lr=1e-3,2e-3"])
    with pytest.raises(ConfigError, match="hydra.sweep.dir/hydra.sweep.subdir"):
        plan_jobs(["hydra.run.dir=x", "optim.lr=1e-3,2e-3"])
    # found only when job 1 ran, after job 0 had trained
    with pytest.raises(ConfigError, match="model.n_embd must be divisible by n_head, got .*=3"):
        plan_jobs(["model.n_head=4,3"])
    # a fixed fallback: a later job resumed an earlier one's steps from it; a fixed logger
    # path: one CSV with two jobs' rows, one TensorBoard log_dir purged by the second job
    for fixed, key in (
        ("checkpoint.fallback_dir=/tmp/fb", "checkpoint.fallback_dir"),
        ("logger.csv.path=/tmp/m.csv", "logger.csv.path"),
        ("logger.tensorboard.log_dir=tb", "logger.tensorboard.log_dir"),
    ):
        with pytest.raises(ConfigError, match=f"would share .*job 0's {key}, job 1's {key}"):
            plan_jobs(["optim.lr=1e-3,2e-3", "logger=[jsonl,csv,tensorboard]", fixed])
    per_job = plan_jobs(["optim.lr=1e-3,2e-3", "checkpoint.fallback_dir=${run.dir}/fb"])
    assert [j.cfg.checkpoint.fallback_dir for j in per_job] == [
        "runs/default/multirun/optim.lr=0.001/fb",
        "runs/default/multirun/optim.lr=0.002/fb",
    ]


def test_a_sweep_rerun_with_resume_safe_changes_keeps_its_job_dirs(tmp_path):
    """Adding a logger, or changing a checkpoint or donation setting, on a sweep's re-run
    named every job anew (Hydra matches exclude_keys exactly), so each started afresh."""
    base = ["optim.lr=1e-3,2e-3", f"hydra.sweep.dir={tmp_path}"]
    dirs = [j.cfg.run.dir for j in plan_jobs(base)]
    assert dirs == [f"{tmp_path}/optim.lr=0.001", f"{tmp_path}/optim.lr=0.002"]
    changed = ["logger=[jsonl,csv]", "logger.csv.path=${run.dir}/m.csv", "trainer.donate=true"]
    changed += ["checkpoint.keep_best=2", "dist.timeout_s=60", "optim.fused=false"]
    assert [j.cfg.run.dir for j in plan_jobs(base + changed)] == dirs
    # a sweep begun under the earlier rule (Hydra's exact match of the earlier list, which
    # named logger and trainer.grad_accum) resumes in its directories
    earlier = "logger=[jsonl,csv],optim.lr=0.001,trainer.grad_accum=2"
    (tmp_path / earlier).mkdir()
    old = [j.cfg.run.dir for j in plan_jobs(base + ["logger=[jsonl,csv]", "trainer.grad_accum=2"])]
    assert old == [f"{tmp_path}/{earlier}", dirs[1]]
    # the docs' "continue both jobs" spelled without the default model=gpt2_tiny: the same
    # jobs (they started afresh in new directories, the first jobs' steps unused)
    spelled = [j.cfg.run.dir for j in plan_jobs(["model=gpt2_tiny", *base])]
    assert spelled == dirs
    other = plan_jobs(["model=gpt2,gpt2_tiny", "optim.lr=1e-3", f"hydra.sweep.dir={tmp_path}"])
    assert [j.cfg.run.dir for j in other] == [f"{tmp_path}/model=gpt2,optim.lr=0.001", dirs[0]]
    (tmp_path / "model=gpt2_tiny,optim.lr=0.002").mkdir()  # named so before: still found
    assert plan_jobs(["model=gpt2_tiny", *base])[1].cfg.run.dir == (
        f"{tmp_path}/model=gpt2_tiny,optim.lr=0.002"
    )
    # a user's option with keys of its own: composing the job without it fails, so it is
    # no default choice (the whole sweep was refused before any job ran)
    (tmp_path / "cd" / "model").mkdir(parents=True)
    (tmp_path / "cd" / "model" / "mine.yaml").write_text("name: gpt2\nhidden: 16\nblock_size: 8\n")
    mine = ["model=mine", "model.hidden=16,32", f"hydra.searchpath=[file://{tmp_path / 'cd'}]"]
    names = [Path(j.cfg.run.dir).name for j in plan_jobs([*mine, *base[1:]])]
    assert names == ["model.hidden=16,model=mine", "model.hidden=32,model=mine"]
    # a W&B dir shared by the jobs: its run-id file would make one job log into another's
    with pytest.raises(ConfigError, match="job 0's logger.wandb.dir, job 1's logger.wandb.dir"):
        plan_jobs(base + ["logger=[jsonl,wandb]", "logger.wandb.dir=/tmp/wb"])


def test_a_job_that_raises_is_that_jobs_exit_1_and_the_sweep_goes_on(capsys):
    jobs = plan_jobs(["optim.lr=1e-3,2e-3,3e-3"])
    ran = []

    def train(cfg):
        ran.append(cfg.optim.lr)
        if len(ran) == 1:
            raise torch.OutOfMemoryError("simulated: out of memory")
        return 0

    assert run_sweep(jobs, train) == 1
    assert ran == [1e-3, 2e-3, 3e-3]
    out = capsys.readouterr()
    assert "OutOfMemoryError: simulated: out of memory" in out.err
    assert "[sweep] 2/3 jobs succeeded" in out.out and "job 0: exit 1" in out.out


def test_tools_rebuilding_from_a_checkpoint_accept_only_builtin_targets():
    from ftrain.cli.targets import check_recorded_targets

    recorded = to_plain(load_config(["optim=sgd"]))
    assert check_recorded_targets(recorded) == recorded
    old = {"model": {"name": "gpt2"}, "data": {"name": "text"}}
    filled = check_recorded_targets(old)
    assert filled["model"]["loss"] == "ftrain.recipes.gpt2.lm_loss"
    assert (
        filled["data"]["_target_"] == "ftrain.data.text.TextCorpusSource"
        and "_target_" not in old["model"]
    )
    for forged in (
        {"model": {**recorded["model"], "_target_": "evil.Model"}},
        {"model": {**recorded["model"], "loss": "evil.loss"}},
        {"model": {"name": "mine", "_target_": "mypkg.Model"}},
        {"data": {**recorded["data"], "cache_dir": {"_target_": "evil.f"}}},
        # instantiate builds targets inside lists too, and _args_ passes them arguments
        {"model": {**recorded["model"], "extra": [1, {"_target_": "os.makedirs"}]}},
        {"model": {**recorded["model"], "extra": [[{"_target_": "os.system"}]]}},
        {"model": {**recorded["model"], "_args_": ["/tmp/x"]}},
        {"data": {**recorded["data"], "opts": {"_partial_": True}}},
    ):
        with pytest.raises(ConfigError, match="names code"):
            check_recorded_targets(forged)
    mine = {"data": {"name": "mine", "_target_": "mypkg.Source"}}  # the fix is the data's
    with pytest.raises(ConfigError, match="build your data source in Python"):
        check_recorded_targets(mine)


def test_a_recorded_builtin_target_under_a_name_of_its_own_is_accepted():
    """A user's option file may reuse a built-in target under its own name (or a name
    override trained fine): eval rebuilds from the target; a foreign loss is still code."""
    from ftrain.cli.targets import check_recorded_targets

    recorded = {
        "optim": {"name": "bogus", "_target_": "ftrain.cli.targets.adamw"},
        "model": {"name": "mygpt", "_target_": "ftrain.cli.targets.gpt2"},
        "data": {"name": "mytext", "_target_": "ftrain.data.text.TextCorpusSource"},
    }
    out = check_recorded_targets(recorded)
    assert out["model"]["loss"] == "ftrain.recipes.gpt2.lm_loss"
    recorded["model"]["loss"] = "os.system"
    with pytest.raises(ConfigError, match="model.loss='os.system'"):
        check_recorded_targets(recorded)


def test_a_job_calling_sys_exit_is_that_jobs_exit_and_the_sweep_goes_on(capsys):
    """``sys.exit(7)`` in a user's loss or logger ended the whole sweep with no summary."""
    jobs = plan_jobs(["optim.lr=1e-3,2e-3"])
    ran = []

    def train(cfg):
        ran.append(cfg.optim.lr)
        if len(ran) == 1:
            sys.exit(7)
        return 0

    assert run_sweep(jobs, train) == 7
    assert ran == [1e-3, 2e-3]
    out = capsys.readouterr().out
    assert "job 0 called sys.exit(7) (exit 7)" in out and "[sweep] 1/2 jobs succeeded" in out


BETWEEN_JOBS = """
import signal, sys
from ftrain.cli.sweep import plan_jobs, run_sweep
from ftrain.signals import StopFlag

ran = []


def train(cfg):
    ran.append(cfg.optim.lr)
    with StopFlag():  # the job's own handlers, put back as it ends (ftrain.cli.run)
        pass
    signal.raise_signal(signal.SIGTERM)  # after that: between two jobs
    return 0


rc = run_sweep(plan_jobs(["optim.lr=1e-3,2e-3"]), train)
print("ran", ran)
sys.exit(rc)
"""


def test_a_signal_between_two_jobs_stops_the_sweep_with_its_summary(tmp_path):
    """Between two jobs no run's handlers were installed: a SIGTERM there (or in the next
    job's device set-up) killed the sweep with 143, no summary, no exit 3."""
    proc = subprocess.run(
        [sys.executable, "-c", BETWEEN_JOBS],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "ran [0.001]" in proc.stdout and "job 1: not started" in proc.stdout


def test_a_signal_as_a_job_finishes_still_stops_the_sweep(capsys):
    """A SIGTERM during a job's last step or final save lets the job finish (exit 0); the
    sweep went on to train the next job in full, where the supervisor's SIGKILL landed."""
    import signal

    from ftrain.signals import StopFlag

    jobs = plan_jobs(["optim.lr=1e-3,2e-3,3e-3"])
    ran = []

    def train(cfg):
        ran.append(cfg.optim.lr)
        with StopFlag():  # the job's own handler, as in ftrain.cli.run
            signal.raise_signal(signal.SIGTERM)
        return 0  # finished anyway: the signal came during the final save

    assert run_sweep(jobs, train) == 3
    assert ran == [1e-3]
    out = capsys.readouterr().out
    assert "job 0 ended as SIGTERM came: stopping the sweep" in out
    assert "job 1: not started" in out


def test_a_sigterm_then_one_sigint_is_not_a_second_sigint():
    """SIGTERM (a stop request) then a single Ctrl-C exited at once with 130 and no save;
    only a second SIGINT does that."""
    import signal

    from ftrain.signals import StopFlag

    with StopFlag() as flag:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)  # would os._exit(130) the test process before
        assert flag.requested and flag.reason == "SIGTERM"


def test_eval_names_the_way_out_for_a_val_split_that_differs():
    """A relative data.path is told to run from the run's directory; an absolute one (or
    data=stdlib) that the data changed: the directory advice was wrong there."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from ftrain.cli.evaluate import _check_same_val

    val, attrs = SimpleNamespace(fingerprint="text:new"), {"val_fingerprint": "text:old"}
    for path, said in (
        ("mydata", "read from"),
        ("/abs/data", "data.path='/abs/data' gives text:new here: the data changed"),
        (None, "data.name='stdlib' gives text:new here: the data changed"),
    ):
        cfg = OmegaConf.create({"data": {"name": "stdlib", "path": path, "val_fraction": 0.1}})
        with pytest.raises(ConfigError, match=re.escape(said)):
            _check_same_val(val, attrs, cfg, "step 4")
    cfg = OmegaConf.create({"data": {"name": "text", "path": "mydata"}})
    _check_same_val(SimpleNamespace(fingerprint="text:old"), attrs, cfg, "step 4")  # the same
    _check_same_val(val, {}, cfg, "step 4")  # recorded before val fingerprints: not checked


def test_a_ctrl_c_in_a_later_jobs_start_up_stops_the_sweep_with_its_summary(capsys):
    """A SIGINT while job 1 was building or restoring escaped the sweep: the single run's
    "nothing was saved by this run" and no word of job 0, which had finished."""
    jobs = plan_jobs(["optim.lr=1e-3,2e-3,3e-3"])
    ran = []

    def train(cfg):
        ran.append(cfg.optim.lr)
        if len(ran) == 2:
            raise KeyboardInterrupt
        return 0

    assert run_sweep(jobs, train) == 130
    assert ran == [1e-3, 2e-3]
    out = capsys.readouterr().out
    assert "job 1 interrupted (SIGINT)" in out and "job 1 was stopped (exit 130)" in out
    assert "job 0: ok" in out and "job 1: exit 130" in out and "job 2: not started" in out


@pytest.mark.parametrize("empty", ["trainer.seed=range(0)", "trainer.seed=range(5,5)"])
def test_a_sweep_with_no_jobs_is_refused(empty, tmp_path):
    """-m trainer.seed=range(0) printed "0/0 jobs succeeded" and exited 0: nothing trained."""
    from ftrain.cli.sweep import plan_jobs

    with pytest.raises(ConfigError, match="has no jobs"):
        plan_jobs([empty, f"hydra.sweep.dir={tmp_path}"])


def test_what_a_sweep_carries_over_is_checked_and_never_inherited(monkeypatch, capsys):
    """A sweep continued after a hung job (ftrain.cli.sweep.exit_process) is told which jobs
    ran through the environment: only this command's record counts, and it is taken out
    so no child of the sweep inherits it."""
    from ftrain.cli.sweep import carried_over

    argv = ["-m", "optim.lr=1e-3,2e-3"]
    record = {"argv": argv, "now": "2026-12-06T20:00:00", "results": {"0": 4}}
    monkeypatch.setenv("FTRAIN_SWEEP_CARRIED", json.dumps(record))
    carried = carried_over(argv)
    assert carried.results == {0: 4} and carried.now.hour == 20
    assert "FTRAIN_SWEEP_CARRIED" not in os.environ
    for bad in ({**record, "argv": ["-m", "other"]}, {"argv": argv}, "not json"):
        monkeypatch.setenv("FTRAIN_SWEEP_CARRIED", bad if isinstance(bad, str) else json.dumps(bad))
        assert carried_over(argv).results == {}
    assert capsys.readouterr().out.count("the sweep starts from its first job") == 3


def test_a_stop_signal_before_the_sweep_began_stops_it_before_its_first_job(monkeypatch, capsys):
    """A SIGTERM recorded before the first job (here: in a sweep's continuation, which plans
    on through it): the sweep's own flag took it without a word and job 0 trained to its
    end (exit 0). A fresh sweep stops while planning (the test above)."""
    import signal

    from ftrain import _early_signals

    monkeypatch.setattr(_early_signals, "_pending", [signal.SIGTERM])
    ran = []
    jobs = plan_jobs(["optim.lr=1e-3,2e-3"], stop_on_signal=False)
    assert run_sweep(jobs, lambda cfg: ran.append(1) or 0) == 3
    assert (
        ran == [] and "SIGTERM came between jobs: stopping before job 0" in capsys.readouterr().out
    )


def test_a_ctrl_c_in_a_jobs_start_up_still_interrupts_it(capsys):
    """The sweep's flag took SIGINT too: a Ctrl-C while a job started up was noted, and the
    job then trained to its end (hours, maybe) instead of stopping."""
    import signal

    # as in a fresh `python -m ftrain` (something earlier in this pytest process may differ)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ran = []

    def train(cfg):
        ran.append(cfg.optim.lr)
        signal.raise_signal(signal.SIGINT)  # before the job's own handlers exist
        return 0

    assert run_sweep(plan_jobs(["optim.lr=1e-3,2e-3"]), train) == 130
    out = capsys.readouterr().out
    assert ran == [1e-3] and "job 0 interrupted (SIGINT)" in out and "job 1: not started" in out


def test_a_stop_the_hung_jobs_process_received_stops_the_continued_sweep(capsys):
    """A SIGTERM while job 0 hung was lost when the sweep went on in a fresh process: that
    process trained job 1 in full inside the grace period."""
    from ftrain.cli.sweep import Carried

    jobs = plan_jobs(["optim.lr=1e-3,2e-3"])
    ran = []
    carried = Carried(argv=["-m"], results={0: 4}, stop="SIGTERM")
    assert run_sweep(jobs, lambda cfg: ran.append(1) or 0, carried) == 4
    out = capsys.readouterr().out
    assert ran == [] and "SIGTERM came between jobs: stopping before job 1" in out
    assert "job 0: exit 4" in out and "job 1: not started" in out


UNBLOCKED = """
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # as the sweep's exec left them
sys.orig_argv[:] = [sys.executable, "-m", "ftrain"]
import ftrain  # noqa: F401  (records stop signals first thing)
print(signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []))
"""


@pytest.mark.parametrize("continued", [True, False])
def test_stop_signals_held_across_a_sweeps_exec_are_let_through_by_the_new_process(continued):
    """The continued sweep blocks the stop signals across its exec (a SIGTERM in the new
    process's first milliseconds killed it, 143, no summary); its ftrain import lets them
    through once they are recorded, and leaves any other process's mask alone."""
    env = dict(os.environ)
    env.pop("FTRAIN_SWEEP_CARRIED", None)
    if continued:
        env["FTRAIN_SWEEP_CARRIED"] = "{}"
    proc = subprocess.run(
        [sys.executable, "-c", UNBLOCKED], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.stdout.strip() == ("False" if continued else "True"), proc.stderr


def test_planning_stops_at_a_pending_stop_signal_except_in_a_sweeps_continuation(monkeypatch):
    """A SIGTERM while the jobs are composed stops the planning at the next job; a sweep's
    continuation (its earlier jobs ran: a hung job's fresh process) plans on, and the signal
    stops it between jobs, with the summary of what ran."""
    import signal

    from ftrain import _early_signals
    from ftrain.cli.sweep import StoppedWhilePlanning

    monkeypatch.setattr(_early_signals, "_pending", [signal.SIGTERM])
    with pytest.raises(StoppedWhilePlanning, match=r"SIGTERM came while planning the jobs \(0"):
        plan_jobs(["optim.lr=1e-3,3e-3"])
    assert len(plan_jobs(["optim.lr=1e-3,3e-3"], stop_on_signal=False)) == 2
    assert _early_signals._pending == [signal.SIGTERM], "kept for the sweep's own flag"
