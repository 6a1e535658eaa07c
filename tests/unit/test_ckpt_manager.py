"""CheckpointManager: save/restore, policies, async errors, fallback, index, target checks."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from ftrain.ckpt import (
    AnyOf,
    BestN,
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointSaveError,
    EveryNSteps,
    LatestN,
    hostrng,
    manager,
    store,
)
from ftrain.ckpt.format import FORMAT_VERSION


def make_state(step: int, n: int = 64) -> TensorDict:
    g = torch.Generator().manual_seed(step)
    return TensorDict(
        {
            "step": torch.tensor(step),
            "params": {
                "w": torch.randn(n, 8, generator=g),
                "b": torch.randn(8, generator=g).bfloat16(),
            },
            "buffers": {},
            "opt": {"mu": {"w": torch.randn(n, 8, generator=g)}, "count": torch.tensor(step)},
            "amp": {"scale": torch.tensor(2.0**16, dtype=torch.float16)},
            "data": {"position": torch.tensor(step * 32)},
            "rng": torch.tensor([step, 7], dtype=torch.int64),
        },
        [],
    )


def same(a: TensorDict, b: TensorDict) -> bool:
    fa, fb = a.flatten_keys("/"), b.flatten_keys("/")
    return set(fa.keys()) == set(fb.keys()) and all(
        fa[k].dtype == fb[k].dtype
        and torch.equal(fa[k].view(-1).view(torch.uint8), fb[k].view(-1).view(torch.uint8))
        for k in fa.keys()
    )


@pytest.mark.parametrize("async_save", [False, True])
def test_save_restore_roundtrip_and_metadata(tmp_path, async_save):
    with CheckpointManager(tmp_path, async_save=async_save, chunk_bytes=256) as m:
        assert m.latest_step() is None
        assert m.save(
            make_state(10),
            metrics={"loss": torch.tensor(1.5), "bad": float("nan")},
            metadata={"config_hash": "abc"},
        )
        assert m.save(make_state(20))
        assert not m.save(make_state(20))  # already saved
        m.wait()
        assert m.all_steps() == [10, 20] and m.latest_step() == 20
        assert same(m.restore(), make_state(20)) and same(m.restore(10), make_state(10))
        assert m.arrays(10)["params/w"] == ((64, 8), "float32")
        assert m.arrays(10)["params/b"] == ((8,), "bfloat16")
        with pytest.raises(CheckpointNotFoundError):
            m.arrays(11)
        meta = m.metadata(10)
    assert (
        meta["config_hash"] == "abc"
        and meta["step"] == 10
        and meta["metrics"] == {"loss": 1.5, "bad": "nan"}
    )
    assert (
        meta["format_version"] == FORMAT_VERSION
        and "torch" in meta["versions"]
        and "0" in meta["host_rng"]
    )
    assert (
        meta["save"]["bytes"] > 0
        and meta["save"]["blocking_seconds"] <= meta["save"]["write_seconds"]
    )
    with pytest.raises(RuntimeError, match="closed"):
        m.save(make_state(30))


def test_save_policy_and_force(tmp_path):
    m = CheckpointManager(tmp_path, save_policy=EveryNSteps(10), async_save=False)
    assert [m.save(make_state(s)) for s in (5, 10, 15)] == [False, True, False]
    assert m.save(make_state(17), force=True)
    assert m.all_steps() == [10, 17]


def test_retention_keeps_latest_and_best(tmp_path):
    keep = AnyOf(LatestN(2), BestN("val", 1, mode="min"))
    with CheckpointManager(tmp_path, keep_policy=keep, async_save=True) as m:
        for s, val in [(1, 5.0), (2, 0.5), (3, 4.0), (4, 3.0), (5, 2.0)]:
            m.save(make_state(s), metrics={"val": val})
    assert m.all_steps() == [2, 4, 5]
    idx = json.loads((tmp_path / "checkpoints.json").read_text())
    assert [e["step"] for e in idx["entries"]] == [2, 4, 5]
    assert idx["entries"][0]["best"] == {"val": True} and idx["entries"][2]["best"] == {}
    assert all(e["save_seconds"] > 0 and e["bytes"] > 0 for e in idx["entries"])
    (tmp_path / "checkpoints.json").unlink()  # a rebuilt index lost every "best" flag
    rebuilt = CheckpointManager(tmp_path, keep_policy=keep).index()
    assert [e["best"] for e in rebuilt] == [{"val": True}, {}, {}]


def test_index_is_rebuilt_when_missing_or_stale(tmp_path):
    with CheckpointManager(tmp_path) as m:
        m.save(make_state(1), metrics={"loss": 2.0})
        m.save(make_state(2))
    (tmp_path / "checkpoints.json").write_text("garbage")
    assert [e["step"] for e in CheckpointManager(tmp_path).index()] == [1, 2]
    (tmp_path / "checkpoints.json").unlink()
    entries = CheckpointManager(tmp_path).index()
    assert entries[0]["metrics"] == {"loss": 2.0} and entries[1]["save_seconds"] > 0
    # a hand-edited entry retention cannot rank (no time, metrics not an object): re-read
    # from its step, not a failure of every later save
    with CheckpointManager(tmp_path) as m:
        m.save(make_state(2), force=True)  # writes the index again
    idx = json.loads((tmp_path / "checkpoints.json").read_text())
    del idx["entries"][0]["time"]
    idx["entries"][1]["metrics"] = "oops"
    (tmp_path / "checkpoints.json").write_text(json.dumps(idx))
    with CheckpointManager(tmp_path, keep_policy=AnyOf(LatestN(2), BestN("loss", 1))) as m:
        assert m.save(make_state(3), metrics={"loss": 1.0})
    entries = CheckpointManager(tmp_path).index()  # LatestN(2) let step 1 go
    assert [(e["step"], e["metrics"]) for e in entries] == [(2, {}), (3, {"loss": 1.0})]


def test_a_target_mismatch_lists_ten_differences_and_counts_the_rest(tmp_path):
    """A resume whose config changes the state's layout (fp32 -> fp16 adds a loss scale
    under opt, moving every moment) printed all ~400 differences; now ten and a count,
    with every one kept on the error."""
    from ftrain.ckpt.target import TargetMismatchError

    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(make_state(3))
    wide = make_state(0)
    for i in range(14):
        wide[f"extra{i:02d}"] = torch.zeros(1)
    with pytest.raises(TargetMismatchError) as e:
        m.restore(target=wide)
    assert len(e.value.differences) == 14 and "(14 differences)" in str(e.value)
    assert "extra09" in str(e.value) and "extra10" not in str(e.value)
    assert str(e.value).endswith("and 4 more")


def test_a_target_rooted_at_the_only_subtree_is_said_first(tmp_path):
    """restore(only="params", target=state["params"]) listed every key as "not in
    target" without saying the template is rooted one level too low."""
    from ftrain.ckpt.target import TargetMismatchError

    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(make_state(3))
    with pytest.raises(TargetMismatchError) as e:
        m.restore(only="params", target=make_state(0)["params"])
    assert e.value.differences[0].startswith("the target is rooted at 'params', not at the state")
    assert same(m.restore(only="params", target=make_state(0))["params"], make_state(3)["params"])
    with pytest.raises(TargetMismatchError) as e:  # a plain mismatch: no such line
        m.restore(only="params", target=make_state(0)["opt"])
    assert not any("rooted" in d for d in e.value.differences)


