"""conf/ and the recipes work from a non-editable install, from any working directory."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_non_editable_install_finds_configs_from_any_directory(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (target / "ftrain" / "conf" / "recipe" / "gpt2.yaml").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(target))
    where = subprocess.run(
        [sys.executable, "-c", "import ftrain; print(ftrain.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert where.stdout.strip().startswith(str(target)), where
    cfg = subprocess.run(
        [sys.executable, "-m", "ftrain", "--cfg", "+recipe=gpt2"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cfg.returncode == 0, cfg.stderr
    assert "name: gpt2" in cfg.stdout and "n_layer: 12" in cfg.stdout
