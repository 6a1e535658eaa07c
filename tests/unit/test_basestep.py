"""init.from's base step agreed across ranks (ftrain.cli.basestep): every rank takes part
in every collective whatever its read raised, so none is left waiting."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from ftrain.ckpt import CheckpointStoreError
from ftrain.cli import basestep
from ftrain.config import ConfigError
from ftrain.dist import World


def _cfg(tmp_path):
    return OmegaConf.create(
        {
            "init": {"from": str(tmp_path / "base")},
            "run": {"dir": str(tmp_path)},
            "resume": "latest",
        }
    )


@pytest.fixture
def collectives(monkeypatch):
    """The collectives each rank reached, in order; ``answers`` what rank 0 "sent"."""
    seen, answers = [], []

    def broadcast(value, *a, **k):
        seen.append(("broadcast", value))
        return value if value is not None else answers.pop(0)

    def gather(value, *a, **k):
        seen.append(("gather", value))
        return [value]

    monkeypatch.setattr(basestep, "broadcast_json", broadcast)
    monkeypatch.setattr(basestep, "gather_json", gather)
    return seen, answers


def test_a_coordinator_whose_read_raises_any_error_tells_the_others_first(
    tmp_path, monkeypatch, collectives
):
    """A store outage (not a ConfigError) on rank 0 left the other ranks in the broadcast."""
    seen, _ = collectives

    def outage(*a, **k):
        raise CheckpointStoreError("s3://b/base: unreachable")

    monkeypatch.setattr(basestep, "init_from", outage)
    with pytest.raises(CheckpointStoreError):  # its own kind on rank 0
        basestep.agreed_init_from(_cfg(tmp_path), None, World(0, 2))
    assert seen == [("broadcast", {"error": "CheckpointStoreError: s3://b/base: unreachable"})]


def test_a_rank_whose_read_raises_still_reports_and_every_rank_stops(
    tmp_path, monkeypatch, collectives
):
    seen, answers = collectives
    answers += [{"step": 4}, "rank 1: OSError: [Errno 5] Input/output error"]

    def eio(*a, **k):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(basestep, "init_from", eio)
    with pytest.raises(OSError):
        basestep.agreed_init_from(_cfg(tmp_path), None, World(1, 2))
    assert [kind for kind, _ in seen] == ["broadcast", "gather", "broadcast"]
    assert seen[1] == ("gather", {"error": "OSError: [Errno 5] Input/output error"})
    # the coordinator hears it and stops too
    reports = [{"ok": True}, {"error": "OSError: [Errno 5] Input/output error"}]
    monkeypatch.setattr(basestep, "gather_json", lambda value: reports)
    monkeypatch.setattr(basestep, "_coordinator_read", lambda cfg, fresh: (None, "line", 4))
    with pytest.raises(ConfigError, match="could not be read on every rank: rank 1: OSError"):
        basestep.agreed_init_from(_cfg(tmp_path), None, World(0, 2))
