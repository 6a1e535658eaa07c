"""Nothing committed is lost, nothing crafted is trusted (issue 9, checkpoint side).

Redone steps replace corrupt or superseded ones (the old moved aside, never deleted);
root metadata is checksummed; every manifest field is validated before it is acted on;
keys cannot leave the step directory and links are never followed; retention keeps the
newest finite step; host RNG states come back per rank on request.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import warnings
from pathlib import Path

import crc32c
import pytest
import torch

from ftrain.ckpt import BestN, CheckpointManager, CheckpointNotFoundError, LatestN, hostrng
from ftrain.ckpt.format import CheckpointFormatError, CorruptCheckpointError

from .test_ckpt_commit import as_format
from .test_ckpt_manager import make_state, same


def rewrite_manifest(step_dir: Path, edit) -> None:
    """Edit a step's manifest and re-seal the marker, as a consistent forgery would."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    edit(manifest)
    raw = json.dumps(manifest).encode()
    (step_dir / "manifest.json").write_bytes(raw)
    marker = json.loads((step_dir / "COMMITTED").read_text())
    marker |= {"manifest_crc32c": crc32c.crc32c(raw), "manifest_bytes": len(raw)}
    (step_dir / "COMMITTED").write_text(json.dumps(marker))


def saved(tmp_path, *steps, **kw) -> CheckpointManager:
    mgr = CheckpointManager(tmp_path, async_save=False, **kw)
    for s in steps:
        mgr.save(make_state(s), metrics={"loss": float(s)})
    return mgr


def restore_falls_back(tmp_path, want: int) -> None:
    with pytest.warns(RuntimeWarning, match="corrupt"):
        got = CheckpointManager(tmp_path, async_save=False).restore()
    assert int(got["step"]) == want and same(got, make_state(want))


def flip_first_chunk(step_dir: Path) -> None:
    chunk = next(p for p in sorted(step_dir.rglob("c.0*")) if p.stat().st_size > 64)
    raw = bytearray(chunk.read_bytes())
    raw[10] ^= 0xFF
    chunk.write_bytes(bytes(raw))


# ---- 1. a redone step is committed again ------------------------------------------------
@pytest.mark.parametrize("async_save", [False, True])
def test_a_redone_step_replaces_the_corrupt_one(tmp_path, async_save):
    saved(tmp_path, 57, 60)
    flip_first_chunk(tmp_path / "step_00000060")
    mgr = CheckpointManager(tmp_path, async_save=async_save)
    with pytest.warns(RuntimeWarning, match="corrupt"):
        assert int(mgr.restore()["step"]) == 57
    for s in (58, 59, 60):  # redo
        assert mgr.save(make_state(s), force=True)
    mgr.close()
    again = CheckpointManager(tmp_path, async_save=False)
    assert again.all_steps() == [57, 58, 59, 60]
    assert same(again.restore(60), make_state(60))  # verifies: the new step 60
    # the corrupt step 60 left the listing when the redo's first step (58) committed; kept
    (aside,) = again.set_aside_steps()[60]
    assert aside.name.startswith("step_00000060.superseded-")


def test_a_resume_from_an_earlier_step_supersedes_the_old_history(tmp_path):
    saved(tmp_path, 20, 30, 40)
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.restore(20)
    branch = make_state(30)
    branch["params", "w"] += 1.0  # another history
    assert mgr.save(branch, force=True)
    assert mgr.all_steps() == [20, 30] and mgr.latest_step() == 30
    assert same(mgr.restore(30), branch)
    aside = mgr.set_aside_steps()
    assert [p.name.split(".")[1].split("-")[0] for p in aside[30]] == ["replaced"]
    assert [p.name.split(".")[1].split("-")[0] for p in aside[40]] == ["superseded"]
    assert same(
        CheckpointManager(aside[40][0].parent, async_save=False).restore(20), make_state(20)
    )


def test_the_restored_step_itself_is_not_saved_again(tmp_path):
    saved(tmp_path, 5)
    mgr = CheckpointManager(tmp_path, async_save=False)
    state = mgr.restore()
    assert mgr.save(state, force=True) is False  # e.g. the final save of a finished run
    assert mgr.set_aside_steps() == {}


def test_a_newer_format_step_stops_the_manager_and_nothing_is_deleted(tmp_path):
    saved(tmp_path, 1, 2)
    as_format(tmp_path / "step_00000002", 7, writer="3.0")
    with pytest.raises(CheckpointFormatError, match=r"ftrain 3\.0 \(format 7\); this is ftrain"):
        CheckpointManager(tmp_path, async_save=False)
    assert (tmp_path / "step_00000002" / "manifest.json").exists()


# ---- 4. metadata is checksummed -----------------------------------------------------------
def test_an_edited_root_attribute_is_corruption(tmp_path):
    saved(tmp_path, 1, 2)
    doc_path = tmp_path / "step_00000002" / "zarr.json"
    doc = json.loads(doc_path.read_text())
    doc["attributes"]["schedule_horizon"] = 123456
    doc_path.write_text(json.dumps(doc, indent=1, sort_keys=True))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        CheckpointManager(tmp_path, async_save=False).metadata(2)
    restore_falls_back(tmp_path, 1)


