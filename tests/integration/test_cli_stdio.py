"""The standard streams a cluster job may hand ftrain: closed (``>&-``, ``2>&-``), an
encoding that cannot hold the run directory's name (``PYTHONIOENCODING=ascii``), and
``python -OO`` (docstrings stripped). Each was a traceback at start or at step 1."""

import os
import subprocess
import sys

from ftrain.ckpt import CheckpointManager

from .conftest import TINY


def _ftrain(cache_dir, *args, closed=(), env=None, flags=()):
    def close():  # in the child, before exec: as a shell's `>&-` does
        for fd in closed:
            os.close(fd)

    full_env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, **(env or {}))
    out = subprocess.PIPE if 1 not in closed else None
    err = subprocess.PIPE if 2 not in closed else None
    return subprocess.run(
        [sys.executable, *flags, "-m", *args], stdout=out, stderr=err, env=full_env,
        preexec_fn=close, timeout=240, text=True,
    )  # fmt: skip


def test_a_run_with_stdout_or_stderr_closed_trains(cache_dir, tmp_path):
    """`>&-`: sys.stdout was None and the progress line an AttributeError at step 1 of
    every start."""
    steps = ("trainer.max_steps=2", "checkpoint.every_steps=2")
    for name, closed in (("out", (1,)), ("err", (2,))):
        run = tmp_path / name
        done = _ftrain(cache_dir, "ftrain", f"run.dir={run}", *TINY, *steps, closed=closed)
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert CheckpointManager(run / "checkpoints").all_steps() == [2]


def test_import_ftrain_gives_a_closed_stderr_dev_null_before_any_file_takes_it(tmp_path):
    """`2>&-`: the next file opened took descriptor 2 (the run lock), and what C code wrote
    to stderr went into it."""
    probe = "import os, ftrain; print(os.readlink('/proc/self/fd/2'))"
    done = subprocess.run(
        [sys.executable, "-c", probe], stdout=subprocess.PIPE, text=True, timeout=120,
        preexec_fn=lambda: os.close(2),
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == os.devnull, done.stdout


def test_a_name_the_console_cannot_encode_is_escaped_not_a_traceback(cache_dir, tmp_path):
    run = tmp_path / "r\u00fc"
    ascii_only = {"PYTHONIOENCODING": "ascii"}
    done = _ftrain(cache_dir, "ftrain", f"run.dir='{run}'", *TINY, "trainer.max_steps=2",
                   "run.plot=true", env=ascii_only)  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "r\\xfc" in done.stdout and "could not write the plot" not in done.stdout
    listed = _ftrain(cache_dir, "ftrain.ckpt", "show", str(run / "checkpoints"), env=ascii_only)
    assert listed.returncode == 0 and "r\\xfc" in listed.stdout, listed.stderr


def test_the_tools_run_under_python_OO(cache_dir, tmp_path):
    """`-OO` strips docstrings: the tools built their --help from __doc__.splitlines()."""
    from tests.unit.test_ckpt_manager import make_state

    with CheckpointManager(tmp_path / "ck", async_save=False) as mgr:
        mgr.save(make_state(2))
    for tool in (("ftrain.ckpt", "list", str(tmp_path / "ck")), ("ftrain.plot", "--help")):
        done = _ftrain(cache_dir, *tool, flags=("-OO",))
        assert done.returncode == 0, (tool, done.stderr)
