"""Chaos fault injector, active only in processes started with ``FTRAIN_CHAOS_ARM`` set.

The chaos drills put this directory on ``PYTHONPATH`` of the real CLI (``python -m ftrain``,
also under ``torchrun``), so Python imports it at start-up as ``sitecustomize``. Without
``FTRAIN_CHAOS_ARM`` it does nothing (and imports nothing heavy). With it, once
``ftrain.ckpt.commit`` (and ``ftrain.ckpt.index``) is imported, this module uses the protocol's ``fault_hook`` seam and
wraps ``begin`` / ``delete_step`` so that the process SIGKILLs *itself* at an exact point
of the commit protocol or of a retention delete:

- ``begun``: staging directory and lock created, nothing written;
- ``data_written`` / ``manifest_written`` / ``marker_written`` / ``renamed``: the
  protocol's own phases (``renamed`` = committed, the lock not yet released);
- ``delete_renamed``: a retention delete renamed the step to ``*.del-*``, nothing removed;
- ``delete_partial``: a retention delete removed part of the ``*.del-*`` tree;
- ``index_written``: the index's temporary file (``.checkpoints.json.<hex>``) is written
  and fsync'd, not yet renamed over ``checkpoints.json`` (``ftrain.ckpt.index``);
- ``part_written``: one rank's part of a sharded save is written, not yet durable nor
  reported to the coordinator (``ftrain.ckpt.sharded``; fires on any rank);
- ``restore_read``: a restore is about to read a step's chunk files
  (``ftrain.ckpt.reader.read_jobs``).

The arm file is JSON ``{"id", "phase", "count", "rank"}`` and optionally ``"action"``: the
``count``-th occurrence of ``phase`` (counted from when this process first saw that
``id``) on ``rank`` fires. The first process to rename the arm file to ``*.fired`` fires
(one shot across torchrun restarts), after appending ``{"pid", "rank", "phase", "step",
"time"}`` to the ``FTRAIN_CHAOS_LOG`` file. Firing is a SIGKILL of the process, or with
``"action": "enospc"`` an ``OSError(ENOSPC)`` raised at that point (a full disk, without
one: the process lives on and must handle it), or with ``"action": "eio"`` an
``OSError(EIO)`` (a failing disk or a file system this rank sees differently).
"""

import errno
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

_ARM = os.environ.get("FTRAIN_CHAOS_ARM")
_seen = {"id": None, "n": 0}


_ERRORS = {"enospc": (errno.ENOSPC, "No space left on device"), "eio": (errno.EIO, "I/O error")}


def _fire_if_armed(phase, step):
    try:
        with open(_ARM, encoding="utf-8") as f:
            arm = json.load(f)
    except (OSError, ValueError):
        return
    if arm.get("rank", 0) != int(os.environ.get("RANK", "0")):
        return
    if arm.get("id") != _seen["id"]:
        _seen["id"], _seen["n"] = arm.get("id"), 0
    if arm.get("phase") != phase:
        return
    _seen["n"] += 1
    if _seen["n"] < int(arm.get("count", 1)):
        return
    try:
        os.rename(_ARM, _ARM + ".fired")  # one shot: only the first process claims it
    except OSError:
        return
    log = os.environ.get("FTRAIN_CHAOS_LOG")
    if log:
        rank = int(os.environ.get("RANK", "0"))
        line = {"pid": os.getpid(), "rank": rank, "phase": phase, "step": step}
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({**line, "time": time.time()}) + "\n")
            f.flush()
            os.fsync(f.fileno())
    action = _ERRORS.get(arm.get("action"))
    if action is not None:
        raise OSError(action[0], f"{action[1]} (injected at {phase})")
    os.kill(os.getpid(), 9)


class _RmtreeSpy:
    """Stands in for ``shutil`` inside the protocol module: inside ``delete_step`` the
    ``*.del-*`` rename has happened when ``rmtree`` is called, so fire there."""

    def __init__(self, real, state):
        self._real, self._state = real, state

    def __getattr__(self, name):
        return getattr(self._real, name)

    def rmtree(self, path, *args, **kwargs):
        if self._state.get("deleting") is not None:
            step = self._state["deleting"]
            _fire_if_armed("delete_renamed", step)
            subdirs = sorted(p.path for p in os.scandir(path) if p.is_dir(follow_symlinks=False))
            if subdirs:
                self._real.rmtree(subdirs[0], ignore_errors=True)
            _fire_if_armed("delete_partial", step)
        return self._real.rmtree(path, *args, **kwargs)


class _ReplaceSpy:
    """Stands in for ``os`` inside the index module: fire just before the index's
    temporary file is renamed over ``checkpoints.json``."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def replace(self, src, dst, *args, **kwargs):
        if os.path.basename(str(dst)) == "checkpoints.json":
            _fire_if_armed("index_written", os.path.basename(str(src)))
        return self._real.replace(src, dst, *args, **kwargs)


def _install_reader(mod):
    read_jobs = mod.read_jobs

    def chaos_read_jobs(root, *args, **kwargs):
        _fire_if_armed("restore_read", os.path.basename(str(root)))
        return read_jobs(root, *args, **kwargs)

    mod.read_jobs = chaos_read_jobs


def _install_index(mod):
    if hasattr(mod, "os"):
        mod.os = _ReplaceSpy(mod.os)


def _install_commit(mod):
    state = {"step": None, "deleting": None}
    begin, delete_step = mod.begin, mod.delete_step

    def hook(phase):
        _fire_if_armed(phase, state["step"])

    def chaos_begin(root, step, *args, **kwargs):
        staging = begin(root, step, *args, **kwargs)
        state["step"] = step
        _fire_if_armed("begun", step)
        return staging

    def chaos_delete_step(step_dir, *args, **kwargs):
        state["deleting"] = os.path.basename(str(step_dir))
        try:
            return delete_step(step_dir, *args, **kwargs)
        finally:
            state["deleting"] = None

    mod.fault_hook = hook
    mod.begin = chaos_begin
    mod.delete_step = chaos_delete_step
    if hasattr(mod, "shutil"):
        mod.shutil = _RmtreeSpy(mod.shutil, state)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        install = _TARGETS.get(name)
        if install is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_install(module):
            exec_module(module)
            install(module)

        spec.loader.exec_module = exec_and_install
        return spec


_TARGETS = {
    "ftrain.ckpt.commit": _install_commit,
    "ftrain.ckpt.index": _install_index,
    "ftrain.ckpt.reader": _install_reader,
}

if _ARM:
    sys.meta_path.insert(0, _Finder())
