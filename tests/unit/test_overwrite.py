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
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a job started with '&'
    with pytest.raises(KeyboardInterrupt):
        overwrite.move_run_aside(cfg)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir())[0].startswith("overwritten-")
    (aside,) = (tmp_path / "ckpt").glob("overwritten-*")
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints.json", "step_00000002"]
    assert list((tmp_path / "run").glob("overwritten-*/metrics.jsonl"))
    assert signal.getsignal(signal.SIGINT) == before  # put back


def test_a_failed_rename_is_one_error_and_the_rerun_fills_the_same_folders(tmp_path, monkeypatch):
    """A rerun after a refused rename moved the rest into a second overwritten-<time>
    folder: the old run split in two, as a Ctrl-C had split it."""
    ckpt = tmp_path / "ckpt"
    cfg = _old_run(tmp_path, ckpt)
    real = overwrite._move_into

    def refused(path, target):
        if path.name == "step_00000002":
            raise PermissionError(13, "Permission denied", str(path), None, str(target))
        return real(path, target)

    monkeypatch.setattr(overwrite, "_move_into", refused)
    with pytest.raises(ResumeError, match=r"could not move .*step_00000002 to .*overwritten-"):
        overwrite.move_run_aside(cfg)
    assert (ckpt / "step_00000002").is_dir()  # nothing deleted
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0}\n')  # the failed start's
    monkeypatch.setattr(overwrite, "_stamp", lambda: "20991231-235959")  # a later second
    monkeypatch.setattr(overwrite, "_move_into", real)
    overwrite.move_run_aside(cfg)
    (aside,) = ckpt.glob("overwritten-*")
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints.json", "step_00000002"]
    assert not list(tmp_path.glob(f"**/{overwrite.UNFINISHED}"))  # the move is whole
    (records,) = (tmp_path / "run").glob("overwritten-*")
    assert sorted(p.name for p in records.iterdir()) == ["metrics.jsonl", "metrics.jsonl-2"]
    assert (records / "metrics.jsonl").read_text() == '{"step": 1}\n'  # never replaced


def test_a_volumes_lost_and_found_and_a_nested_fallback(tmp_path):
    """lost+found (root's, 0700) was moved as an old entry, and a fresh volume holding
    only it counted as non-empty; a fallback inside checkpoint.dir, moved along with it,
    was then moved again: 'could not move .../fb to None'."""
    ckpt = tmp_path / "ckpt"
    cfg = _old_run(tmp_path, ckpt)
    (ckpt / "lost+found").mkdir()
    (ckpt / "fb" / "step_00000004").mkdir(parents=True)
    cfg.checkpoint.fallback_dir = str(ckpt / "fb")
    overwrite.move_run_aside(cfg)
    (aside,) = ckpt.glob("overwritten-*")
    assert (aside / "fb" / "step_00000004").is_dir() and (ckpt / "lost+found").is_dir()
    assert not list(aside.glob(f"**/{overwrite.UNFINISHED}"))
    assert sorted(p.name for p in ckpt.iterdir()) == ["lost+found", aside.name]


def test_a_directory_holding_only_locks_and_earlier_overwrites_moves_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    cfg = _old_run(tmp_path, ckpt)
    (ckpt / "step_00000002").rmdir()
    (ckpt / "checkpoints.json").unlink()
    (ckpt / "overwritten-20261207-000000").mkdir()
    (ckpt / ".writer.lock").touch()
    overwrite.move_run_aside(cfg)
    assert sorted(p.name for p in ckpt.iterdir()) == [".writer.lock", "overwritten-20261207-000000"]


def test_a_place_a_cut_short_move_emptied_is_not_left_unfinished(tmp_path, monkeypatch):
    """The checkpoint dir moved whole, the fallback refused: the rerun had nothing left to
    move in the checkpoint dir and left its folder marked, for a later overwrite of another
    run to fill."""
    ckpt, fb = tmp_path / "ckpt", tmp_path / "fb"
    cfg = _old_run(tmp_path, ckpt)
    (fb / "step_00000004").mkdir(parents=True)
    cfg.checkpoint.fallback_dir = str(fb)
    real = overwrite._move_into

    def refused(path, target):
        if path.parent == fb:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, target)

    monkeypatch.setattr(overwrite, "_move_into", refused)
    with pytest.raises(ResumeError, match=r"could not move .*fb/step_00000004: Permission"):
        overwrite.move_run_aside(cfg)
    assert list(ckpt.glob(f"overwritten-*/{overwrite.UNFINISHED}"))
    monkeypatch.setattr(overwrite, "_move_into", real)
    overwrite.move_run_aside(cfg)
    assert not list(tmp_path.glob(f"**/{overwrite.UNFINISHED}"))
    assert list(fb.glob("overwritten-*/step_00000004"))
