"""Helpers for running the real CLI (``python -m ftrain``) in subprocesses."""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

# A small, real text corpus present on every machine: the stdlib's json package.
SMALL_CORPUS = str(Path(sysconfig.get_paths()["stdlib"]) / "json")

TINY = [
    "model=gpt2_tiny",
    "model.block_size=32",
    "model.dropout=0.1",
    "data=text",
    f"data.path={SMALL_CORPUS}",
    "trainer.batch_size=4",
    "trainer.eval_every=4",
    "trainer.eval_batches=2",
    "schedule.warmup_steps=2",
    "schedule.decay_steps=12",
    "run.plot=false",
]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ftrain-cache"))


@pytest.fixture
def cli(cache_dir):
    """Run ``python -m ftrain`` with the tiny config plus overrides; return CompletedProcess."""

    def run(run_dir, *overrides, check=None, timeout=240):
        env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "ftrain", f"run.dir={run_dir}", *TINY, *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        if check is not None and proc.returncode != check:
            raise AssertionError(
                f"exit {proc.returncode} != {check}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return proc

    return run


@pytest.fixture
def popen_cli(cache_dir):
    def start(run_dir, *overrides):
        env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "ftrain", f"run.dir={run_dir}", *TINY, *overrides]
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )

    return start


def records(run_dir, kind=None):
    path = Path(run_dir) / "metrics.jsonl"
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in out if kind is None or r["kind"] == kind]