def test_restore_only_and_target_validation(tmp_path):
    with CheckpointManager(tmp_path) as m:
        m.save(make_state(3))
    part = m.restore(only=("params",))
    assert set(part.keys()) == {"params"} and same(part["params"], make_state(3)["params"])
    assert set(m.restore(only="opt/mu").keys()) == {"opt"}
    with pytest.raises(ValueError, match="top-level keys"):
        m.restore(only="nope")
    target = make_state(0)
    assert same(m.restore(target=target), make_state(3))
    bad = make_state(0, n=5)
    bad["params", "b"] = torch.zeros(8)
    bad["extra"] = torch.zeros(1)
    del bad["rng"]
    with pytest.raises(ValueError) as e:
        m.restore(target=bad)
    msg = str(e.value)
    for needle in [
        "missing in checkpoint: extra",
        "not in target: rng",
        "shape of params/w",
        "dtype of params/b",
        "shape of opt/mu/w",
    ]:
        assert needle in msg
    assert same(
        m.restore(target=make_state(0), only=("params",))["params"], make_state(3)["params"]
    )
    with pytest.raises(CheckpointNotFoundError, match="step 99"):
        m.restore(99)
    for wrong in ("3", True, 3.0):  # "3" was "no step 3; available: [.., 3]", True step 1
        with pytest.raises(TypeError, match=r"restore\(step=.*\): a step is an int"):
            m.restore(wrong)
    assert same(m.restore(torch.tensor(3))["params"], make_state(3)["params"])  # an int tensor


