"""An environment torch's own import cannot use (TORCHINDUCTOR_CACHE_DIR naming a file)
is said in one line before torch is imported: it was a 40-line traceback from torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _run(tmp_path, value: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": value}
    return subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "command", [["-m", "ftrain", "--help"], ["-m", "ftrain.ckpt", "list", "x"]]
)
def test_an_ftrain_command_says_the_setting_in_one_line(tmp_path, command):
    (tmp_path / "afile").write_text("")
    for value, why in [("afile", "not a directory"), ("afile/sub", "Not a directory")]:
        out = _run(tmp_path, value, *command)
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines() == [
            f"ftrain: TORCHINDUCTOR_CACHE_DIR={value} cannot be torch's compile cache ({why}): "
            "point it at a directory this user can write, or unset it"
        ]


def test_a_library_import_raises_an_import_error_naming_the_setting(tmp_path):
    (tmp_path / "afile").write_text("")
    out = _run(tmp_path, "afile", "-c", "import ftrain")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "ftrain._early_env.EnvironmentSettingError: TORCHINDUCTOR_CACHE_DIR=afile cannot be "
        "torch's compile cache (not a directory): point it at a directory this user can "
        "write, or unset it"
    )
    assert "site-packages" not in out.stderr  # nothing from inside torch


def test_a_usable_cache_directory_is_created_and_the_command_runs(tmp_path):
    out = _run(tmp_path, "cache/inductor", "-m", "ftrain.ckpt", "list", str(tmp_path / "none"))
    assert (tmp_path / "cache" / "inductor").is_dir()
    assert "TORCHINDUCTOR_CACHE_DIR" not in out.stderr


def test_the_commands_that_say_it_in_one_line_are_recognised():
    from ftrain._early_env import _an_ftrain_command as cmd

    assert cmd(["python", "-m", "ftrain", "x=1"]) and cmd(["python", "-u", "-m", "ftrain.ckpt"])
    assert cmd(["python", "-X", "importtime", "-m", "ftrain"])
    assert cmd(["python", "-u", "/venv/bin/ftrain", "run.dir=x"])  # torchrun's spelling
    assert cmd(["/venv/bin/python", "/venv/bin/ftrain"])
    assert not cmd(["python", "-c", "import ftrain"]) and not cmd(["python", "-m", "ftrainer"])
    assert not cmd(["python", "train.py"]) and not cmd(["python"])


def test_a_cache_directory_this_user_cannot_write_is_said_too(tmp_path):
    """It exists, so creating it succeeded: the run failed at its first compiled step,
    exit 1, 118 lines from Inductor (a read-only mount; /proc/1 for root)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1M", "tmpfs", str(ro)])
    if done.returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        out = _run(tmp_path, str(ro), "-m", "ftrain.ckpt", "list", "x")
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"ftrain: TORCHINDUCTOR_CACHE_DIR={ro} cannot be torch's compile cache (Read-only "
        "file system): point it at a directory this user can write, or unset it"
    ]
