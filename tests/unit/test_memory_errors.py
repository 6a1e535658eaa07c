"""Memory running out is one line from every ftrain command, not a 25-110 line traceback
read as a crash of ftrain's own (torch's CPU allocator raises a plain RuntimeError)."""

from __future__ import annotations

import errno
import re
import subprocess
import sys

import torch
from tensordict import TensorDict

from ftrain._memory import out_of_memory
from ftrain.ckpt import CheckpointManager

ALLOCATOR = (
    "[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 268435456 bytes. Error code 12 (Cannot allocate memory)"
)


def test_what_counts_as_memory_running_out():
    assert out_of_memory(RuntimeError(ALLOCATOR)).startswith("out of memory: RuntimeError: [")
    assert out_of_memory(RuntimeError("can't start new thread")).startswith("out of threads")
    assert out_of_memory(MemoryError())
    assert out_of_memory(OSError(errno.ENOMEM, "Cannot allocate memory"))
    try:
        try:
            raise RuntimeError("std::bad_alloc")
        except RuntimeError as inner:
            raise ValueError("a save failed") from inner
    except ValueError as outer:
        assert "std::bad_alloc" in out_of_memory(outer)
    for other in (RuntimeError("shape mismatch"), OSError(errno.ENOSPC, "full"), ValueError()):
        assert out_of_memory(other) is None


def test_the_training_command_says_it_in_one_line(monkeypatch, capsys):
    from ftrain.cli import run

    def fails(argv):
        raise RuntimeError(ALLOCATOR)

    monkeypatch.setattr(run, "_main", fails)
    assert run.main([]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ftrain: out of memory")
    assert "newest committed checkpoint is intact" in err and "trainer.batch_size" in err


_UNDER_A_LIMIT = """
import resource, sys
from ftrain.ckpt.__main__ import main
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (16 << 20), resource.RLIM_INFINITY))
sys.exit(main(sys.argv[1:]))
"""


def test_the_checkpoint_tool_under_an_address_space_limit_says_it_in_one_line(tmp_path):
    """``export`` of a step whose 64 MiB leaf cannot be allocated (16 MiB of address space
    left): a traceback ending in DefaultCPUAllocator or "can't start new thread", exit 1."""
    state = TensorDict({"step": torch.tensor(1), "params": {"w": torch.ones(4096, 4096)}}, [])
    with CheckpointManager(tmp_path / "ck", async_save=False) as m:
        m.save(state)
    out = tmp_path / "model.safetensors"
    cmd = [sys.executable, "-c", _UNDER_A_LIMIT, "export", str(tmp_path / "ck"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    said = proc.stderr
    assert re.match(r"python -m ftrain.ckpt: out of (memory|threads)", said), said[-2000:]
    assert "Traceback" not in proc.stderr and "Nothing was changed" in proc.stderr
    assert not out.exists()
    assert CheckpointManager(tmp_path / "ck").all_steps() == [1]


def test_eval_says_it_in_one_line(monkeypatch, capsys):
    """``python -m ftrain.eval`` out of memory (restoring the params, a batch): one line,
    exit 1, not a traceback."""
    from ftrain.cli import evaluate

    def fails(*args, **kwargs):
        raise RuntimeError(ALLOCATOR)

    monkeypatch.setattr(evaluate, "evaluate_run", fails)
    assert evaluate.main(["runs/x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m ftrain.eval: out of memory")
    assert "Nothing was changed" in err