def test_an_edited_array_document_is_found_by_verify_and_not_trusted_by_restore(tmp_path, capsys):
    saved(tmp_path, 1, 2)
    doc_path = tmp_path / "step_00000002" / "params" / "w" / "zarr.json"
    doc = json.loads(doc_path.read_text())
    doc["attributes"]["ftrain"]["dtype"] = "float64"
    doc_path.write_text(json.dumps(doc))
    rc, out = ckpt_cli(capsys, "verify", tmp_path)
    assert rc == 1 and "BAD  step 2" in out and "checksum" in out
    # restore takes shapes, dtypes and checksums from the sealed manifest alone
    assert same(CheckpointManager(tmp_path, async_save=False).restore(), make_state(2))


# ---- 5. every field validated before use -------------------------------------------------
CRAFTED = {
    "zero chunk rows": lambda m: m["arrays"]["params/w"].update(chunk_shape=[0, 8]),
    "group not a string": lambda m: m["groups"].append(7),
    "huge consistent shape": lambda m: m["arrays"]["params/w"].update(
        shape=[10**12, 64], chunk_shape=[10**12, 64]
    ),
    "negative dimension": lambda m: m["arrays"]["params/w"].update(shape=[-64, 8]),
    "float in shape": lambda m: m["arrays"]["params/w"].update(shape=[64.0, 8]),
    "crc list short": lambda m: m["arrays"]["params/w"].update(crc32c=[]),
    "unknown dtype": lambda m: m["arrays"]["params/w"].update(dtype="Tensor"),
    # two values a byte: the same 2 KiB as 64 x 64 quint4x2 overran a 1 KiB buffer
    "packed dtype": lambda m: m["arrays"]["params/w"].update(
        dtype="quint4x2", shape=[64, 64], chunk_shape=[64, 64]
    ),
    "quantized dtype": lambda m: m["arrays"]["params/w"].update(
        dtype="qint8", shape=[64, 32], chunk_shape=[64, 32]
    ),
    "torch attribute, not a dtype": lambda m: m["arrays"]["params/w"].update(dtype="has_cudnn"),
    "sub-byte dtype": lambda m: m["arrays"]["params/w"].update(
        dtype="uint4", shape=[64, 32], chunk_shape=[64, 32]
    ),
    "unknown codec": lambda m: m["arrays"]["params/w"].update(
        compression="lzma", stored_nbytes=[1]
    ),
    "entry not an object": lambda m: m["arrays"].update({"params/w": [1, 2]}),
    "arrays a list": lambda m: m.update(arrays=[]),
    "documents malformed": lambda m: m.update(documents={"zarr.json": "x"}),
    "root doc unlisted": lambda m: m["documents"].pop("zarr.json"),
    "dot-dot key": lambda m: m["arrays"].update({"../../etc/w": m["arrays"].pop("params/w")}),
    "absolute key": lambda m: m["arrays"].update({"/etc/w": m["arrays"].pop("params/w")}),
    "empty component": lambda m: m["arrays"].update({"params//w": m["arrays"].pop("params/w")}),
    "odd characters": lambda m: m["arrays"].update({"params/w\x00": m["arrays"].pop("params/w")}),
}


@pytest.mark.parametrize("how", sorted(CRAFTED))
def test_a_crafted_manifest_is_reported_and_restore_falls_back(tmp_path, how):
    saved(tmp_path, 1, 2)
    rewrite_manifest(tmp_path / "step_00000002", CRAFTED[how])
    restore_falls_back(tmp_path, 1)


def test_a_step_whose_root_attributes_have_wrong_types_falls_back(tmp_path):
    saved(tmp_path, 1, 2)
    step = tmp_path / "step_00000002"
    doc = json.loads((step / "zarr.json").read_text())
    doc["attributes"]["metrics"] = ["not", "a", "dict"]
    raw = json.dumps(doc).encode()
    (step / "zarr.json").write_bytes(raw)
    rewrite_manifest(
        step, lambda m: m["documents"].update({"zarr.json": [crc32c.crc32c(raw), len(raw)]})
    )
    restore_falls_back(tmp_path, 1)


def _zero_torch_state(states: dict) -> None:
    states["torch_cpu"] = base64.b64encode(
        bytes(len(base64.b64decode(states["torch_cpu"])))
    ).decode()


