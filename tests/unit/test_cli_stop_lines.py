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
