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