GARBAGE_HOST_RNG = {
    "python state short": lambda s: s["python"].update(state=[1, 2, 3]),
    # the right shapes, refused only by the generators themselves: these half-applied
    # the states and then raised out of restore (no fallback)
    "python version 99": lambda s: s["python"].update(version=99),
    "numpy has_gauss past C long": lambda s: s["numpy"].update(has_gauss=2**70),
    "numpy cached_gaussian past float": lambda s: s["numpy"].update(cached_gaussian=10**400),
    "torch state all zero": _zero_torch_state,
    # set after the others on a GPU host, which it then refused: half-applied, no fallback
    "cuda state of the wrong length": lambda s: s.update(
        cuda=[base64.b64encode(b"x" * 8).decode()]
    ),
}


@pytest.mark.parametrize("how", sorted(GARBAGE_HOST_RNG))
def test_garbage_host_rng_is_corruption_when_asked_for(tmp_path, how):
    mgr = CheckpointManager(tmp_path, async_save=False)
    random.seed(42)
    mgr.save(make_state(1), force=True)  # records the state right after seed(42)
    want = random.random()
    mgr.save(make_state(2), force=True)
    step = tmp_path / "step_00000002"
    doc = json.loads((step / "zarr.json").read_text())
    GARBAGE_HOST_RNG[how](doc["attributes"]["host_rng"]["0"])
    raw = json.dumps(doc).encode()
    (step / "zarr.json").write_bytes(raw)
    rewrite_manifest(
        step, lambda m: m["documents"].update({"zarr.json": [crc32c.crc32c(raw), len(raw)]})
    )
    random.seed(0)
    with pytest.warns(RuntimeWarning, match="host RNG state"):
        got = CheckpointManager(tmp_path, async_save=False).restore(host_rng=True)
    assert int(got["step"]) == 1
    assert random.random() == want  # step 1's states were applied, not the garbage


# ---- 6. path safety ----------------------------------------------------------------------
def test_a_symlinked_chunk_is_corruption_and_never_followed(tmp_path):
    ck = tmp_path / "ck"
    saved(ck, 1, 2)
    secret = tmp_path / "outside.bin"
    chunk = next((ck / "step_00000002" / "params" / "w").glob("c*"))
    secret.write_bytes(chunk.read_bytes())
    chunk.unlink()
    chunk.symlink_to(secret)
    restore_falls_back(ck, 1)
    mgr = CheckpointManager(ck, async_save=False, keep_policy=LatestN(1))
    mgr.save(make_state(3))  # retention deletes steps 1 and 2: the link target survives
    assert secret.exists()


def test_a_symlinked_step_directory_is_not_a_checkpoint(tmp_path):
    real = tmp_path / "elsewhere"
    saved(real, 4)
    ck = tmp_path / "ck"
    saved(ck, 1)
    os.symlink(real / "step_00000004", ck / "step_00000004")
    mgr = CheckpointManager(ck, async_save=False)
    assert mgr.all_steps() == [1]
    assert "symbolic" in next(iter(mgr.invalid_steps().values()))


def test_the_writer_refuses_keys_that_are_not_plain_names(tmp_path):
    mgr = CheckpointManager(tmp_path, async_save=False)
    for bad in ("..", "a b", ".hidden", "w\n"):
        state = make_state(1)
        state["params", bad] = torch.zeros(2)
        with pytest.raises(ValueError, match="not a valid node name"):
            mgr.save(state, force=True)


# ---- retention and divergence ------------------------------------------------------------
def test_retention_keeps_the_newest_step_with_finite_metrics(tmp_path):
    mgr = CheckpointManager(tmp_path, async_save=False, keep_policy=LatestN(2))
    mgr.save(make_state(1), metrics={"loss": 2.0})
    for s in (2, 3, 4):
        mgr.save(make_state(s), metrics={"loss": float("nan")})
    assert mgr.all_steps() == [1, 3, 4]
    mgr.save(make_state(5), metrics={"loss": 1.5})
    assert mgr.all_steps() == [4, 5]