def test_async_error_surfaces_on_next_call_and_wait(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    m = CheckpointManager(tmp_path)
    monkeypatch.setattr(manager, "write_tree", boom)
    assert m.save(make_state(1))
    with pytest.raises(CheckpointSaveError, match="disk on fire"):
        m.wait()
    m.wait()  # reported once
    assert m.save(make_state(2))
    with pytest.raises(CheckpointSaveError, match="disk on fire"):
        m.save(make_state(3))
    monkeypatch.undo()
    assert m.save(make_state(4))
    m.close()
    assert m.all_steps() == [4] and not list(tmp_path.glob("*.tmp-*"))


def test_second_save_waits_for_the_first(tmp_path, monkeypatch):
    gate, order = threading.Event(), []
    real = manager.write_tree

    def slow(tmp, state, *a, **k):
        order.append(("start", int(state["step"])))
        if int(state["step"]) == 1:
            assert gate.wait(10)
        out = real(tmp, state, *a, **k)
        order.append(("end", int(state["step"])))
        return out

    monkeypatch.setattr(manager, "write_tree", slow)
    m = CheckpointManager(tmp_path)
    m.save(make_state(1))
    second = threading.Thread(target=m.save, args=(make_state(2),))
    second.start()
    second.join(0.3)
    assert second.is_alive(), "the second save must block while the first is in flight"
    gate.set()
    second.join(10)
    m.close()
    assert order == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]


@pytest.mark.parametrize("how", ["enospc", "not_a_directory"])
def test_fallback_directory(tmp_path, monkeypatch, how):
    primary, fallback = tmp_path / "primary", tmp_path / "fallback"
    if how == "enospc":
        real = store.write_chunk

        def full(path, *a, **k):
            if str(primary) in str(path):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real(path, *a, **k)

        monkeypatch.setattr(store, "write_chunk", full)
    else:
        primary = tmp_path / "file" / "ckpt"  # mkdir fails with ENOTDIR even as root
    m = CheckpointManager(primary, fallback_directory=fallback, async_save=False)
    if how == "not_a_directory":  # after the start (which refuses a file as a location)
        (tmp_path / "file").write_text("x")
    with pytest.warns(RuntimeWarning, match="fallback"):
        assert m.save(make_state(5))
    assert (fallback / "step_00000005" / "COMMITTED").exists()
    assert not list(tmp_path.rglob("*.tmp-*"))
    monkeypatch.undo()
    assert m.all_steps() == [5] and same(m.restore(), make_state(5))


def test_save_fails_everywhere_raises(tmp_path):
    m = CheckpointManager(tmp_path / "file" / "a", async_save=False)
    (tmp_path / "file").write_text("x")  # after the start, which refuses a file as a location
    with pytest.raises(CheckpointSaveError, match="every location"):
        m.save(make_state(1))


def test_bad_inputs_fail_in_the_caller(tmp_path):
    for rank in ("0", -1, 0.5, True):  # accepted, and keyed the host RNG states by it
        with pytest.raises(ValueError, match=f"rank must be a whole number >= 0 .*rank={rank!r}"):
            CheckpointManager(tmp_path / "r", rank=rank)
    m = CheckpointManager(tmp_path)
    with pytest.raises(TypeError, match=r"needs a TensorDict, got dict: wrap it"):
        m.save({"step": torch.tensor(1), "w": torch.zeros(1)})
    with pytest.raises(ValueError, match="'step'"):
        m.save(TensorDict({"x": torch.zeros(1)}, []))
    with pytest.raises(ValueError, match="reserved"):
        m.save(make_state(1), metadata={"step": 3})
    with pytest.raises(ValueError, match=r"metadata\['obj'\] must be JSON-serialisable"):
        m.save(make_state(1), metadata={"obj": object()})
    with pytest.raises(ValueError, match=r"metadata\['w'\] must be JSON-serialisable"):
        m.save(make_state(1), metadata={"cfg": {"a": 1}, "w": torch.zeros(2)})
    with pytest.raises(ValueError, match="metrics must be JSON-serialisable"):
        m.save(make_state(1), metrics={"loss": [float("nan")]})
    for key in ("save", "path"):  # metadata(step) adds its own under them: never read back
        with pytest.raises(ValueError, match=f"metadata keys \\['{key}'\\] are taken by metadata"):
            m.save(make_state(1), metadata={key: 1})
    with pytest.raises(ValueError, match="not a valid node name"):
        m.save(TensorDict({"step": torch.tensor(1), "a/b": torch.zeros(1)}, []))
    # a name past the file system's 255 bytes: ENAMETOOLONG from the background writer,
    # or a "failing disk" moved on to the fallback
    with pytest.raises(ValueError, match="300 bytes long.*at most 255 bytes"):
        m.save(TensorDict({"step": torch.tensor(1), "k" * 300: torch.zeros(1)}, []))
    # 17 nested keys of 251 bytes: each a valid name, the chunk's path past PATH_MAX (the
    # writer failed at wait() naming a 4 KB path, and went to the fallback)
    deep = TensorDict({"step": torch.tensor(1)}, [])
    deep[tuple(f"{i:02d}" + "k" * 249 for i in range(17))] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"needs a path of about \d+ bytes.*at most 4095"):
        m.save(deep)
    # 33 dimensions: committed, then every reader refused the step as corrupt
    with pytest.raises(ValueError, match="'x' has 33 dimensions.*at most 32"):
        m.save(TensorDict({"step": torch.tensor(1), "x": torch.ones((1,) * 33)}, []))
    m.close()
    assert m.all_steps() == []


