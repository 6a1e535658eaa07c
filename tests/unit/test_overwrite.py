"""``run.overwrite=true``'s move (ftrain/cli/overwrite.py): whole, or said; never split."""

import os
import signal
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ftrain.cli import overwrite
from ftrain.cli.errors import ResumeError


def _old_run(tmp_path: Path, checkpoint_dir: Path) -> object:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (checkpoint_dir / "step_00000002").mkdir(parents=True)
    (checkpoint_dir / "checkpoints.json").write_text("{}")
    return OmegaConf.create(
        {
            "run": {"dir": str(run)},
            "checkpoint": {"dir": str(checkpoint_dir), "fallback_dir": None, "storage": {}},
            "logger": {},
        }
    )


def test_ctrl_c_mid_move_waits_for_the_whole_move(tmp_path, monkeypatch):
    """A Ctrl-C between two renames split the old run: its records in one folder, its
    steps left for the restart's overwrite to move into another."""
    cfg = _old_run(tmp_path, tmp_path / "ckpt")
    real = overwrite._move_into

    def interrupted(path, target):
        os.kill(os.getpid(), signal.SIGINT)  # delivered between this rename and the next
        return real(path, target)

    monkeypatch.setattr(overwrite, "_move_into", interrupted)
    with pytest.raises(KeyboardInterrupt):
        overwrite.move_run_aside(cfg)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir())[0].startswith("overwritten-")
    (aside,) = (tmp_path / "ckpt").glob("overwritten-*")
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints.json", "step_00000002"]
    assert list((tmp_path / "run").glob("overwritten-*/metrics.jsonl"))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_failed_rename_is_one_error_naming_what_moved(tmp_path, monkeypatch):
    cfg = _old_run(tmp_path, tmp_path / "ckpt")
    real = overwrite._move_into

    def refused(path, target):
        if path.name == "step_00000002":
            raise PermissionError(13, "Permission denied", str(path), None, str(target))
        return real(path, target)

    monkeypatch.setattr(overwrite, "_move_into", refused)
    with pytest.raises(ResumeError, match=r"could not move .*step_00000002 to .*overwritten-.*"):
        overwrite.move_run_aside(cfg)
    assert (tmp_path / "ckpt" / "step_00000002").is_dir()  # nothing deleted


def test_a_directory_holding_only_locks_and_earlier_overwrites_moves_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    cfg = _old_run(tmp_path, ckpt)
    (ckpt / "step_00000002").rmdir()
    (ckpt / "checkpoints.json").unlink()
    (ckpt / "overwritten-20261207-000000").mkdir()
    (ckpt / ".writer.lock").touch()
    overwrite.move_run_aside(cfg)
    assert sorted(p.name for p in ckpt.iterdir()) == [".writer.lock", "overwritten-20261207-000000"]