# ---- host RNG per rank -------------------------------------------------------------------
def test_host_rng_is_recorded_per_rank_and_restored_on_request(tmp_path):
    states = {}
    for r in (0, 1):
        torch.manual_seed(100 + r)
        random.seed(100 + r)
        states[r] = hostrng.capture()
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(make_state(1), host_rng=states, force=True)
    for r in (0, 1):
        torch.manual_seed(100 + r)
        random.seed(100 + r)
        want = (torch.rand(3), random.random())
        torch.manual_seed(0)
        random.seed(0)
        CheckpointManager(tmp_path, async_save=False, rank=r).restore(host_rng=True)
        assert torch.equal(torch.rand(3), want[0]) and random.random() == want[1]
    with pytest.warns(RuntimeWarning, match="no host RNG states for rank 5"):
        CheckpointManager(tmp_path, async_save=False, rank=5).restore(host_rng=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CheckpointManager(tmp_path, async_save=False, rank=5).restore()  # not asked: silent


def test_restore_without_any_verifying_step_names_every_problem(tmp_path):
    saved(tmp_path, 1)
    rewrite_manifest(tmp_path / "step_00000001", CRAFTED["zero chunk rows"])
    with (
        pytest.warns(RuntimeWarning),
        pytest.raises(CheckpointNotFoundError, match="chunk_shape holds 0"),
    ):
        CheckpointManager(tmp_path, async_save=False).restore()


# ---- python -m ftrain.ckpt: report, never crash ------------------------------------------
def ckpt_cli(capsys, *args):
    from ftrain.ckpt.__main__ import main

    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:  # argparse-style exits carry a message, not a traceback
        rc = e.code if isinstance(e.code, int) else 1
        print(e.code)
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_ckpt_tools_on_a_directory_they_may_not_read_say_it_in_one_line(
    tmp_path, capsys, monkeypatch
):
    """Another user's run directory (mode 700 on a shared cluster): every tool stopped with
    a traceback from pathlib (PermissionError). As root the bits do not stop a read, so the
    denial is made where the tools look first."""
    import pathlib

    from ftrain.cli.evaluate import main as eval_main

    real = pathlib.Path.is_dir

    def denied(self):
        if self.name == "checkpoints":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    (tmp_path / "checkpoints").mkdir()
    monkeypatch.setattr(pathlib.Path, "is_dir", denied)
    for cmd in ("list", "verify", "show"):
        rc, out = ckpt_cli(capsys, cmd, tmp_path)
        assert rc == 2 and "Permission denied" in out and "Traceback" not in out, out
    rc, out = ckpt_cli(capsys, "export", tmp_path, tmp_path.parent / "x.safetensors")
    assert rc == 2 and "Permission denied" in out
    assert eval_main([str(tmp_path)]) == 2
    assert "python -m ftrain.eval: [Errno 13] Permission denied" in capsys.readouterr().err


def test_ckpt_tool_on_a_missing_or_empty_directory_exits_non_zero(tmp_path, capsys):
    """A file or a dangling link given for the directory was "no such checkpoint
    directory" too, though it plainly exists: said what it is."""
    from ftrain.cli.evaluate import main as eval_main

    (tmp_path / "a.safetensors").write_bytes(b"{}")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    for cmd in ("list", "verify", "show"):
        rc, out = ckpt_cli(capsys, cmd, tmp_path / "nope")
        assert rc == 1 and "no such checkpoint directory" in out
        rc, out = ckpt_cli(capsys, cmd, tmp_path)
        assert rc == 1 and "no committed checkpoints" in out
        rc, out = ckpt_cli(capsys, cmd, tmp_path / "a.safetensors")
        assert rc == 1 and "a.safetensors is a file, not a checkpoint directory" in out, out
        rc, out = ckpt_cli(capsys, cmd, tmp_path / "gone")
        assert rc == 1 and "gone is a dangling link or a special file" in out, out
    assert eval_main([str(tmp_path / "a.safetensors")]) == 1
    assert "a.safetensors is a file, not a checkpoint directory" in capsys.readouterr().err


def test_ckpt_tool_refuses_steps_a_command_would_drop(tmp_path, capsys):
    """``show DIR 4 2`` showed step 4 and dropped the 2; ``list DIR 4`` listed every step."""
    saved(tmp_path, 1, 2)
    for args, said in [
        (("show", tmp_path, 1, 2), "show takes one step, got [1, 2]"),
        (("list", tmp_path, 1), "list takes no step"),
        (("advise", tmp_path, 1), "advise takes a run directory only"),
        (("advise", "s3://b/run"), "advise reads a run's local records (run.dir)"),
        (("list", tmp_path, "--mtbf", "5h"), "--mtbf is advise's"),
        (("export", tmp_path, ""), "OUT='' is empty"),
    ]:
        rc, out = ckpt_cli(capsys, *args)
        assert rc == 2 and said in out, out
    rc, out = ckpt_cli(capsys, "show", tmp_path, 2)
    assert rc == 0 and "step_00000002" in out
    for cmd in ("show", "list", "verify"):  # a step's own directory: what to pass instead
        rc, out = ckpt_cli(capsys, cmd, tmp_path / "step_00000002")
        assert (
            rc == 1 and f"one step, not a checkpoint location; pass its parent, {tmp_path}" in out
        )


def test_ckpt_tool_reports_marker_less_and_crafted_steps(tmp_path, capsys):
    saved(tmp_path, 1, 2, 3)
    (tmp_path / "step_00000002" / "COMMITTED").unlink()
    rewrite_manifest(tmp_path / "step_00000003", CRAFTED["zero chunk rows"])
    rc, out = ckpt_cli(capsys, "verify", tmp_path)
    assert rc == 1 and "ok   step 1" in out and "BAD  step 3" in out
    assert "BAD  step_00000002" in out
    assert ckpt_cli(capsys, "verify", tmp_path, 2)[0] == 1
    rc, out = ckpt_cli(capsys, "list", tmp_path)
    assert rc == 1 and "not committed" in out
    rc, out = ckpt_cli(capsys, "show", tmp_path, 3)
    assert rc == 1 and "CORRUPT" in out
    rc, out = ckpt_cli(capsys, "diff", tmp_path, 1, 3)
    assert rc == 2 and "CORRUPT" in out


def test_ckpt_tool_lists_set_aside_steps_and_refuses_newer_formats(tmp_path, capsys):
    saved(tmp_path, 1, 2)
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.restore(1)
    mgr.save(make_state(2), force=True)
    rc, out = ckpt_cli(capsys, "list", tmp_path)
    assert rc == 0 and "set aside" in out and "step_00000002.replaced-" in out
    as_format(tmp_path / "step_00000001", 9)
    rc, out = ckpt_cli(capsys, "list", tmp_path)
    assert rc == 2 and "(format 9)" in out


@pytest.mark.parametrize(
    "document", ["COMMITTED", "manifest.json", "zarr.json", "../checkpoints.json"]
)
def test_a_fifo_in_place_of_a_document_is_corruption_not_a_hang(tmp_path, document):
    """Chunk reads never blocked on a planted FIFO; metadata reads did: the manager's
    listing (so every restart) and `ckpt verify` hung forever."""
    import threading

    from ftrain.ckpt.__main__ import main as ckpt_main

    saved(tmp_path, 1, 2)
    target = tmp_path / "step_00000002" / document
    target.unlink(missing_ok=True)
    os.mkfifo(target)
    out = {}

    def look():
        m = CheckpointManager(tmp_path, async_save=False)
        out["steps"] = m.all_steps()
        out["verify"] = ckpt_main(["verify", str(tmp_path)])
        out["restored"] = int(m.restore()["step"])

    worker = threading.Thread(target=look, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "hung on the FIFO"
    if document == "../checkpoints.json":  # the index is a cache: rebuilt, nothing lost
        assert out == {"steps": [1, 2], "verify": 0, "restored": 2}
        return
    assert out["verify"] == 1 and out["restored"] in (1, 2)
    assert out["steps"] == ([1] if document != "zarr.json" else [1, 2])


def test_verify_of_a_live_run_does_not_call_retentions_deletes_corruption(
    tmp_path, monkeypatch, capsys
):
    """`ckpt verify` lists, then reads each step: a step the live run's retention deleted
    in between was reported BAD (exit 1: a false corruption alarm for a monitoring job)."""
    import shutil

    from ftrain.ckpt import __main__ as cli

    saved(tmp_path, 1, 2, 3)
    real = cli.verify_tree

    def retention_first(path, manifest):
        if path.name == "step_00000001":
            shutil.rmtree(path)  # the run's retention, between the listing and the read
        return real(path, manifest)

    monkeypatch.setattr(cli, "verify_tree", retention_first)
    assert cli.main(["verify", str(tmp_path)]) == 0
    assert "gone step 1: deleted while verifying" in capsys.readouterr().out
    flip_first_chunk(tmp_path / "step_00000002")  # real damage is still BAD
    assert cli.main(["verify", str(tmp_path)]) == 1
    assert "BAD  step 2:" in capsys.readouterr().out


def test_a_step_deleted_between_the_scan_and_its_marker_read_left_the_listing(
    tmp_path, monkeypatch, capsys
):
    """The listing scans the directory, then reads each marker: a step the live run's
    retention deleted in between was `not committed: ... unreadable metadata`, and `list`
    exited 1 (seen about once in 1,000 lists of a keep_last=1 run)."""
    from ftrain.ckpt import __main__ as cli
    from ftrain.ckpt import commit

    saved(tmp_path, 1, 2, 3).close()
    real = commit.read_committed

    def retention_first(step_dir):
        if step_dir.name == "step_00000001" and step_dir.exists():
            commit.delete_step(step_dir)  # between the scan and the marker read
        return real(step_dir)

    monkeypatch.setattr(commit, "read_committed", retention_first)
    assert cli.main(["list", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "not committed" not in err and "CORRUPT" not in out
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["2", "3"]


def test_another_process_restore_lists_again_when_a_live_run_deletes_its_step(tmp_path):
    """A reader's restore() listed 2, 4, 6; the run committed 8 and its retention deleted
    2, 4 and 6 while 6 was read. It warned three times that healthy steps were corrupt and
    raised CheckpointNotFoundError with step 8 on disk."""
    from ftrain.ckpt.commit import delete_step

    run = saved(tmp_path, 2, 4, 6)
    reader = CheckpointManager(tmp_path, async_save=False)
    real, seen = reader._read, []

    def live_run_meanwhile(path, *args):
        seen.append(path.name)
        if len(seen) == 1:
            run.save(make_state(8))
            for s in (2, 4, 6):
                delete_step(tmp_path / f"step_{s:08d}")
        return real(path, *args)

    reader._read = live_run_meanwhile
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "is corrupt" warning
        assert int(reader.restore()["step"]) == 8
    assert seen == ["step_00000006", "step_00000008"]
    run.close()


def test_a_named_step_deleted_while_a_reader_restores_it_says_so(tmp_path):
    from ftrain.ckpt.commit import delete_step

    run = saved(tmp_path, 2, 4)
    reader = CheckpointManager(tmp_path, async_save=False)
    real = reader._read

    def retention_meanwhile(path, *args):
        delete_step(path)
        return real(path, *args)

    reader._read = retention_meanwhile
    with pytest.raises(CheckpointNotFoundError, match="deleted or set aside while it was read"):
        reader.restore(2)
    run.close()


def test_verify_lists_again_when_every_step_it_listed_went_away(tmp_path, monkeypatch, capsys):
    """`verify` of a keep_last=1 run printed only `gone step N` and exited 0: ok for a
    monitoring job, with nothing checked. It now verifies what the run committed since, and
    having verified nothing says so with exit 1."""
    from ftrain.ckpt import __main__ as cli
    from ftrain.ckpt.commit import delete_step

    run = saved(tmp_path, 1)
    real, newer = cli.verify_tree, iter([2, None])

    def live_run_meanwhile(path, manifest):
        if path.name == "step_00000001":
            nxt = next(newer)
            if nxt is not None:
                run.save(make_state(nxt))
            delete_step(path)
        return real(path, manifest)

    monkeypatch.setattr(cli, "verify_tree", live_run_meanwhile)
    assert cli.main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "gone step 1: deleted while verifying" in out and "ok   step 2:" in out
    run.close()

    def every_step_deleted(path, manifest):
        delete_step(path)
        return real(path, manifest)

    monkeypatch.setattr(cli, "verify_tree", every_step_deleted)
    assert cli.main(["verify", str(tmp_path)]) == 1
    assert "verified no step" in capsys.readouterr().out
    saved(tmp_path, 7).close()
    assert cli.main(["verify", str(tmp_path), "7"]) == 1  # the step named went away: not ok
    assert "gone step 7" in capsys.readouterr().out


def test_verify_says_a_step_a_resume_set_aside_was_set_aside(tmp_path, monkeypatch, capsys):
    from ftrain.ckpt import __main__ as cli

    saved(tmp_path, 1, 2).close()
    real = cli.verify_tree

    def go_back_meanwhile(path, manifest):
        if path.name == "step_00000002":
            os.rename(path, path.with_name("step_00000002.superseded-abcd1234"))
        return real(path, manifest)

    monkeypatch.setattr(cli, "verify_tree", go_back_meanwhile)
    assert cli.main(["verify", str(tmp_path)]) == 0
    assert "gone step 2: set aside while verifying" in capsys.readouterr().out


# ---- damaged advisory files: JSON nested past the recursion limit, numbers past float --
DEEP = b"[" * 200_000  # RecursionError is no ValueError: it went past every handler


def test_a_deeply_nested_index_is_rebuilt(tmp_path):
    saved(tmp_path, 1, 2).close()
    (tmp_path / "checkpoints.json").write_bytes(DEEP)
    assert int(CheckpointManager(tmp_path, async_save=False).restore()["step"]) == 2


def test_a_newer_format_marker_sealing_a_deeply_nested_manifest_is_a_format_error(tmp_path, capsys):
    # the marker names format 99; the manifest it seals is read to tell a damaged marker
    # from a newer writer, and its RecursionError stopped list, show, verify and restore
    saved(tmp_path, 1).close()
    step = tmp_path / "step_00000002"
    step.mkdir()
    (step / "manifest.json").write_bytes(DEEP)
    marker = {"format_version": 99, "manifest_crc32c": crc32c.crc32c(DEEP)}
    (step / "COMMITTED").write_text(json.dumps(marker | {"manifest_bytes": len(DEEP)}))
    with pytest.raises(CheckpointFormatError, match="format 99"):
        CheckpointManager(tmp_path, async_save=False).restore()
    rc, out = ckpt_cli(capsys, "list", tmp_path)
    assert rc == 2 and "format 99" in out and "Recursion" not in out


def test_a_huge_integer_metric_or_time_in_the_index_does_not_stop_a_best_n_start(tmp_path):
    saved(tmp_path, 1, 2).close()
    idx = json.loads((tmp_path / "checkpoints.json").read_text())
    idx["entries"][0]["metrics"]["loss"] = 10**400
    idx["entries"][1]["time"] = 10**400
    (tmp_path / "checkpoints.json").write_text(json.dumps(idx))
    mgr = CheckpointManager(tmp_path, async_save=False, keep_policy=BestN("loss", 1))
    mgr.save(make_state(3), metrics={"loss": 0.5})
    assert 3 in mgr.all_steps()


@pytest.mark.parametrize("value", [[1], "x", 1e400, -5])
def test_ckpt_list_shows_a_marker_byte_count_that_is_not_one_as_unknown(tmp_path, capsys, value):
    saved(tmp_path, 1).close()
    marker = tmp_path / "step_00000001" / "COMMITTED"
    doc = json.loads(marker.read_text())
    doc["bytes"] = value  # under no checksum: a figure for people
    marker.write_text(json.dumps(doc))
    rc, out = ckpt_cli(capsys, "list", tmp_path)
    assert rc == 0 and re.search(r"^\s+1\s+\?\s+\{\"loss\": 1.0\}$", out, re.M), out
    (tmp_path / "checkpoints.json").unlink()  # rebuilt from the markers (1e400 overflowed)
    mgr = CheckpointManager(tmp_path, async_save=False)
    assert mgr.index()[0]["bytes"] is None and int(mgr.restore()["step"]) == 1


def test_an_index_entry_with_a_step_past_int_is_rebuilt(tmp_path):
    saved(tmp_path, 1, 2).close()
    raw = (tmp_path / "checkpoints.json").read_text().replace('"step": 1', '"step": 1e400', 1)
    (tmp_path / "checkpoints.json").write_text(raw)
    mgr = CheckpointManager(tmp_path, async_save=False, keep_policy=BestN("loss", 1))
    assert [e["step"] for e in mgr.index()] == [1, 2]


def test_deeply_nested_owner_metrics_and_heartbeat_records_are_unreadable_not_fatal(tmp_path):
    from ftrain.ckpt.owner import claim
    from ftrain.cli.redo import _heartbeat
    from ftrain.metrics.jsonl import parse_line as _parse

    loc = tmp_path / "ckpt"
    loc.mkdir()
    (loc / ".owner.json").write_bytes(DEEP)
    assert claim(loc, tmp_path / "run").taken_from is None  # taken over, with a warning
    assert _parse(DEEP) is None
    (tmp_path / "heartbeat.json").write_bytes(DEEP)
    assert _heartbeat(tmp_path / "heartbeat.json") is None


@pytest.mark.parametrize("name", ["step_000000002", "step_0000000\u0662"])
def test_a_step_name_step_dirname_would_not_write_is_no_step(tmp_path, name):
    # a second spelling of step 2 counted as step 2: listings showed one of the two, and
    # setting the listed one aside brought the other back
    import shutil

    from ftrain.ckpt import commit as protocol

    saved(tmp_path, 1, 2).close()
    shutil.copytree(tmp_path / "step_00000002", tmp_path / name)
    seen = []
    steps = protocol.committed_steps(tmp_path, on_valid=lambda p, m: seen.append(p.name))
    assert steps == {1: tmp_path / "step_00000001", 2: tmp_path / "step_00000002"}
    assert sorted(seen) == ["step_00000001", "step_00000002"]
    aside = f"{name}.replaced-ab"
    (tmp_path / name).rename(tmp_path / aside)
    assert CheckpointManager(tmp_path, async_save=False).set_aside_steps() == {}


def test_a_file_or_a_steps_own_directory_is_refused_as_a_location(tmp_path):
    """A file (or a path under one) passed as the location was accepted and the first save
    failed in the background with ``File exists``; a committed step's own directory got
    ``step_N/`` and an index written inside it."""
    from ftrain.ckpt.location import CheckpointLocationError

    (tmp_path / "afile").write_text("mine")
    saved(tmp_path / "ck", 3)
    for where, said in [
        ({"directory": tmp_path / "afile"}, "directory: .*afile is a file"),
        ({"directory": tmp_path / "afile" / "sub"}, "sub lies under .*afile, which is a file"),
        (
            {"directory": tmp_path / "ok", "fallback_directory": str(tmp_path / "afile")},
            "fallback_directory: .*afile is a file",
        ),
        (
            {"directory": tmp_path / "ck" / "step_00000003"},
            "the directory of one step, not a checkpoint location; pass its parent",
        ),
    ]:
        with pytest.raises(CheckpointLocationError, match=said):
            CheckpointManager(**where, async_save=False)
    assert (tmp_path / "afile").read_text() == "mine"
    inside = [p.name for p in (tmp_path / "ck" / "step_00000003").iterdir()]
    assert not [n for n in inside if n.startswith(("step_", "checkpoints", "."))], inside


def test_a_restore_that_finds_nothing_says_why_the_step_or_directory_does_not_count(tmp_path):
    run = tmp_path / "run"
    saved(run / "checkpoints", 1, 3)
    with pytest.raises(CheckpointNotFoundError, match="a run directory: its checkpoints are in"):
        CheckpointManager(run, async_save=False).restore()
    (run / "checkpoints" / "step_00000003" / "COMMITTED").write_text("")
    with pytest.raises(CheckpointNotFoundError, match=r"for step 3 .*COMMITTED: unreadable"):
        CheckpointManager(run / "checkpoints", async_save=False).restore(3)


def test_metadata_is_checked_at_save_not_in_the_background_writer(tmp_path):
    """``metadata={1: 1, "a": 2}`` passed save() and failed at the next wait() as a
    TypeError naming no key; a list as metrics was an AttributeError."""
    mgr = CheckpointManager(tmp_path, async_save=True)
    with pytest.raises(ValueError, match=r"metadata\['cfg'\] mixes string keys with \[1\]"):
        mgr.save(make_state(1), metadata={"cfg": {1: 1, "a": 2}})
    with pytest.raises(TypeError, match="metrics must be a dict, got list"):
        mgr.save(make_state(1), metrics=[1])
    with pytest.raises(TypeError, match="metadata must be a dict, got list"):
        mgr.save(make_state(1), metadata=[1])
    assert mgr.save(make_state(2), metadata={"tags": {1: "a", 2: "b"}})  # one kind: as JSON
    mgr.wait()
    assert mgr.metadata(2)["tags"] == {"1": "a", "2": "b"} and mgr.all_steps() == [2]


def test_restore_and_metadata_arguments_of_the_wrong_kind_are_named(tmp_path):
    """``only=5`` was "'int' object is not iterable"; a tuple key path a TypeError about
    tuple concatenation; ``target={...}`` spoke of ftrain.optim; ``metadata(None)`` said
    "step None is not committed"."""
    mgr = saved(tmp_path, 1)
    with pytest.raises(TypeError, match=r"restore\(only=5\): a key path is a string"):
        mgr.restore(only=5)
    by_tuple = mgr.restore(only=[("params",)])  # a TensorDict-style key path
    assert same(by_tuple["params"], mgr.restore(only="params")["params"])
    with pytest.raises(TypeError, match="takes a TensorDict template .*got dict"):
        mgr.restore(target={"step": torch.tensor(1)})
    with pytest.raises(TypeError, match=r"metadata\(step\): name the step"):
        mgr.metadata(None)
    with pytest.raises(TypeError, match=r"metadata\(step='1'\): a step is an int$"):
        mgr.metadata("1")


def test_a_corrupt_copy_says_what_the_restore_tries_next(tmp_path):
    """restore(2) of a corrupt step 2 said "trying an older one" and then tried none."""
    saved(tmp_path, 1, 2)
    flip_first_chunk(tmp_path / "step_00000002")
    with (
        pytest.warns(RuntimeWarning, match=r"is corrupt .*; no other copy to try$"),
        pytest.raises(CheckpointNotFoundError, match="no checkpoint verifies"),
    ):
        CheckpointManager(tmp_path, async_save=False).restore(2)
    with pytest.warns(RuntimeWarning, match=r"is corrupt .*; trying an older one$"):
        got = CheckpointManager(tmp_path, async_save=False).restore()
    assert int(got["step"]) == 1


def test_show_and_verify_take_dir_colon_step_like_export_eval_and_diff(tmp_path, capsys):
    """``ckpt show RUN:STEP`` was "looks like a URL but is not one" though export, eval,
    diff and init.from take that spelling; a conflicting step and ``list DIR:STEP`` are
    usage errors."""
    with CheckpointManager(tmp_path / "checkpoints", async_save=False) as m:
        for step in (2, 4):
            m.save(make_state(step), force=True)
    rc, out = ckpt_cli(capsys, "show", f"{tmp_path}:2")
    assert rc == 0 and "step_00000002" in out and "step_00000004" not in out, out
    rc, out = ckpt_cli(capsys, "verify", f"{tmp_path}:4")
    assert rc == 0 and "step 4" in out and "step 2" not in out, out
    rc, out = ckpt_cli(capsys, "show", f"{tmp_path}:2", "4")
    assert rc == 2 and "names step 2 but the steps given are [4]" in out, out
    rc, out = ckpt_cli(capsys, "list", f"{tmp_path}:2")
    assert rc == 2 and "list takes no step" in out, out
    rc, out = ckpt_cli(capsys, "show", f"{tmp_path}:7")
    assert rc == 1 and "step 7 is not committed" in out and "available: [2, 4]" in out, out


def test_a_directory_whose_first_name_holds_a_colon_is_read_when_it_exists(
    tmp_path, capsys, monkeypatch
):
    """``col:on/r`` (a directory that exists) was "looks like a URL", and the advised
    ``./col:on/r`` lost its ``./`` in pathlib and was refused again. A name of that shape
    that does not exist is still refused (``s3:/b`` would be a local directory)."""
    from ftrain.ckpt.location import CheckpointLocationError, parse_location

    monkeypatch.chdir(tmp_path)
    with CheckpointManager(Path("col:on") / "r" / "checkpoints", async_save=False) as m:
        m.save(make_state(2), force=True)
    for spelling in ("col:on/r", "./col:on/r", "col:on/r:2"):
        rc, out = ckpt_cli(capsys, "show", spelling)
        assert rc == 0 and "step_00000002" in out, (spelling, out)
    with pytest.raises(CheckpointLocationError, match="looks like a URL but is not one"):
        parse_location("col:on/nothere")
    (tmp_path / "s3:bucket").mkdir()  # a leftover of an older typo: still refused
    with pytest.raises(CheckpointLocationError, match="looks like a URL but is not one"):
        parse_location("s3:bucket")