def test_cli_output_to_a_reader_that_stops_early_is_not_a_traceback(tmp_path):
    """``python -m ftrain.ckpt diff DIR 1 2 | head -1``: the reader goes away after a line;
    the rest is dropped quietly (exit 1), not a BrokenPipeError traceback."""
    leaves = {f"w{i:04d}": torch.zeros(1) for i in range(1500)}  # ~100 KB: past a pipe buffer
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(TensorDict({"step": torch.tensor(1), "params": leaves}, []))
        m.save(
            TensorDict(
                {"step": torch.tensor(2), "params": {k: v + 1 for k, v in leaves.items()}}, []
            )
        )
    cmd = [sys.executable, "-m", "ftrain.ckpt", "diff", str(tmp_path), "1", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"~ ")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1 and "Traceback" not in err, err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
@pytest.mark.parametrize("command", ["list", "show", "verify"])
def test_cli_output_to_a_full_disk_is_one_line_not_a_traceback(tmp_path, command):
    """``python -m ftrain.ckpt list DIR > /dev/full``: a 15-line ``OSError`` traceback."""
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(TensorDict({"step": torch.tensor(1), "w": torch.zeros(3)}, []))
    cmd = [sys.executable, "-m", "ftrain.ckpt", command, str(tmp_path)]
    with open("/dev/full", "w") as full:
        proc = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr == "ftrain.ckpt: cannot write the output: No space left on device\n"


def test_a_tools_own_os_error_is_not_taken_for_its_output_going_away(capsys):
    """Only writes to stdout are "cannot write the output"; an ``OSError`` of the tool's
    own work still reaches its handlers (and the caller) as itself."""
    from ftrain._stdio import run_tool

    def reads_a_file():
        print("a first line")
        raise PermissionError(13, "Permission denied", "chunk")

    with pytest.raises(PermissionError):
        run_tool(reads_a_file, "tool")
    assert "cannot write" not in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_tools_own_status_outlives_output_that_cannot_be_written(monkeypatch, capsys):
    """An interrupted drill's 130 (its message to a gone terminal suppressed) became 1 once
    the output failed at the last flush."""
    from ftrain._stdio import run_tool

    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)

        def interrupted():
            with contextlib.suppress(OSError):  # as the drill does
                print("drill interrupted (SIGHUP)", flush=True)
            print("a line that fails only at the last flush")
            return 130

        assert run_tool(interrupted, "tool") == 130
    with open("/dev/full", "w") as full:  # the one before now writes to /dev/null
        monkeypatch.setattr(sys, "stdout", full)
        assert run_tool(lambda: print("x") or 0, "tool") == 1
    assert capsys.readouterr().err.count("tool: cannot write the output: No space left") == 2


def test_hostrng_capture_restore_json_roundtrip():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    states = json.loads(json.dumps(hostrng.capture()))
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    hostrng.restore(states)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want
    with pytest.raises(ValueError, match="host RNG"):
        hostrng.restore({"torch_cpu": "!!"})


