"""Export and the read-only readers: buffers exported, no half or overwriting export, the
umask's mode, I/O errors as one message, a live run's retention during a read."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn

import ftrain
from ftrain.ckpt import commit as protocol
from ftrain.ckpt import readonly
from ftrain.ckpt.export import ExportError, export_params

safetensors = pytest.importorskip("safetensors.torch")


def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def _saved(tmp_path, step=4):
    model = _bn_model()
    model.train()
    model(torch.randn(16, 4))  # running statistics away from 0/1
    state = ftrain.init_state(model, ftrain.optim.sgd(0.1), seed=0)
    state = ftrain.replace(state, step=torch.tensor(step))
    m = ftrain.CheckpointManager(tmp_path / "ck", async_save=False)
    m.save(state, force=True)
    return model, tmp_path / "ck"


def test_export_writes_the_buffers_so_a_strict_load_gives_the_same_model(tmp_path):
    """BatchNorm's running statistics were left out: a strict load failed, a loose one
    computed with fresh statistics, silently."""
    model, ck = _saved(tmp_path)
    done = export_params(ck, tmp_path / "m.safetensors")
    assert done["tensors"] == len(model.state_dict())
    fresh = _bn_model()
    safetensors.load_model(fresh, str(tmp_path / "m.safetensors"), strict=True)
    fresh.eval(), model.eval()
    x = torch.randn(8, 4)
    assert torch.equal(fresh(x), model(x))


def _own_state(tmp_path, params: dict):
    from tensordict import TensorDict

    state = TensorDict({"step": torch.tensor(3), "params": params}, [])
    with ftrain.CheckpointManager(tmp_path / "ck", async_save=False) as m:
        m.save(state)
    return tmp_path / "ck"


def test_two_params_with_one_dotted_name_are_refused_not_one_dropped(tmp_path):
    """``a``/``b.c`` and ``a.b``/``c`` both export as ``a.b.c``: the file held one of
    them, exit 0, "exported step 3: 1 tensors"."""
    ck = _own_state(tmp_path, {"a": {"b.c": torch.ones(2)}, "a.b": {"c": torch.zeros(3)}})
    with pytest.raises(ExportError, match=r"'a/b\.c' and 'a\.b/c' both export as 'a\.b\.c'"):
        export_params(ck, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


def test_an_output_name_of_250_bytes_is_written(tmp_path):
    """Its hidden staging directory's name passed NAME_MAX: refused, File name too long."""
    ck = _own_state(tmp_path, {"w": torch.ones(2)})
    out = tmp_path / ("m" * 238 + ".safetensors")
    assert export_params(ck, out)["tensors"] == 1 and out.is_file()


def test_a_dtype_safetensors_cannot_hold_is_named_not_a_keyerror(tmp_path):
    ck = _own_state(tmp_path, {"w": torch.ones(2), "z": torch.ones(2, dtype=torch.complex128)})
    with pytest.raises(ExportError, match=r"tensor 'z' is torch.complex128"):
        export_params(ck, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


def test_a_safetensors_export_to_a_directory_path_is_refused_not_written_as_a_file(tmp_path):
    """``export RUN out/`` wrote a file named ``out`` and reported ``-> out/``."""
    _, ck = _saved(tmp_path)
    with pytest.raises(ExportError, match="names a directory.*model.safetensors.*--format hf"):
        export_params(ck, f"{tmp_path}/out/")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
def test_an_export_into_the_checkpoint_directory_is_refused(tmp_path, fmt):
    """An export into a committed step made it fail verify, and the next retention deleted
    the step with the export in it (or set it aside as unreadable)."""
    _, ck = _saved(tmp_path)
    before = sorted(p.name for p in ck.rglob("*"))
    for out in (ck / "step_00000004" / "x.safetensors", ck / "model", ck):
        with pytest.raises(ExportError, match="is inside the checkpoint directory"):
            export_params(ck, out, format=fmt)
    assert sorted(p.name for p in ck.rglob("*")) == before
    assert export_params(ck, tmp_path / "beside.safetensors")["tensors"] > 0  # beside: fine


def test_export_files_get_the_umask_mode_and_never_replace_one_made_meanwhile(
    tmp_path, monkeypatch
):
    _, ck = _saved(tmp_path)
    old = os.umask(0o027)
    try:
        seen = []  # the umask another thread would see meanwhile: never changed to read it
        monkeypatch.setattr(os, "umask", lambda m, real=os.umask: seen.append(m) or real(m))
        export_params(ck, tmp_path / "a.safetensors")
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert (tmp_path / "a.safetensors").stat().st_mode & 0o777 == 0o640  # not 0600
    assert seen == []
    out = tmp_path / "b.safetensors"
    real = safetensors.save_file

    def racing(tensors, path, metadata=None):  # another export lands first
        out.write_bytes(b"the other export")
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors, "save_file", racing)
    with pytest.raises(ExportError, match="exists; export never overwrites"):
        export_params(ck, out)
    assert out.read_bytes() == b"the other export"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".b.")] == []


