"""Helpers for running the real CLI (``python -m ftrain``) in subprocesses."""

import json
import os
import select
import signal
import subprocess
import sys
import sysconfig
import time
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


class ForkServer:
    """The client of ``forkserver.py``: ``run(args)`` is ``python -m ftrain ARGS`` in a child
    forked from one process that imported torch and ftrain once (see that module)."""

    def __init__(self, scratch: Path) -> None:
        self.scratch, self.jobs, self.buf = scratch, 0, b""
        script = str(Path(__file__).with_name("forkserver.py"))
        boot = f"import runpy; runpy.run_path({script!r}, run_name='__main__')"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", boot], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )

    def run(
        self, args: list[str], env: dict, timeout: float, *, cwd=None, module: str = "ftrain"
    ) -> subprocess.CompletedProcess:
        """``python -m MODULE ARGS`` (in ``cwd``, with exactly ``env``), as ``subprocess.run``
        with ``capture_output=True, text=True`` would return it."""
        self.jobs += 1
        out, err = (self.scratch / f"{self.jobs}.{name}" for name in ("out", "err"))
        job = {"args": args, "env": env, "stdout": str(out), "stderr": str(err), "module": module}
        if cwd is not None:
            job["cwd"] = str(cwd)
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()
        pid = json.loads(self._line(120))["pid"]
        try:
            status = json.loads(self._line(timeout))["status"]
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            self._line(60)
            raise
        cmd = [sys.executable, "-m", module, *args]
        code = os.waitstatus_to_exitcode(status)
        return subprocess.CompletedProcess(cmd, code, out.read_text(), err.read_text())

    def _line(self, timeout: float) -> str:
        """The server's next line (its own buffer: a buffered reader could hold the second
        line while select waits on the pipe)."""
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise subprocess.TimeoutExpired(["ftrain (fork server)"], timeout)
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"the CLI fork server died (exit {self.proc.wait()})")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


@pytest.fixture(scope="session")
def forkserver(tmp_path_factory):
    server = ForkServer(tmp_path_factory.mktemp("forkserver"))
    yield server
    server.close()


@pytest.fixture
def cli(cache_dir, forkserver):
    """Run ``python -m ftrain`` with the tiny config plus overrides; return CompletedProcess.
    The run is a child of the fork server (the imports are paid once per session)."""

    def run(run_dir, *overrides, check=None, timeout=240):
        env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
        proc = forkserver.run([f"run.dir={run_dir}", *TINY, *overrides], env, timeout)
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
