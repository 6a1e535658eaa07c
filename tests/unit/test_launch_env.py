"""A launch environment that is incomplete or malformed is one named error, not a KeyError."""

import pytest

from ftrain.dist import LaunchError, init_world


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"WORLD_SIZE": "2"}, "RANK is not set"),  # a manual launch that set only the size
        ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR is not set"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT is not set"),
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE is 'abc', not a whole number"),
        ({"WORLD_SIZE": "2", "RANK": "x"}, "RANK is 'x', not a whole number"),
    ],
)
def test_a_partial_or_malformed_launch_environment_names_the_variable(monkeypatch, env, needle):
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(LaunchError, match=needle) as got:
        init_world()
    assert "torchrun" in str(got.value)


def test_no_launch_environment_is_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_world().size == 1


def test_the_device_pick_reads_the_launch_environment_the_same_way(monkeypatch):
    """local_device read WORLD_SIZE and LOCAL_RANK with a bare int(): a traceback on a GPU
    host before init_world could name the variable."""
    import torch

    from ftrain.dist import local_device

    monkeypatch.setenv("WORLD_SIZE", "abc")
    with pytest.raises(LaunchError, match="WORLD_SIZE is 'abc'"):
        local_device(torch.device("cuda"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(LaunchError, match="LOCAL_RANK is 'x'"):
        local_device(torch.device("cuda"))
    assert local_device(torch.device("cpu")) == torch.device("cpu")
