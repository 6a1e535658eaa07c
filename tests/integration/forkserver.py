"""A fork server for the CLI tests: ``python -m ftrain`` without paying its imports per run.

Why. A CLI run of the tiny config trains for a second or two, but starting
``python -m ftrain`` imports torch, tensordict (which imports ``torch._dynamo``), Hydra and
ftrain first: ~5 s of one core per run, most of the suite's time. This server imports
them once; each job is a ``fork()`` that then runs the real entry point
(``runpy.run_module("ftrain", run_name="__main__")``) with the job's argv, environment,
working directory and stdout/stderr files, and exits like an interpreter does (atexit
handlers, non-daemon threads joined: an async save still finishes). The child is a
real process: signals, exit codes, files, locks and torchrun checks behave as in a
fresh ``python -m ftrain``. Tests that send signals or run under torchrun still start a
fresh interpreter (``popen_cli``, the torchrun tests).

Protocol (one job at a time): a JSON line on stdin
``{"args", "env", "cwd", "stdout", "stderr", "module"}`` (``module``: the ``-m`` module run,
``ftrain`` unless given, e.g. ``ftrain.ckpt``); the server answers ``{"pid": N}`` when the
child starts and ``{"status": S}`` (``os.waitpid``'s) when it ends.
"""

import importlib
import json
import os
import random
import runpy
import sys
import traceback

import hydra  # noqa: F401 - imported once here so that no child pays for it
import numpy
import tensordict  # noqa: F401
import torch  # noqa: F401

import ftrain  # noqa: F401
import ftrain.cli.app  # noqa: F401


def _child(job: dict) -> None:
    """Become ``python -m MODULE ARGS`` in the job's environment; never returns."""
    os.environ.clear()
    os.environ.update(job["env"])
    extra = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = extra  # what the interpreter would have put after the script's dir
    if any(os.path.isfile(os.path.join(p, "sitecustomize.py")) for p in extra):
        sys.modules.pop("sitecustomize", None)  # site.py imports it at start-up: so here
        importlib.import_module("sitecustomize")
    if job.get("cwd"):
        os.chdir(job["cwd"])
    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    devnull = os.open(os.devnull, os.O_RDONLY)  # the server's job pipe is not the CLI's stdin
    os.dup2(devnull, 0)
    os.close(devnull)
    random.seed()  # a fresh interpreter seeds these from the OS; a fork would share them
    numpy.random.seed()
    module = job.get("module", "ftrain")
    sys.argv = [module, *job["args"]]
    code: object = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - what an interpreter prints for an uncaught error
        traceback.print_exc()
        code = 1
    sys.exit(code)  # a normal interpreter exit: atexit, thread joins, flushed streams


def main() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(job)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": status}), flush=True)


if __name__ == "__main__":
    main()
