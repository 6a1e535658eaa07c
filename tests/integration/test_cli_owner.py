"""A checkpoint.dir outside run.dir belongs to one run directory at a time (the real CLI,
a real SIGKILL): a run killed mid-way keeps its claim, a second run directory is refused
with the owner named and nothing written, the killed run's restart passes and releases
the claim when it ends; run.overwrite keeps the claim with the directory."""

import json
import os
import subprocess
import sys

import pytest

from ftrain.ckpt import CheckpointManager
from ftrain.ckpt.owner import OWNER

from .conftest import TINY

SAVES = ("checkpoint.every_steps=2", "checkpoint.async_save=false")


def _killed_at(phase: str, count: int, run_dir, overrides, cache_dir) -> None:
    """Run the CLI in ``run_dir`` until it SIGKILLs itself at the ``count``-th ``phase`` of
    the commit protocol (:mod:`ftrain.faults`)."""
    from ftrain.faults import inject_dir

    arm = run_dir.parent / f"arm-{run_dir.name}.json"
    arm.write_text(json.dumps({"id": "k", "phase": phase, "count": count, "rank": 0}))
    path = os.pathsep.join(filter(None, [str(inject_dir()), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONPATH=path)
    env["FTRAIN_CHAOS_ARM"] = str(arm)
    cmd = [sys.executable, "-m", "ftrain", f"run.dir={run_dir}", *TINY, *overrides]
    killed = subprocess.run(cmd, env=env, capture_output=True, timeout=240)
    assert killed.returncode == -9 and arm.with_name(arm.name + ".fired").exists(), killed


def test_a_killed_runs_checkpoint_dir_refuses_another_run_dir_until_it_resumes(
    cli, cache_dir, tmp_path
):
    ckpt, run_a, run_b = tmp_path / "shared-ckpt", tmp_path / "a", tmp_path / "b"
    where = (f"checkpoint.dir={ckpt}", "trainer.max_steps=4", *SAVES)
    _killed_at("renamed", 1, run_a, where, cache_dir)
    assert json.loads((ckpt / OWNER).read_text())["run_dir"] == str(run_a.resolve())
    before = sorted(p.name for p in ckpt.iterdir())

    out = cli(run_b, *where, check=2)
    assert "belongs to another run" in out.stderr and str(run_a.resolve()) in out.stderr
    assert "checkpoint.take_over=true" in out.stderr and "Traceback" not in out.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == before  # nothing written

    out = cli(run_a, *where, check=0)  # the killed run's restart
    assert "resumed from step 2" in out.stdout, out.stdout
    assert CheckpointManager(ckpt).all_steps() == [2, 4]
    assert "ended" in json.loads((ckpt / OWNER).read_text())  # its steps stay its own
    out = cli(run_b, *where, check=2)  # finished, its history is still not b's to continue
    assert "holds the checkpoints of another run" in out.stderr, out.stderr
    assert f"init.from={run_a.resolve()}" in out.stderr
    assert CheckpointManager(ckpt).all_steps() == [2, 4]


def test_a_take_over_counts_the_steps_the_previous_run_reached_as_redone(cli, cache_dir, tmp_path):
    """Run b taking over killed run a's checkpoints retrained steps a had run past its
    newest commit, and said nothing of it (``"redo": null``): only b's records were read."""
    ckpt, run_a, run_b = tmp_path / "shared-ckpt", tmp_path / "a", tmp_path / "b"
    where = (f"checkpoint.dir={ckpt}", "trainer.max_steps=6", *SAVES)
    _killed_at("begun", 2, run_a, where, cache_dir)  # step 4's save began: 2 committed
    out = cli(run_b, *where, "checkpoint.take_over=true", check=0)
    assert "resumed from step 2" in out.stdout, out.stdout
    assert "steps 3..4 ran before but were not committed" in out.stdout, out.stdout
    resumes = [json.loads(x) for x in (run_b / "metrics.jsonl").read_text().splitlines()]
    assert [r["redo"] for r in resumes if r["kind"] == "resume"] == [[3, 4]]


def test_run_overwrite_keeps_the_claim_with_the_checkpoint_dir(cli, tmp_path):
    ckpt, run = tmp_path / "ext", tmp_path / "run"
    cli(run, f"checkpoint.dir={ckpt}", "trainer.max_steps=2", *SAVES, check=0)
    out = cli(
        run, f"checkpoint.dir={ckpt}", "trainer.max_steps=2", *SAVES, "resume=none",
        "run.overwrite=true", check=0,
    )  # fmt: skip
    assert "moved" in out.stdout and CheckpointManager(ckpt).all_steps() == [2]
    moved = list(ckpt.glob("overwritten-*"))  # the directory keeps its place
    assert len(moved) == 1 and CheckpointManager(moved[0]).all_steps() == [2]
    assert "ended" in json.loads((ckpt / OWNER).read_text())  # its steps stay claimed
    assert not (moved[0] / OWNER).exists()
    assert [p.name for p in tmp_path.iterdir() if "overwritten" in p.name] == []


def test_run_overwrite_of_a_checkpoint_dir_that_is_a_mount_point(cli, tmp_path, tmpfs):
    """A dedicated checkpoint volume: renaming the mount point itself aside failed (EBUSY)
    with a traceback, after the run's records had moved. Its steps move within it; a file
    of the user's beside them is kept (moved with them, never deleted)."""
    ckpt, run = tmpfs("64M"), tmp_path / "run"
    cli(run, f"checkpoint.dir={ckpt}", "trainer.max_steps=2", *SAVES, check=0)
    (ckpt / "notes.txt").write_text("mine")
    out = cli(
        run, f"checkpoint.dir={ckpt}", "trainer.max_steps=2", *SAVES, "resume=none",
        "run.overwrite=true", check=0,
    )  # fmt: skip
    assert "Traceback" not in out.stderr and "moved the old steps in" in out.stdout
    (moved,) = ckpt.glob("overwritten-*")
    assert CheckpointManager(moved).all_steps() == [2] and CheckpointManager(ckpt).all_steps() == [
        2
    ]
    assert (moved / "notes.txt").read_text() == "mine"
    assert list(run.glob("overwritten-*/metrics.jsonl"))  # the records moved too


def test_a_run_dirs_own_checkpoints_refuse_a_run_elsewhere_pointed_at_them(
    cli, cache_dir, tmp_path
):
    """The default checkpoint.dir (inside run.dir) was left unclaimed, the run lock being
    thought to cover it: a run in another run.dir with checkpoint.dir=<a>/checkpoints
    trained into it beside the first run, moving its steps aside as another history."""
    from ftrain.faults import inject_dir

    run_a, run_b = tmp_path / "a", tmp_path / "b"
    arm = tmp_path / "arm.json"
    arm.write_text(json.dumps({"id": "k", "phase": "renamed", "count": 1, "rank": 0}))
    path = os.pathsep.join(filter(None, [str(inject_dir()), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONPATH=path)
    env["FTRAIN_CHAOS_ARM"] = str(arm)
    cmd = [sys.executable, "-m", "ftrain", f"run.dir={run_a}", *TINY, "trainer.max_steps=4"]
    killed = subprocess.run([*cmd, *SAVES], env=env, capture_output=True, timeout=240)
    assert killed.returncode == -9, killed
    ckpt = run_a / "checkpoints"
    assert json.loads((ckpt / OWNER).read_text())["run_dir"] == str(run_a.resolve())
    before = sorted(p.name for p in ckpt.iterdir())
    out = cli(run_b, f"checkpoint.dir={ckpt}", "trainer.max_steps=4", *SAVES, check=2)
    assert "belongs to another run" in out.stderr and str(run_a.resolve()) in out.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == before  # nothing written
    assert "resumed from step 2" in cli(run_a, "trainer.max_steps=4", *SAVES, check=0).stdout


def test_run_overwrite_keeps_the_claim_of_checkpoints_inside_run_dir(tmp_path):
    from omegaconf import OmegaConf

    from ftrain.ckpt.owner import claim
    from ftrain.cli.overwrite import move_run_aside

    run = tmp_path / "run"
    for ckpt in (run / "checkpoints", run):  # the default, and checkpoint.dir=run.dir
        c = claim(ckpt, run)
        (ckpt / "step_00000002").mkdir(parents=True)
        cfg = {"run": {"dir": str(run)}, "checkpoint": {"dir": str(ckpt)}}
        cfg["checkpoint"] |= {"fallback_dir": None, "storage": None}
        aside = move_run_aside(OmegaConf.create(cfg))
        assert aside is not None and not (ckpt / "step_00000002").exists()
        assert json.loads((ckpt / OWNER).read_text())["token"] == c.record["token"]
        c.release()


def test_run_overwrite_moves_logger_files_at_the_users_own_places(tmp_path):
    """logger.csv.path outside run.dir stayed: the new run appended to the old run's rows,
    whose later steps then counted as the new run's."""
    from omegaconf import OmegaConf

    from ftrain.cli.overwrite import move_run_aside

    run, elsewhere = tmp_path / "run", tmp_path / "logs"
    (run / "logs").mkdir(parents=True)
    elsewhere.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    (elsewhere / "m.csv").write_text("step,loss\n6,1.0\n")
    (run / "logs" / "tb").mkdir()
    cfg = OmegaConf.create(
        {
            "run": {"dir": str(run)},
            "checkpoint": {"dir": str(run / "checkpoints"), "fallback_dir": None, "storage": None},
            "logger": {
                "csv": {"path": str(elsewhere / "m.csv")},
                "tensorboard": {"log_dir": str(run / "logs" / "tb")},
                "wandb": {"dir": str(run)},  # the run dir itself: stays
            },
        }
    )
    aside = move_run_aside(cfg)
    assert not (elsewhere / "m.csv").exists() and run.is_dir()
    (moved,) = elsewhere.glob("m.csv.overwritten-*")
    assert moved.read_text() == "step,loss\n6,1.0\n"
    assert (aside / "logs" / "tb").is_dir() and (aside / "metrics.jsonl").exists()


def test_run_overwrite_leaves_a_wandb_dir_elsewhere_that_other_runs_share(tmp_path):
    """logger.wandb.dir=/shared for several runs: run.overwrite of one renamed /shared,
    taking the other runs' offline W&B runs along. W&B's folders there are per run id and
    the id lives in run.dir (moved with the run), so /shared stays; one inside run.dir
    still moves with the run."""
    from omegaconf import OmegaConf

    from ftrain.cli.overwrite import move_run_aside

    run, shared = tmp_path / "run", tmp_path / "wb"
    (run / "wandb").mkdir(parents=True)
    (run / "wandb" / "ftrain-run-id").write_text("aaaa\n")
    (shared / "wandb" / "offline-run-1-bbbb").mkdir(parents=True)  # another run's
    target = "ftrain.metrics.loggers.WandbLogger"
    cfg = OmegaConf.create(
        {
            "run": {"dir": str(run)},
            "checkpoint": {"dir": str(run / "checkpoints"), "fallback_dir": None, "storage": None},
            "logger": {"wandb": {"_target_": target, "dir": str(shared)}},
        }
    )
    aside = move_run_aside(cfg)
    assert (shared / "wandb" / "offline-run-1-bbbb").is_dir()
    assert not list(tmp_path.glob("wb.overwritten-*"))
    assert (aside / "wandb" / "ftrain-run-id").read_text() == "aaaa\n"
    (run / "wb" / "wandb").mkdir(parents=True)  # inside run.dir: this run's own
    cfg.logger.wandb.dir = str(run / "wb")
    assert (move_run_aside(cfg) / "wb" / "wandb").is_dir() and not (run / "wb").exists()


@pytest.mark.parametrize("inside", [True, False])
def test_run_overwrite_leaves_a_logger_place_holding_the_checkpoints_to_their_move(
    tmp_path, inside
):
    """A TensorBoard log_dir holding checkpoint.dir was moved first and took the steps
    along: a FileNotFoundError halfway (inside run.dir), or this run's claim lost with
    the old steps (outside)."""
    from omegaconf import OmegaConf

    from ftrain.ckpt.owner import claim
    from ftrain.cli.overwrite import move_run_aside

    run = tmp_path / "run"
    tb = run / "out" if inside else tmp_path / "exp"
    ckpt = tb / "ckpt"
    c = claim(ckpt, run)
    (ckpt / "step_00000010").mkdir(parents=True)
    (tb / "events.out.tfevents.1").write_text("old")
    cfg = OmegaConf.create(
        {
            "run": {"dir": str(run)},
            "checkpoint": {"dir": str(ckpt), "fallback_dir": None, "storage": None},
            "logger": {"tensorboard": {"log_dir": str(tb)}},
        }
    )
    assert move_run_aside(cfg) is not None or not inside
    assert not (ckpt / "step_00000010").exists()
    assert json.loads((ckpt / OWNER).read_text())["token"] == c.record["token"]
    c.release()
