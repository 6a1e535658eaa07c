"""The lines a stopped run ends with: where a re-run resumes, as this rank can know it."""

from __future__ import annotations

from ftrain.ckpt import CheckpointManager


def test_a_rank_but_the_coordinator_says_its_newest_step_may_be_out_of_date(tmp_path, monkeypatch):
    """torchrun names the first rank to fail as the root cause; rank 1 listed the steps
    before rank 0's emergency save committed and said "none (a re-run starts fresh)" or
    an older step, with nothing to say that it could be out of date."""
    import torch.distributed as dist

    from ftrain.cli import run

    manager = CheckpointManager(tmp_path, async_save=False)
    assert run._newest_committed(manager) == "none (a re-run starts fresh)"
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    said = run._newest_committed(manager)
    assert said.startswith("none (a re-run starts fresh) as rank 1 saw it")
    assert "rank 0 may commit a newer one: its log says" in said
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    assert run._newest_committed(manager) == "none (a re-run starts fresh)"


def test_a_save_that_ran_out_of_memory_says_so_not_the_disk(tmp_path, capsys):
    """A save that failed for want of memory (a thread that could not start, the
    allocator) said to fix "the cause (disk, permissions, the object store)"."""
    from ftrain.ckpt import CheckpointSaveError
    from ftrain.cli import run
    from ftrain.cli.session import Asked

    manager = CheckpointManager(tmp_path, async_save=False)
    failed = CheckpointSaveError("[step=4] save failed")
    failed.__cause__ = RuntimeError("can't start new thread")
    assert run._save_failed(failed, manager, Asked()) == 1
    err = capsys.readouterr().err
    assert "fix the memory shortage" in err and "disk, permissions" not in err
    assert "ulimit -u" in err  # a thread that cannot start meets the process limit too
    run._save_failed(CheckpointSaveError("[step=4] save failed: ENOSPC"), manager, Asked())
    assert "fix the cause (disk, permissions, the object store)" in capsys.readouterr().err
