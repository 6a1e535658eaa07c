"""``python -m ftrain`` as a Hydra app: sweeps, --help and Hydra's flags, a user's own model
from a config directory, and a checkpoint's recorded ``_target_`` never imported."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ftrain.ckpt import CheckpointManager

from .conftest import SMALL_CORPUS, TINY, records

# run from other directories (a user's), the subprocess must still import this checkout
ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture
def ftrain_cli(cache_dir, forkserver):
    """``python -m ftrain ARGS`` (a child of the session's fork server: see conftest)."""

    def run(*args, cwd=None, env=None, timeout=300):
        path = os.pathsep.join(filter(None, [(env or {}).get("PYTHONPATH"), ROOT]))
        full = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1", **(env or {}))
        full["PYTHONPATH"] = path
        return forkserver.run(list(args), full, timeout, cwd=cwd)

    return run


def _committed(ckpt_dir):
    return CheckpointManager(Path(ckpt_dir), async_save=False).all_steps()


def _job_dirs(sweep_dir):
    return sorted(p for p in Path(sweep_dir).iterdir() if (p / "checkpoints").is_dir())


def test_multirun_runs_one_job_per_value_and_a_rerun_resumes_each(ftrain_cli, tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", *TINY, "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}"]
    first = ftrain_cli(*args, "trainer.max_steps=2", cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    jobs = _job_dirs(sweep)
    assert [d.name.split("optim.lr=")[1].split(",")[0] for d in jobs] == ["0.001", "0.003"]
    assert all(_committed(d / "checkpoints") == [2] for d in jobs)
    assert "[sweep] 2/2 jobs succeeded" in first.stdout
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()
    peak = {d.name: records(d, "step")[1]["lr"] for d in jobs}  # warmup: lr/2 at step 2
    assert sorted(peak.values()) == [0.0005, 0.0015]

    # the same sweep with a longer max_steps continues both jobs (max_steps is not in the
    # job's directory name)
    again = ftrain_cli(*args, "trainer.max_steps=3", cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert _job_dirs(sweep) == jobs
    assert again.stdout.count("resumed from step 2") == 2
    assert all(_committed(d / "checkpoints")[-1] == 3 for d in jobs)


def test_multirun_exit_status_reflects_a_failed_job(ftrain_cli, tmp_path):
    sweep = tmp_path / "sweep"
    proc = ftrain_cli(
        "-m",
        *TINY,
        "trainer.max_steps=1",
        f"init.from=null,{tmp_path / 'no-such-run'}",
        f"hydra.sweep.dir={sweep}",
        "hydra.sweep.subdir=job${hydra.job.num}",
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "[sweep] 1/2 jobs succeeded" in proc.stdout
    assert "job 1: exit 2" in proc.stdout and "no-such-run" in proc.stderr
    assert _committed(sweep / "job0" / "checkpoints") == [1]


HANGING_LOGGER = """
import threading


class HangAt:
    \"\"\"Hangs for good at step ``at`` of the job whose run directory is named ``job``.\"\"\"

    def __init__(self, *, run, at=2, job="job0"):
        self.hang, self.at = run.run_dir.name == job, at

    def log_metrics(self, kind, step, values):
        if self.hang and step >= self.at:
            threading.Event().wait()

    def close(self):
        pass
"""


def test_a_hung_job_is_that_jobs_exit_4_and_the_sweep_goes_on(ftrain_cli, tmp_path):
    """The hang watchdog ends its process (a hung thread cannot be stopped): that ended the
    whole sweep, with no summary, and a re-run resumed the hung job first."""
    (tmp_path / "hanglog.py").write_text(HANGING_LOGGER)
    sweep = tmp_path / "sweep"
    proc = ftrain_cli(
        "-m",
        *TINY,
        "trainer.seed=1,2",
        "trainer.max_steps=4",
        "checkpoint.every_steps=2",
        "trainer.hang_timeout_s=2",
        "+logger.h._target_=hanglog.HangAt",
        f"hydra.sweep.dir={sweep}",
        "hydra.sweep.subdir=job${hydra.job.num}",
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "job 0 ended with exit 4: going on in a fresh process" in proc.stdout
    assert "(hung) and the sweep goes on with its next job" in proc.stderr, proc.stderr
    assert "supervisor" not in proc.stderr, "a sweep's hung job is not restarted by one"
    assert "job 0: exit 4" in proc.stdout and "job 1: ok" in proc.stdout
    assert _committed(sweep / "job0" / "checkpoints") == [2], "the hang save"
    assert _committed(sweep / "job1" / "checkpoints")[-1] == 4


def test_multirun_config_errors_and_torchrun_are_refused_before_any_job(ftrain_cli, tmp_path):
    bad = ftrain_cli("-m", *TINY, "optim.lr=1e-3,-1", cwd=tmp_path)
    assert bad.returncode == 2 and "optim.lr=-1.0" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "runs").exists()
    ranks = ftrain_cli("-m", "optim.lr=1e-3,3e-3", cwd=tmp_path, env={"WORLD_SIZE": "2"})
    assert ranks.returncode == 2 and "torchrun" in ranks.stderr


def test_help_and_hydra_flags(ftrain_cli, tmp_path):
    helped = ftrain_cli("--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert "== Configuration groups ==" in helped.stdout
    assert "model: gpt2, gpt2_tiny*" in helped.stdout and "optim: adamw*, sgd" in helped.stdout
    assert "max_steps=200" in helped.stdout and "-m" in helped.stdout
    assert "_schema" not in helped.stdout

    shown = ftrain_cli("--cfg", "hydra", cwd=tmp_path)
    assert shown.returncode == 0 and "override_dirname" in shown.stdout, shown.stderr
    assert not list(tmp_path.iterdir()), "no outputs/ or .hydra/ is written"


# Hydra's own flags, passed through (four forked CLI runs, ~5 s)
def test_hydra_info_help_and_shell_completion(ftrain_cli, tmp_path):
    info = ftrain_cli("--info", "searchpath", cwd=tmp_path)
    assert info.returncode == 0 and "pkg://ftrain.conf" in info.stdout, info.stderr
    hydra_help = ftrain_cli("--hydra-help", cwd=tmp_path)
    assert hydra_help.returncode == 0 and "Hydra (1." in hydra_help.stdout

    install = ftrain_cli("-sc", "install=bash", cwd=tmp_path)
    assert install.returncode == 0 and "hydra_bash_completion" in install.stdout
    query = ftrain_cli("-sc", "query=bash", cwd=tmp_path, env={"COMP_LINE": "ftrain model="})
    assert query.returncode == 0 and query.stdout.split() == ["model=gpt2", "model=gpt2_tiny"]
    assert not list(tmp_path.iterdir()), "no outputs/ or .hydra/ is written"


def test_hydra_run_dir_is_honoured_and_other_hydra_settings_refused(ftrain_cli, tmp_path):
    shown = ftrain_cli("--cfg", "job", f"hydra.run.dir={tmp_path}/r")
    assert shown.returncode == 0, shown.stderr
    assert f"dir: {tmp_path}/r/checkpoints" in shown.stdout
    for override, needle in [
        ("hydra.sweep.dir=x", "add -m"),
        ("hydra.job.chdir=true", "never changes the working directory"),
        ("hydra/launcher=basic", "hydra.run.dir"),
    ]:
        proc = ftrain_cli(override, cwd=tmp_path)
        assert proc.returncode == 2 and needle in proc.stderr, (override, proc.stderr)


USER_MODEL = '''
import torch
from torch import nn
from torch.nn import functional as F


class TinyLM(nn.Module):
    """Embedding -> linear next-token model; initialised from torch's global RNG."""

    def __init__(self, vocab_size, n_embd, block_size):
        super().__init__()
        self.block_size = block_size
        self.emb = nn.Embedding(vocab_size, n_embd)
        self.out = nn.Linear(n_embd, vocab_size)

    def forward(self, idx):
        return self.out(self.emb(idx))


def loss(model, batch):
    logits = model(batch["x"])
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())
'''

USER_YAML = """\
# my own model: no Python wrapper around ftrain
_target_: mypkg.TinyLM
loss: mypkg.loss
vocab_size: 256
n_embd: 16
block_size: 16
"""


def test_user_model_from_a_config_dir_trains_and_resumes(ftrain_cli, tmp_path):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text(textwrap.dedent(USER_MODEL))
    (tmp_path / "my_conf" / "model").mkdir(parents=True)
    (tmp_path / "my_conf" / "model" / "tiny_lm.yaml").write_text(USER_YAML)
    common = [
        "--config-dir",
        str(tmp_path / "my_conf"),
        "model=tiny_lm",
        "data=text",
        f"data.path={SMALL_CORPUS}",
        "trainer.batch_size=4",
        "trainer.eval_every=null",
        "run.plot=false",
        "checkpoint.every_steps=2",
    ]
    env = {"PYTHONPATH": str(tmp_path)}
    whole = ftrain_cli(*common, "run.dir=whole", "trainer.max_steps=4", cwd=tmp_path, env=env)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert _committed(tmp_path / "whole" / "checkpoints") == [2, 4]
    # the same through hydra.searchpath, stopped at 2 and resumed: the same numbers
    common[:2] = [f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]"]
    for steps in (2, 4):
        split = ftrain_cli(
            *common, "run.dir=split", f"trainer.max_steps={steps}",
            cwd=tmp_path, env=env,
        )  # fmt: skip
        assert split.returncode == 0, split.stdout + split.stderr
    assert "resumed from step 2" in split.stdout
    losses = [
        {r["step"]: r["loss"] for r in records(tmp_path / d, "step")} for d in ("whole", "split")
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 4


FORGE = """
import sys
from ftrain.ckpt import CheckpointManager
src, dst = sys.argv[1], sys.argv[2]
mgr = CheckpointManager(src, async_save=False)
state, meta = mgr.restore(2), mgr.metadata(2)
run_keys = ("config", "config_hash", "data_fingerprint", "data", "world_size", "layout",
            "schedule_horizon")
keep = {k: meta[k] for k in run_keys}
keep["config"]["model"]["_target_"] = "forged_evil.Boom"
keep["config"]["model"]["loss"] = "forged_evil.loss"
with CheckpointManager(dst, async_save=False) as out:
    out.save(state, metadata=keep, force=True)
"""


def test_a_checkpoints_recorded_target_is_never_imported(cli, tmp_path, monkeypatch):
    """Loading a checkpoint runs no code: a forged ``_target_`` in its recorded config is
    compared as a string (and refused as a change), never imported or instantiated."""
    (tmp_path / "forged_evil.py").write_text(
        f"open({str(tmp_path / 'IMPORTED')!r}, 'w').write('x')\nBoom = loss = None\n"
    )
    base, forged = tmp_path / "base", tmp_path / "forged"
    cli(base, "trainer.max_steps=2", "checkpoint.every_steps=2", check=0)
    subprocess.run(
        [sys.executable, "-c", FORGE, str(base / "checkpoints"), str(forged / "checkpoints")],
        check=True,
        timeout=120,
    )
    meta = CheckpointManager(forged / "checkpoints", async_save=False).metadata(2)
    assert meta["config"]["model"]["_target_"] == "forged_evil.Boom"
    # the forged module is importable by the resuming process: only never importing it helps
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    refused = cli(forged, "trainer.max_steps=3", check=2)
    assert "model._target_: 'forged_evil.Boom' -> 'ftrain.cli.targets.gpt2'" in refused.stderr
    accepted = cli(forged, "trainer.max_steps=3", "run.allow_config_change=true", check=0)
    assert "resumed from step 2" in accepted.stdout
    assert not (tmp_path / "IMPORTED").exists(), "the checkpoint's _target_ was imported"
    assert json.loads((forged / "heartbeat.json").read_text())["step"] == 3


def test_a_stop_signal_while_a_sweep_plans_its_jobs_stops_it_before_job_0(cache_dir, tmp_path):
    """Planning composes every job first (~0.35 s each): a SIGTERM then was acted on only
    after all of them (hundreds of jobs outlast a scheduler's grace period, then SIGKILL).
    Now the planning stops at the next job: one line, exit 3, nothing run."""
    import signal
    import time

    sweep = tmp_path / "sweep"
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "ftrain", "-m", *TINY, "trainer.seed=range(0,400)",
           f"hydra.sweep.dir={sweep}", "trainer.max_steps=1"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    time.sleep(6)  # importing or planning: both are before job 0
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert "[sweep] SIGTERM came while planning the jobs" in out and "nothing ran" in out, out
    assert not sweep.exists() or not _job_dirs(sweep)
