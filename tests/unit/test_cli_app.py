"""The command line's own checks (ftrain.cli.app), without training."""

import pytest

from ftrain.cli.app import run_app
from ftrain.signals import EXIT_CONFIG


def _never(cfg):  # pragma: no cover - a refused command never trains
    raise AssertionError("trained")


def test_a_missing_searchpath_directory_is_refused_as_config_dir_is(tmp_path, capsys):
    """hydra.searchpath=[file:///nonexistent] was skipped by Hydra without a word (its
    options silently absent), where --config-dir /nonexistent is refused."""
    missing = tmp_path / "nope"
    assert run_app([f"hydra.searchpath=[file://{missing}]"], _never) == EXIT_CONFIG
    assert "no such directory" in capsys.readouterr().err
    assert run_app(["--config-dir", str(missing)], _never) == EXIT_CONFIG
    assert run_app([f"hydra.searchpath=[file://{tmp_path}]", "--cfg", "job"], _never) == 0


def test_a_quoted_searchpath_entry_is_read_without_its_quotes(tmp_path):
    """The check kept the closing quote of 'file://DIR' and refused an existing directory."""
    spaced = tmp_path / "my configs"
    spaced.mkdir()
    for entry in (f"'file://{tmp_path}'", f'"file://{tmp_path}"', f"'file://{spaced}'"):
        assert run_app([f"hydra.searchpath=[{entry}]", "--cfg", "job"], _never) == 0, entry


def test_a_sharded_save_failing_because_a_rank_died_is_a_peer_gone():
    """A rank SIGKILLed during a synchronous sharded save: the survivor's save failed in
    the part exchange with gloo's "Connection closed by peer" and said "sharded save
    failed: ... fix the cause (disk, permissions, the object store)". It is the one line
    `another rank is gone` now: the save's error is searched down to its cause."""
    from ftrain.ckpt import CheckpointSaveError
    from ftrain.cli import run

    gloo = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:4567")
    try:
        try:
            raise gloo
        except RuntimeError as e:
            raise CheckpointSaveError("[step=12] sharded save failed") from e
    except CheckpointSaveError as save_error:
        assert run._peer_gone(save_error)
    assert not run._peer_gone(CheckpointSaveError("[step=12] No space left on device"))


def test_a_collective_timed_out_on_a_stopped_rank_is_a_peer_lost_not_a_traceback():
    """Rank 1 SIGSTOPped: rank 0's all-reduce gave up after dist.timeout_s with gloo's
    "Timed out waiting 8000ms for recv operation to complete", which matched none of the
    peer-gone texts: a 30-line traceback, no "newest committed checkpoint" line."""
    from ftrain.cli import run

    for text in (
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
        "8000ms for recv operation to complete",
        "[unbound_buffer.cc:133] Timed out waiting 8000ms for send operation to complete",
        "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)",
    ):
        assert run._peer_gone(RuntimeError(text)), text
        assert run._PEER_HUNG.search(text)
    assert not run._peer_gone(RuntimeError("Timed out waiting for the lock on runs/x/.lock"))
    assert not run._PEER_HUNG.search("[pair.cc:553] Connection closed by peer")


def test_a_stop_tells_to_resume_with_resume_latest_when_the_command_would_not():
    """The stop said "Run the same command again to resume" whatever resume= was: with
    resume=none the same command refused the committed steps (exit 2: never restart) or,
    with run.overwrite=true, started over; with resume=N it went back to N again. The
    advice follows the command's own values (a torchrun restart runs on with
    resume=latest; a relaunch does what the command says)."""
    from ftrain.cli.session import Asked, rerun_command

    assert rerun_command(Asked("latest")) == ("run the same command again", "")
    command, why = rerun_command(Asked("none"))
    assert command == "run it again with resume=latest" and "refuse the committed steps" in why
    command, why = rerun_command(Asked("none", overwrite=True))
    assert (
        command.endswith("without run.overwrite=true") and why == " (this command would start over)"
    )
    assert rerun_command(Asked(2))[1] == " (this command's resume=2 would go back to step 2 again)"
    assert rerun_command(Asked("none"), committed=False) == ("run the same command again", "")


def test_a_checkpoint_dir_too_long_for_the_state_is_refused_at_the_start(tmp_path):
    """A checkpoint.dir of ~4,000 bytes trained until its first save failed with
    ENAMETOOLONG (and the emergency save too)."""
    import torch
    from tensordict import TensorDict

    from ftrain.cli.build import check_checkpoint_paths
    from ftrain.config import ConfigError

    state = TensorDict({"step": torch.tensor(0), "opt": {"mu": {"w": torch.zeros(4, 4)}}}, [])
    long = tmp_path / "/".join(["d" * 250] * 16)
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"checkpoint": {"dir": str(long), "fallback_dir": "s3://b/p"}})
    with pytest.raises(ConfigError, match=r"checkpoint.dir is too long.*'opt/mu/w'.*4095"):
        check_checkpoint_paths(cfg, state)
    cfg.checkpoint.dir = str(tmp_path / "ok")
    check_checkpoint_paths(cfg, state)  # an object store's path is not a file's