def test_an_io_error_writing_the_export_is_one_message_and_leaves_nothing(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    _, ck = _saved(tmp_path)

    def full(tensors, path, metadata=None):
        open(path, "wb").close()  # begun, as a full disk leaves it
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    monkeypatch.setattr(safetensors, "save_file", full)
    out = tmp_path / "x.safetensors"
    with pytest.raises(ExportError, match=r"writing .*x.safetensors failed: .*No space left"):
        export_params(ck, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def _racing_listing(monkeypatch, during):
    """``protocol.committed_steps`` that runs ``during()`` right after its first listing."""
    real = protocol.committed_steps

    def listing(root, **kw):
        steps = real(root, **kw)
        monkeypatch.setattr(protocol, "committed_steps", real)
        during()
        return steps

    monkeypatch.setattr(protocol, "committed_steps", listing)


def test_a_read_skips_a_step_a_live_run_deleted_after_the_listing(tmp_path, monkeypatch):
    """keep_last=1 beside a reader: the step it chose was deleted before it read it, and
    it reported "no step verifies" although a newer step was committed."""
    _, ck = _saved(tmp_path, step=4)
    newer = ftrain.init_state(_bn_model(), ftrain.optim.sgd(0.1), seed=1)

    def commit_6_delete_4():
        m = ftrain.CheckpointManager(ck, async_save=False)
        m.save(ftrain.replace(newer, step=torch.tensor(6)), force=True)
        shutil.rmtree(ck / "step_00000004")

    _racing_listing(monkeypatch, commit_6_delete_4)
    got, tree, _ = readonly.read_subtree(ck)
    assert got == 6 and torch.equal(tree["params", "0", "weight"], newer["params", "0", "weight"])
    _racing_listing(monkeypatch, lambda: shutil.rmtree(ck / "step_00000006"))
    with pytest.raises(FileNotFoundError, match="step 6 of .* was deleted while being read"):
        readonly.read_subtree(ck, step=6)  # asked for: said so, not "corrupt"


def test_a_run_directorys_fallback_steps_are_found_by_the_readers(tmp_path):
    """Saves that went to checkpoint.fallback_dir (a full primary) were invisible to
    export, eval and init.from given the run directory: an older step was "the newest"."""
    import json

    from ftrain.cli.finetune import parse_init_from

    run, fallback = tmp_path / "run", tmp_path / "fb"
    older = ftrain.init_state(_bn_model(), ftrain.optim.sgd(0.1), seed=0)
    newer = ftrain.init_state(_bn_model(), ftrain.optim.sgd(0.1), seed=1)
    config = {"checkpoint": {"fallback_dir": str(fallback)}}
    with ftrain.CheckpointManager(run / "checkpoints", async_save=False) as m:
        m.save(ftrain.replace(older, step=torch.tensor(2)), force=True, metadata={"config": config})
    with ftrain.CheckpointManager(fallback, async_save=False) as m:
        m.save(ftrain.replace(newer, step=torch.tensor(4)), force=True)
    for records in (False, True):  # the step's recorded config, then the start records
        if records:
            config["checkpoint"]["fallback_dir"] = None
            dirs = [str(run / "checkpoints"), str(fallback)]
            line = {"kind": "start", "step": 0, "checkpoint_dirs": dirs}
            (run / "metrics.jsonl").write_text(json.dumps(line) + "\n")
        where, step = parse_init_from(str(run))
        assert where == [str((run / "checkpoints").resolve()), str(fallback.resolve())]
        got, tree, _ = readonly.read_model(where, step)
        assert got == 4 and torch.equal(
            tree["params", "0", "weight"], newer["params", "0", "weight"]
        )
    done = export_params(where, tmp_path / "m.safetensors")
    assert done["step"] == 4


def test_ckpt_list_show_verify_of_a_run_directory_read_its_fallback_too(tmp_path, capsys):
    """``python -m ftrain.ckpt list runs/x`` showed only ``checkpoints/``: after saves went
    to the fallback (a full disk) an older step looked like the newest, and ``verify``
    passed without reading the steps a resume would take."""
    import json

    from ftrain.ckpt.__main__ import main

    run, fallback = tmp_path / "run", tmp_path / "fb"
    fallback.mkdir()
    state = ftrain.init_state(_bn_model(), ftrain.optim.sgd(0.1), seed=0)
    with ftrain.CheckpointManager(run / "checkpoints", async_save=False) as m:
        m.save(ftrain.replace(state, step=torch.tensor(2)), force=True)
    line = {
        "kind": "start",
        "step": 0,
        "checkpoint_dirs": [str(run / "checkpoints"), str(fallback)],
    }
    (run / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    assert main(["list", str(run)]) == 0  # a fallback never written to: said, not an error
    assert "no committed steps" in capsys.readouterr().out
    with ftrain.CheckpointManager(fallback, async_save=False) as m:
        m.save(ftrain.replace(state, step=torch.tensor(4)), force=True)
    assert main(["list", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"== {fallback.resolve()} (fallback)" in out and out.index(" 2 ") < out.index(" 4 ")
    assert main(["show", str(run)]) == 0
    assert str(fallback.resolve() / protocol.step_dirname(4)) in capsys.readouterr().out
    assert main(["verify", str(run), "4"]) == 0
    assert "ok   step 4" in capsys.readouterr().out
    assert main(["diff", str(run), "2", "4"]) in (0, 1)  # both found, over both locations
    assert "arrays differ between 2 and 4" in capsys.readouterr().out
    assert main(["verify", str(run), "2", "7"]) == 1
    out = capsys.readouterr().out
    assert "ok   step 2" in out and "BAD  step 7: not committed in any" in out
    files = (p for p in (fallback / protocol.step_dirname(4)).rglob("c*") if p.is_file())
    chunk = max(files, key=lambda p: p.stat().st_size)
    raw = bytearray(chunk.read_bytes())
    raw[0] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    assert main(["verify", str(run)]) == 1
    assert "BAD  step 4" in capsys.readouterr().out
    shutil.rmtree(run / "checkpoints" / protocol.step_dirname(2))
    assert main(["show", str(run), "4"]) == 0  # the primary holding nothing any more


def _two_locations(run, primary, fallback, newest: int):
    """A run whose records name ``primary`` (step 2) and ``fallback`` (step ``newest``)."""
    import json

    state = ftrain.init_state(_bn_model(), ftrain.optim.sgd(0.1), seed=0)
    for where, step in ((primary, 2), (fallback, newest)):
        with ftrain.CheckpointManager(where, async_save=False) as m:
            m.save(ftrain.replace(state, step=torch.tensor(step)), force=True)
    line = {"kind": "start", "step": 0, "checkpoint_dirs": [str(primary), str(fallback)]}
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    return state


def test_a_run_whose_checkpoint_dir_was_elsewhere_is_read_with_its_fallback(tmp_path, capsys):
    """checkpoint.dir outside run.dir, and saves went to a fallback inside it (the primary
    remounted read-only): the run directory read as holding nothing and sent the user to
    the primary, whose list sent them back, and export of it took the older step."""

    from ftrain.ckpt.__main__ import main

    run, primary = tmp_path / "run", tmp_path / "ck"
    _two_locations(run, primary, run / "fb", 8)
    assert main(["list", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"saved its checkpoints to {primary}: pass that" in out and " 8 " in out
    assert main(["export", str(run), str(tmp_path / "m.safetensors")]) == 0
    assert "exported step 8" in capsys.readouterr().out


def test_a_run_set_aside_by_overwrite_is_read_alone_and_points_to_its_steps(tmp_path, capsys):
    """RUN/overwritten-<time>/ holds the old run's metrics.jsonl: read as a run directory
    with its records' fallback, it showed the new run's steps there as the old run's."""

    from omegaconf import OmegaConf

    from ftrain.ckpt.__main__ import main
    from ftrain.cli.overwrite import move_run_aside

    run, ext, fb = tmp_path / "run", tmp_path / "ext", tmp_path / "fb"
    state = _two_locations(run, ext, fb, 4)
    checkpoint = {"dir": str(ext), "fallback_dir": str(fb), "storage": {}}
    cfg = OmegaConf.create({"run": {"dir": str(run)}, "checkpoint": checkpoint, "logger": {}})
    old = move_run_aside(cfg)
    with ftrain.CheckpointManager(fb, async_save=False) as m:  # the new run's
        m.save(ftrain.replace(state, step=torch.tensor(100)), force=True)
    assert readonly.locations_of(str(old)) == str(old)
    with pytest.raises(SystemExit, match=f"moved them to {ext / old.name}: pass that"):
        main(["list", str(old)])
    assert main(["list", str(ext / old.name)]) == 0
    out = capsys.readouterr().out
    assert " 2 " in out and " 100 " not in out


def test_a_run_directory_never_reads_another_runs_checkpoints(tmp_path, monkeypatch):
    """Records name paths as written (``runs/a/checkpoints``, relative): after ``mv runs/a
    runs/a_old`` and a new ``runs/a``, reading ``runs/a_old`` merged in the new run's steps.
    Only an absolute fallback is taken; a run whose steps sit in ``run.dir`` itself is read."""
    import json

    from ftrain.cli.finetune import parse_init_from

    monkeypatch.chdir(tmp_path)
    old, new = tmp_path / "runs" / "a_old", tmp_path / "runs" / "a"
    mine = ftrain.init_state(_bn_model(), ftrain.optim.sgd(0.1), seed=0)
    theirs = ftrain.init_state(_bn_model(), ftrain.optim.sgd(0.1), seed=1)
    with ftrain.CheckpointManager(old / "checkpoints", async_save=False) as m:
        m.save(ftrain.replace(mine, step=torch.tensor(2)), force=True)
    with ftrain.CheckpointManager(new / "checkpoints", async_save=False) as m:
        m.save(ftrain.replace(theirs, step=torch.tensor(9)), force=True)
    line = {"kind": "start", "step": 0, "checkpoint_dirs": ["runs/a/checkpoints", "runs/a"]}
    (old / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    where, _ = parse_init_from("runs/a_old")
    assert where == "runs/a_old/checkpoints"
    assert readonly.read_model(where)[0] == 2
    flat = tmp_path / "flat"  # checkpoint.dir=${run.dir}
    with ftrain.CheckpointManager(flat, async_save=False) as m:
        m.save(ftrain.replace(mine, step=torch.tensor(3)), force=True)
    assert readonly.run_locations(flat) == [str(flat)]


def test_export_without_hard_links_still_refuses_to_overwrite(tmp_path, monkeypatch):
    """vfat, FUSE mounts of object stores: os.link is refused (EPERM); the export goes in
    through an exclusively created placeholder, and an existing file still wins."""
    import errno

    _, ck = _saved(tmp_path)

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    out = tmp_path / "m.safetensors"
    assert export_params(ck, out)["step"] == 4
    assert len(safetensors.load_file(str(out))) == 7
    late = tmp_path / "late.safetensors"
    real = safetensors.save_file

    def racing(tensors, path, metadata=None):  # another export lands during this one
        late.write_bytes(b"the other export")
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors, "save_file", racing)
    with pytest.raises(ExportError, match="exists; export never overwrites"):
        export_params(ck, late)
    assert late.read_bytes() == b"the other export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "late.safetensors", "m.safetensors"]


def test_a_run_directory_whose_name_ends_in_colon_digits_is_not_read_as_run_step(tmp_path):
    """A sweep over ``init.from=b64:4,b64:6`` names its jobs ``init.from=b64\\:4``: eval,
    init.from and diff of that directory took ``:4`` as a step of ``init.from=b64\\``."""
    from ftrain.cli.finetune import parse_init_from

    run = tmp_path / "init.from=b64\\:4"
    state = ftrain.init_state(_bn_model(), ftrain.optim.sgd(0.1), seed=0)
    with ftrain.CheckpointManager(run / "checkpoints", async_save=False) as m:
        m.save(ftrain.replace(state, step=torch.tensor(2)), force=True)
    assert parse_init_from(str(run)) == (str(run / "checkpoints"), None)
    assert parse_init_from(f"{run}:2") == (str(run / "checkpoints"), 2)
    assert readonly.split_step("runs/absent:7") == ("runs/absent", 7)
    # a step that is not a number: it said only "no such checkpoint directory"
    with pytest.raises(
        FileNotFoundError, match=r"exists: the part after ':' must be a step number, got 'abc'"
    ):
        readonly.read_subtree(f"{run / 'checkpoints'}:abc")
    assert readonly.split_step("s3://b/p:3") == ("s3://b/p", 3)
    # a directory b64 beside b64:4: b64:4 is the directory it names, not "got '4'"
    (tmp_path / "b64").mkdir()
    with ftrain.CheckpointManager(tmp_path / "b64:4" / "checkpoints", async_save=False) as m:
        m.save(ftrain.replace(state, step=torch.tensor(2)), force=True)
    named = str(tmp_path / "b64:4")
    assert parse_init_from(named) == (str(tmp_path / "b64:4" / "checkpoints"), None)


def test_a_damaged_marker_on_the_only_step_is_named_not_never_saved(tmp_path):
    """A COMMITTED marker that fails its checks hid the run's only step: the readers said
    "no committed checkpoints", as if nothing had ever been saved."""
    _, ck = _saved(tmp_path)
    marker = ck / "step_00000004" / "COMMITTED"
    marker.write_bytes(marker.read_bytes()[:-3])  # torn
    with pytest.raises(FileNotFoundError) as err:
        readonly.read_subtree(ck)
    said = str(err.value)
    assert "no committed checkpoints (" in said and "step_00000004" in said, said
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no committed checkpoints$"):
        readonly.read_subtree(tmp_path / "empty")  # nothing there: nothing more to say


def test_a_damaged_newer_step_is_named_when_asked_for_and_warned_about_when_passed(
    tmp_path, caplog
):
    """A damaged marker or manifest on the newest step: export and eval went back a step
    without a word, and asked for it said only "step 8 is not committed"."""
    import logging

    model, ck = _saved(tmp_path, step=4)
    state = ftrain.init_state(model, ftrain.optim.sgd(0.1), seed=0)
    state = ftrain.replace(state, step=torch.tensor(8))
    ftrain.CheckpointManager(ck, async_save=False).save(state, force=True)
    manifest = ck / "step_00000008" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"chunk_shape":[4', '"chunk_shape":[2', 1))
    with pytest.raises(FileNotFoundError) as err:
        readonly.read_subtree(ck, 8)
    said = str(err.value)
    assert "step 8 is not committed in" in said and "step_00000008: COMMITTED does" in said, said
    assert said.endswith("available: [4]"), said
    with caplog.at_level(logging.WARNING, logger="ftrain.ckpt"):
        assert readonly.read_subtree(ck)[0] == 4
    assert "passed over, not committed (" in caplog.text, caplog.text
    assert "step_00000008: COMMITTED does" in caplog.text, caplog.text


def test_a_run_directory_whose_checkpoints_went_elsewhere_names_them(tmp_path):
    """checkpoint.dir outside run.dir: the readers said only "no committed checkpoints"."""
    from ftrain.metrics import MetricsWriter

    _, ck = _saved(tmp_path)
    run = tmp_path / "run"
    w = MetricsWriter(run)
    w.write("start", step=0, checkpoint_dirs=[str(ck)])
    w.close()
    with pytest.raises(FileNotFoundError, match=f"saved its checkpoints to {ck}: pass that"):
        readonly.read_subtree(run)
    assert readonly.read_subtree(ck)[0] == 4  # where it was named


def test_the_recorded_alpha_counts_only_where_lora_was_on():
    """The default model.lora.alpha=16 of a run without LoRA refused --lora-alpha for a
    custom model's own adapters."""
    from ftrain.ckpt.export import recorded_alpha

    lora = lambda **kw: {"config": {"model": {"lora": kw}}}  # noqa: E731
    assert recorded_alpha(lora(rank=4, alpha=8)) == 8.0
    assert recorded_alpha(lora(rank=0, alpha=16)) is None
    assert recorded_alpha(lora(alpha=16)) is None and recorded_alpha({}) is None


def test_no_hint_names_the_directory_given_or_one_gone(tmp_path, monkeypatch):
    """checkpoint.dir = run.dir given relative: the hint told to pass what was passed."""
    run = tmp_path / "run"
    w = ftrain.metrics.MetricsWriter(run)
    w.write("start", step=0, checkpoint_dirs=[str(run)])
    w.close()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no committed checkpoints$"):
        readonly.read_subtree("run")
    w = ftrain.metrics.MetricsWriter(run)
    w.write("start", step=0, checkpoint_dirs=[str(tmp_path / "deleted")])
    w.close()
    with pytest.raises(FileNotFoundError, match=r"no committed checkpoints$"):
        readonly.read_subtree("run")


def test_an_export_to_a_url_is_refused_not_written_as_a_local_directory(
    tmp_path, monkeypatch, capsys
):
    """``export DIR s3://b/x.safetensors`` wrote ``./s3:/b/x.safetensors`` and said
    "exported ... -> s3://..."."""
    from ftrain.ckpt.__main__ import cmd_export

    monkeypatch.chdir(tmp_path)
    assert cmd_export([str(tmp_path / "ck"), "s3://bkt/out.safetensors"]) == 2
    assert "looks like a URL" in capsys.readouterr().err
    assert not (tmp_path / "s3:").exists()


def test_the_stop_message_survives_a_location_that_cannot_be_listed(capsys):
    """A store gone mid-run failed the save, then the listing in the stop message raised:
    four chained tracebacks instead of the one-line stop."""
    from ftrain.cli.run import _stopped

    class Gone:
        def latest_step(self):
            raise OSError("error sending request")

    assert _stopped(RuntimeError("save failed"), Gone(), "the store") == 1
    err = capsys.readouterr().err
    assert "newest committed checkpoint: unknown (the checkpoint location cannot be listed" in err


class _Tied(nn.Module):
    """nanoGPT's tying: the head's weight is the embedding's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight


def test_merging_adapters_of_a_tied_weight_is_refused_naming_the_tie(tmp_path, capsys):
    """LoRA on a head tied to the embedding: the weight is saved once, as emb.weight, and
    ``export --merge-lora`` raised ``ValueError: ... missing ['head.weight']`` from deep
    inside the merge."""
    from ftrain import lora
    from ftrain.ckpt.__main__ import cmd_export

    model = _Tied()
    lora.apply_lora(model, rank=2, alpha=4, targets=["head"], generator=torch.Generator())
    state = ftrain.init_state(model, ftrain.optim.sgd(0.1), seed=0)
    ftrain.CheckpointManager(tmp_path / "ck", async_save=False).save(state, force=True)
    out = tmp_path / "merged.safetensors"
    args = [str(tmp_path / "ck"), str(out), "--merge-lora", "--lora-alpha", "4"]
    assert cmd_export(args) == 2
    err = capsys.readouterr().err
    assert "no head.weight" in err and "tied" in err and "without --merge-lora" in err, err
    assert not out.exists()
    assert cmd_export(args[:2]) == 0  # the adapters kept separate: exported


def _export_cmd(*args) -> list[str]:
    import sys

    return [sys.executable, "-m", "ftrain.ckpt", "export", *map(str, args)]


def _slow_export(tmp_path, ck, out, *extra):
    """A real ``ckpt export`` process held inside the safetensors write (a sitecustomize
    wraps ``save_file``: it writes, then says so and sleeps), so a signal lands mid-export."""
    import subprocess

    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(
        "import sys, time, safetensors.torch as st\n"
        "real = st.save_file\n"
        "def slow(t, path, metadata=None):\n"
        "    real(t, path, metadata=metadata)\n"
        "    print('WRITTEN', flush=True); time.sleep(60)\n"
        "st.save_file = slow\n"
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.Popen(
        _export_cmd(ck, out, *extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env, preexec_fn=_default_sigint,
    )  # fmt: skip
    assert proc.stdout.readline().strip() == "WRITTEN", proc.stdout.read()
    return proc


def _default_sigint() -> None:
    """Ctrl-C and Ctrl-\\ as at a terminal: a job started with '&' by a non-interactive
    shell (as CI's may be) ignores SIGINT and SIGQUIT, and its children inherit that."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def _gpt2_checkpoint(tmp_path):
    """A tiny gpt2-recipe checkpoint (the config it records is what --format hf needs)."""
    from ftrain.recipes.gpt2 import GPT, GPTConfig

    cfg = GPTConfig(block_size=16, vocab_size=96, n_layer=1, n_head=2, n_embd=16)
    model = GPT(cfg, generator=torch.Generator().manual_seed(0))
    state = ftrain.init_state(model, ftrain.optim.sgd(0.1), seed=0)
    with ftrain.CheckpointManager(tmp_path / "gpt2", async_save=False) as m:
        m.save(state, metadata={"config": {"model": {"name": "gpt2", **cfg.__dict__}}}, force=True)
    return tmp_path / "gpt2"


@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
def test_an_export_killed_mid_write_leaves_a_hidden_stage_the_next_export_removes(tmp_path, fmt):
    """SIGKILL mid-export left a visible ``OUT.tmp-PID`` directory (hf) holding a
    full-size model.safetensors, easily taken for a finished export, and nothing removed
    it. The stage is hidden now, and the next export to that path removes a dead one's."""
    import signal

    _, ck = _saved(tmp_path)
    out = tmp_path / "exports" / ("m.safetensors" if fmt == "safetensors" else "m")
    extra = ("--format", "hf") if fmt == "hf" else ()
    if fmt == "hf":  # a gpt2-recipe state: the only one --format hf writes
        ck = _gpt2_checkpoint(tmp_path)
    proc = _slow_export(tmp_path, ck, out, *extra)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    left = list(out.parent.iterdir())
    assert left and all(p.name.startswith(f".{out.name}.tmp-") for p in left), left
    assert not out.exists()
    import subprocess

    done = subprocess.run(_export_cmd(ck, out, *extra), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in out.parent.iterdir()] == [out.name], "the dead stage is removed"


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGQUIT", "SIGUSR1", "SIGINT"])
def test_a_stop_signal_mid_export_removes_the_stage(tmp_path, sig):
    """SIGTERM's default action ended the process where it stood, leaving a model-sized
    hidden temporary file behind for good; so did SIGQUIT and SIGUSR1 (the trainer's stop
    signals), and SIGINT printed a traceback. Now the export unwinds and removes it."""
    import signal

    signum = getattr(signal, sig)
    _, ck = _saved(tmp_path)
    out = tmp_path / "exports" / "m.safetensors"
    proc = _slow_export(tmp_path, ck, out)
    proc.send_signal(signum)
    assert proc.wait(timeout=30) == 128 + signum
    assert list(out.parent.iterdir()) == [], "no stage or partial file is left"
    assert "Traceback" not in proc.stdout.read()


def test_export_takes_dir_colon_step_like_eval_and_diff(tmp_path):
    """``ckpt export RUN:STEP`` was read as a URL and refused with an unrelated suffix
    ("export writes a model's params"); it now exports that step, and a conflicting
    ``--step`` is refused."""
    import subprocess

    _, ck = _saved(tmp_path, step=4)
    done = subprocess.run(
        _export_cmd(f"{ck}:4", tmp_path / "a.safetensors"), capture_output=True, text=True
    )
    assert done.returncode == 0 and "exported step 4" in done.stdout, done.stderr
    bad = subprocess.run(
        _export_cmd(f"{ck}:4", tmp_path / "b.safetensors", "--step", "6"),
        capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "names step 4 but --step is 6" in bad.stderr, bad.stderr
    gone = subprocess.run(
        _export_cmd(f"{ck}:9", tmp_path / "c.safetensors"), capture_output=True, text=True
    )
    assert gone.returncode != 0 and "export writes a model's params" not in gone.stderr
    assert not (tmp_path / "c.safetensors").exists()


@pytest.mark.parametrize("cmd", ["diff", "show"])
def test_diff_and_show_pick_again_when_retention_deletes_the_newest_mid_read(
    tmp_path, monkeypatch, capsys, cmd
):
    """``diff``/``show`` of a live run's newest step: keep_last=1 deleted it while it was
    read, and the command said ``CORRUPT`` (exit 2 for diff), as for a damaged step. Now
    the newest is picked again (verify and export already told the two apart); a step
    named on the command line and deleted is said to be gone, not corrupt."""
    from ftrain.ckpt import __main__ as tool

    state = ftrain.init_state(_bn_model(), ftrain.optim.sgd(0.1), seed=0)
    live = ftrain.CheckpointManager(
        tmp_path / "ck", async_save=False, keep_policy=ftrain.LatestN(1)
    )
    live.save(ftrain.replace(state, step=torch.tensor(2)), force=True)
    real = tool.read_root_attributes
    later = iter([3, 4])

    def a_save_lands(path, manifest):  # the run commits its next step; step 2 goes
        step = next(later, None)
        if step is not None:
            live.save(ftrain.replace(state, step=torch.tensor(step)), force=True)
        return real(path, manifest)

    monkeypatch.setattr(tool, "read_root_attributes", a_save_lands)
    args = (
        [str(tmp_path / "ck"), f"{tmp_path / 'ck'}:4"] if cmd == "diff" else [str(tmp_path / "ck")]
    )
    rc = tool.main([cmd, *args])
    out = capsys.readouterr().out
    assert rc == 0 and "CORRUPT" not in out, out
    assert ("0 of " in out) if cmd == "diff" else (protocol.step_dirname(4) in out), out
    later = iter([5])  # a named step deleted mid-read: gone, not corrupt
    with pytest.raises(SystemExit, match="step 4 was deleted or set aside while it was read"):
        tool.main(["show", str(tmp_path / "ck"), "4"])
    live.close()


def test_the_ckpt_commands_name_a_run_directorys_checkpoint_dir_elsewhere(tmp_path, capsys):
    """checkpoint.dir outside run.dir: list/verify/show/diff of the run directory said only
    "no committed checkpoints" (export named where they went)."""
    from ftrain.ckpt.__main__ import main
    from ftrain.metrics import MetricsWriter

    _, ck = _saved(tmp_path)
    run = tmp_path / "run"
    w = MetricsWriter(run)
    w.write("start", step=0, checkpoint_dirs=[str(ck)])
    w.close()
    for argv in (["list", run], ["verify", run], ["show", run], ["diff", run, ck]):
        with pytest.raises(SystemExit, match=f"saved its checkpoints to {ck}: pass that"):
            main([str(a) for a in argv])


def test_ckpt_list_of_a_checkpoint_dir_given_as_such_names_its_fallback(tmp_path, capsys):
    """``python -m ftrain.ckpt list CKPT_DIR`` (a checkpoint.dir outside the run directory)
    listed only its own steps, without a word of the newer ones its run saved to the
    fallback (a full disk). They are not read from there (a copy of the directory, or one
    set aside by run.overwrite, records a fallback that may hold another history now):
    the fallback is named."""
    from ftrain.ckpt.__main__ import main

    ck, fallback = tmp_path / "ck", tmp_path / "fb"
    state = ftrain.init_state(_bn_model(), ftrain.optim.sgd(0.1), seed=0)
    config = {"checkpoint": {"fallback_dir": str(fallback)}}
    with ftrain.CheckpointManager(ck, async_save=False) as m:
        m.save(ftrain.replace(state, step=torch.tensor(2)), force=True, metadata={"config": config})
    assert main(["list", str(ck)]) == 0
    assert "fallback_dir" not in capsys.readouterr().out  # no steps there: nothing to say
    with ftrain.CheckpointManager(fallback, async_save=False) as m:
        m.save(ftrain.replace(state, step=torch.tensor(4)), force=True)
    assert main(["list", str(ck)]) == 0
    out = capsys.readouterr().out
    assert f"records checkpoint.fallback_dir={fallback}, which holds steps too" in out
    assert " 4 " not in out  # not read from there


def test_an_asked_for_step_that_is_corrupt_is_named_with_the_steps_that_were_not_read(tmp_path):
    """export --step 4 of a damaged step 4 said "no step verifies" although step 2 did: the
    other steps were never read. Now the message says step 4 does not verify and names
    the others; without --step the newest that verifies is read."""
    from ftrain.ckpt.format import CorruptCheckpointError

    _, ck = _saved(tmp_path, step=2)
    older = readonly.read_subtree(ck)[1]
    state = ftrain.init_state(_bn_model(), ftrain.optim.sgd(0.1), seed=1)
    ftrain.CheckpointManager(ck, async_save=False).save(
        ftrain.replace(state, step=torch.tensor(4)), force=True
    )
    chunk = next(p for p in (ck / "step_00000004" / "params").rglob("c*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError) as err:
        export_params(ck, tmp_path / "x.safetensors", step=4)
    msg = str(err.value)
    assert "step 4 does not verify (" in msg and "crc32c mismatch" in msg, msg
    assert "the other committed steps (2) were not read: name one" in msg
    assert "no step verifies" not in msg and not (tmp_path / "x.safetensors").exists()
    got, tree, _ = readonly.read_subtree(ck)
    assert got == 2 and torch.equal(tree["params", "0", "weight"], older["params", "0", "weight"])


def test_a_run_whose_steps_run_overwrite_moved_aside_names_where_they_went(tmp_path):
    """init.from naming the run being overwritten, killed before the fine-tune's first
    commit: the restart found "no committed checkpoints" in the run and did not say that
    run.overwrite had moved the base to RUN/overwritten-<time>/checkpoints."""
    from ftrain.ckpt.__main__ import main as ckpt_main

    run = tmp_path / "run"
    _, moved = _saved(tmp_path, step=3)
    aside = run / "overwritten-20261207-112956"
    aside.mkdir(parents=True)
    moved.rename(aside / "checkpoints")
    (run / "checkpoints").mkdir()  # the fine-tune's, nothing committed yet
    with pytest.raises(FileNotFoundError) as err:
        readonly.read_subtree(readonly.run_locations(run))
    hint = f"run.overwrite=true moved earlier steps (3) to {aside / 'checkpoints'}: pass "
    assert hint in str(err.value) and "checkpoints:3 to read them" in str(err.value)
    with pytest.raises(SystemExit) as listed:  # the ckpt tools say it, naming the directory
        ckpt_main(["list", str(run)])
    assert f"moved earlier steps (3) to {aside / 'checkpoints'}: give that directory" in str(
        listed.value.code
    )
    # a run that saved into its own directory: the steps themselves went aside
    own = tmp_path / "own"
    (own / "overwritten-20261207-000000").mkdir(parents=True)
    (aside / "checkpoints").rename(own / "overwritten-20261207-000000" / "x")
    (own / "overwritten-20261207-000000" / "x" / "step_00000003").rename(
        own / "overwritten-20261207-000000" / "step_00000003"
    )
    with pytest.raises(
        FileNotFoundError,
        match=r"moved earlier steps \(3\) to .*own/overwritten-20261207-000000: pass",
    ):
        readonly.read_subtree(readonly.run_locations(own))
    got, _, _ = readonly.read_subtree(own / "overwritten-20261207-000000", step=3)
    assert got == 3


def test_a_signal_ignored_on_purpose_stays_ignored_during_an_export():
    """``nohup python -m ftrain.ckpt export ...``: SIGHUP is ignored so a closed terminal
    does not end it; the export's unwinding handler took it over all the same."""
    import signal

    from ftrain.ckpt.__main__ import _terminate_unwinds

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with _terminate_unwinds():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