def test_cli_diff_of_a_step_with_a_damaged_root_document_says_corrupt(tmp_path, capsys):
    """diff read the arrays without the root zarr.json check restore, list and show make:
    it compared a step they all call corrupt and exited 1 ("they differ")."""
    from ftrain.ckpt.__main__ import main

    with CheckpointManager(tmp_path) as m:
        m.save(make_state(1))
        m.save(make_state(2))
    (tmp_path / "step_00000002" / "zarr.json").write_text("{}")
    assert main(["diff", str(tmp_path), "1", "2"]) == 2
    out = capsys.readouterr().out
    assert "cannot diff: CORRUPT" in out and "zarr.json" in out


def test_cli_diff_says_how_far_integer_bool_and_float_arrays_differ(tmp_path, capsys):
    """Integer and bool arrays said "max abs diff -"; int64 extremes must not wrap."""
    from ftrain.ckpt.__main__ import main

    def state(step, flags, big, w):
        return TensorDict(
            step=torch.tensor(step),
            flags=torch.tensor(flags),
            big=torch.tensor(big, dtype=torch.int64),
            w=torch.tensor(w),
        )

    lo, hi = -(2**63), 2**63 - 1
    with CheckpointManager(tmp_path) as m:
        m.save(state(1, [True, False, True], [hi, 0], [0.0, 1.0]))
        m.save(state(4, [True, True, True], [lo, 0], [-0.0, 1.25]))
    assert main(["diff", str(tmp_path), "1", "4"]) == 1
    out = capsys.readouterr().out
    assert "~ step: values differ (1 of 1 elements, max abs diff 3)" in out
    assert "~ flags: values differ (1 of 3 elements)" in out
    assert f"~ big: values differ (1 of 2 elements, max abs diff {2**64 - 1})" in out
    assert "~ w: values differ (2 of 2 elements, max abs diff 0.25)" in out  # -0.0 counts


def test_cli_list_show_verify_diff(tmp_path, capsys):
    from ftrain.ckpt.__main__ import main

    with CheckpointManager(tmp_path) as m:
        m.save(make_state(1), metrics={"loss": 1.0})
        m.save(make_state(2))

    def cli(cmd, *steps):
        rc = main([cmd, str(tmp_path), *map(str, steps)])
        return rc, capsys.readouterr().out

    rc, out = cli("list")
    assert rc == 0 and '"loss": 1.0' in out
    assert "params/w" in cli("show", 1)[1]
    assert cli("verify")[0] == 0
    rc, out = cli("diff", 1, 2)
    assert rc == 1 and "params/w" in out
    with pytest.raises(SystemExit) as usage:  # one step: a usage error, not "they differ"
        cli("diff", 2)
    assert usage.value.code == 2
    run = tmp_path.parent / f"{tmp_path.name}-run"  # a run directory: its checkpoints/
    run.mkdir()
    (run / "checkpoints").symlink_to(tmp_path, target_is_directory=True)
    assert main(["list", str(run)]) == 0 and '"loss": 1.0' in capsys.readouterr().out
    chunk = tmp_path / "step_00000002" / "params" / "w" / "c.0.0"
    data = bytearray(chunk.read_bytes())
    data[3] ^= 0x10
    chunk.write_bytes(bytes(data))
    rc, out = cli("verify")
    assert rc == 1 and "BAD  step 2" in out and "crc32c mismatch" in out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert same(CheckpointManager(tmp_path).restore(), make_state(1))
    out = subprocess.run(
        [sys.executable, "-m", "ftrain.ckpt", "list", str(tmp_path)], capture_output=True, text=True
    )
    assert out.returncode == 0 and "step" in out.stdout


def test_an_async_save_that_cannot_start_its_thread_is_written_in_the_caller(
    tmp_path, monkeypatch, caplog
):
    """A thread limit or an address-space limit (``can't start new thread``): the save was
    lost as a raw RuntimeError, and the unstarted thread kept making every later wait() and
    close() raise ``cannot join thread before it is started``."""
    real_start = threading.Thread.start

    def start(thread):
        if thread.name.startswith("ftrain-ckpt"):
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    m = CheckpointManager(tmp_path, async_save=True)
    with caplog.at_level("WARNING"):
        assert m.save(make_state(1), force=True)
    assert "cannot start the background save of step 1" in caplog.text
    m.wait()
    assert m.all_steps() == [1]
    assert torch.equal(m.restore(1)["params", "w"], make_state(1)["params", "w"])
    assert m.save(make_state(2), force=True)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(m, "_write", interrupted)
    with pytest.raises(KeyboardInterrupt):  # the caller's Ctrl-C, not a stored error
        m.save(make_state(3), force=True)
    m.close()
    monkeypatch.undo()
    assert CheckpointManager(tmp_path).all_steps() == [1, 2]
