"""Every ``zarr.json`` ftrain writes is valid Zarr v3 metadata by zarr-python's own model.

ftrain builds the documents as plain dicts (building ~600 through zarr-python's classes
cost ~140 ms more per GPT-2 save, measured 2026-12-01; see docs/checkpoint-format.md), so
this test holds them to ``zarr.core.metadata.v3.ArrayV3Metadata`` / ``GroupMetadata``: each
parses, and its canonical form equals the one zarr-python writes itself for an array of
the same shape, data type, chunks, codecs, fill value, key encoding and attributes.
ftrain's ``bfloat16`` / float8 data types are registered with zarr-python (importing
``ftrain.ckpt`` does it), so those documents are held to the same model.
"""

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import zarr
from tensordict import TensorDict
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ZstdCodec
from zarr.core.group import GroupMetadata
from zarr.core.metadata.v3 import ArrayV3Metadata
from zarr.storage import MemoryStore

from ftrain.ckpt import CheckpointManager
from ftrain.ckpt.codecs import parse_compression
from ftrain.ckpt.format import (
    _NATIVE,
    READABLE_FORMATS,
    array_zarr_json,
    group_zarr_json,
    plan_array,
)
from ftrain.ckpt.store import write_tree

ML_FLOATS = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
DTYPES = [*_NATIVE, *ML_FLOATS, torch.float8_e4m3fnuz]  # the last: raw bits in every format
COMPRESSION = [None, "zstd:1", "zstd:7", "blosc-lz4", "blosc-zstd:2"]
SHAPES = [(), (0, 3), (7,), (10, 4), (5, 0, 2)]


def _canonical(doc: dict) -> dict:
    return json.loads(json.dumps(ArrayV3Metadata.from_dict(json.loads(json.dumps(doc))).to_dict()))


def _zarr_compressor(spec: str | None, itemsize: int):
    codec = parse_compression(spec)
    if codec is None:
        return []
    cfg = codec.zarr_codec(itemsize)["configuration"]
    return [ZstdCodec(**cfg) if codec.name == "zstd" else BloscCodec(**cfg)]


def _as_zarr_writes_it(doc: dict, spec: str | None, itemsize: int) -> dict:
    """The zarr.json zarr-python itself writes for the array ``doc`` describes."""
    store = MemoryStore()
    zarr.create_array(
        store,
        shape=tuple(doc["shape"]),
        chunks=tuple(doc["chunk_grid"]["configuration"]["chunk_shape"]),
        dtype=doc["data_type"],  # a registered Zarr name (bfloat16 has no numpy name)
        fill_value=0,
        serializer=BytesCodec(endian="little"),
        compressors=[*_zarr_compressor(spec, itemsize), Crc32cCodec()],
        filters=None,
        chunk_key_encoding={"name": "default", "separator": "."},
        attributes=doc["attributes"],
        write_data=False,
    )
    return json.loads(store._store_dict["zarr.json"].to_bytes())


@pytest.mark.parametrize("fmt", sorted(READABLE_FORMATS))
@pytest.mark.parametrize("compression", COMPRESSION)
def test_every_array_document_is_what_zarr_python_writes(compression, fmt):
    for dtype in DTYPES:
        for shape in SHAPES:
            t = torch.zeros(shape, dtype=dtype)
            spec = plan_array("w", t, 64, compression)
            doc = array_zarr_json(spec, fmt)
            ours = _canonical(doc)
            theirs = _canonical(_as_zarr_writes_it(doc, compression, t.element_size()))
            assert ours == theirs, (dtype, shape)
            name = str(dtype).removeprefix("torch.")
            assert ours["attributes"]["ftrain"]["dtype"] == name
            if dtype in ML_FLOATS:  # their own data type; raw bits + logical dtype in format 1
                assert ours["data_type"] == (name if fmt > 1 else f"uint{8 * t.element_size()}")


def test_group_documents_parse():
    for attrs in (None, {}, {"step": 4, "metrics": {"loss": "nan"}, "config": {"a": [1, 2]}}):
        doc = group_zarr_json(attrs)
        md = GroupMetadata.from_dict(json.loads(json.dumps(doc)))
        assert md.to_dict() == {"zarr_format": 3, "node_type": "group", "attributes": attrs or {}}


@pytest.mark.parametrize("compression", [None, "zstd:1", "blosc-lz4"])
def test_every_document_of_a_real_step_parses(tmp_path, compression):
    state = TensorDict(
        {
            "step": torch.tensor(3),
            "params": {
                "w": torch.randn(40, 3),
                "b": torch.randn(9).bfloat16(),
                "e": TensorDict({}, batch_size=[]),
            },
            "opt": {"z": torch.zeros(0, 2), "m": torch.ones(3, dtype=torch.bool)},
        },
        batch_size=[],
    )
    write_tree(tmp_path, state, {"note": 1}, chunk_bytes=64, compression=compression)
    docs = sorted(tmp_path.rglob("zarr.json"))
    assert len(docs) == 4 + 5  # root, params, params/e, opt + 5 arrays
    for path in docs:
        doc = json.loads(path.read_bytes())
        if doc["node_type"] == "group":
            GroupMetadata.from_dict(doc)
        else:
            assert _canonical(doc)["shape"] == doc["shape"]


def test_a_plain_zarr_walk_of_a_step_is_warning_free(tmp_path):
    """The root document consolidates the hierarchy, so zarr-python never tries
    manifest.json / COMMITTED as nodes; its consolidated metadata is what zarr-python's own
    ``consolidate_metadata`` writes for the step."""
    import shutil
    import warnings

    from ftrain.ckpt import CheckpointManager

    state = TensorDict(
        {
            "step": torch.tensor(5),
            "params": {"w": torch.randn(40, 3), "b": torch.randn(9).bfloat16(), "e": {}},
            "opt": {"z": torch.zeros(0, 2)},
        },
        batch_size=[],
    )
    CheckpointManager(tmp_path / "ck", async_save=False, chunk_bytes=64).save(state)
    step = tmp_path / "ck" / "step_00000005"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        group = zarr.open_group(step, mode="r")
        members = dict(group.members(max_depth=None))
        assert sorted(members) == [
            "opt",
            "opt/z",
            "params",
            "params/b",
            "params/e",
            "params/w",
            "step",
        ]
        assert (group["params/w"][...] == state["params", "w"].numpy()).all()
        b = group["params/b"][...]  # the bfloat16 data type, registered by importing ftrain
        assert b.dtype == ml_dtypes.bfloat16
        assert (b.view(np.uint16) == state["params", "b"].view(torch.uint16).numpy()).all()

    theirs = tmp_path / "copy"
    shutil.copytree(step, theirs)
    for name in ("manifest.json", "COMMITTED"):
        (theirs / name).unlink()
    root = json.loads((theirs / "zarr.json").read_bytes())
    del root["consolidated_metadata"]
    (theirs / "zarr.json").write_text(json.dumps(root))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "consolidated metadata is not in the v3 spec"
        zarr.consolidate_metadata(theirs)
    ours = json.loads((step / "zarr.json").read_bytes())
    want = json.loads((theirs / "zarr.json").read_bytes())
    canon = lambda d: json.loads(json.dumps(GroupMetadata.from_dict(d).to_dict()))  # noqa: E731
    assert canon(ours) == canon(want)


def _edit_step_doc(step: Path, rel: str, edit) -> None:
    from tests.unit.test_ckpt_fuzz import _reseal

    doc = json.loads((step / rel).read_text())
    edit(doc)
    (step / rel).write_text(json.dumps(doc))
    _reseal(step, rel)  # a consistent forgery: only the checks behind the checksums remain


def _set(*path_and_value):
    *path, value = path_and_value

    def edit(doc):
        for p in path[:-1]:
            doc = doc[p]
        doc[path[-1]] = value

    return edit


_W = ("consolidated_metadata", "metadata", "params/w")
_MISREAD = {
    "consolidated dtype": ("zarr.json", _set(*_W, "data_type", "int32")),
    "consolidated shape": ("zarr.json", _set(*_W, "shape", [4, 8])),
    "consolidated node gone": ("zarr.json", lambda d: d[_W[0]][_W[1]].pop("params/w")),
    "zarr_format 2": ("params/w/zarr.json", _set("zarr_format", 2)),
    "node_type group": ("params/w/zarr.json", _set("node_type", "group")),
    "must-understand extension": ("params/w/zarr.json", _set("ext", {"must_understand": True})),
    "dimension_names of another rank": ("params/w/zarr.json", _set("dimension_names", ["a"])),
    "ftrain dtype attribute": (
        "params/w/zarr.json",
        _set("attributes", "ftrain", "dtype", "int32"),
    ),
}


@pytest.mark.parametrize("case", sorted(_MISREAD))
def test_verify_refuses_documents_plain_zarr_readers_misread_or_refuse(tmp_path, capsys, case):
    """Resealed edits of ``zarr.json`` that zarr-python misreads silently (the root's
    consolidated copy, which ``open_group`` reads by default) or refuses passed ``ckpt
    verify``: it compared five fields of each array's own document and never the
    consolidated copy."""
    from ftrain.ckpt.__main__ import main

    state = TensorDict({"step": torch.tensor(1), "params": {"w": torch.ones(8, 4)}}, [])
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(state)
    step = tmp_path / "step_00000001"
    rel, edit = _MISREAD[case]
    _edit_step_doc(step, rel, edit)
    assert main(["verify", str(tmp_path)]) == 1
    assert "BAD  step 1" in capsys.readouterr().out


def test_verify_accepts_what_a_reader_may_ignore(tmp_path, capsys):
    """An extension marked must_understand: false, dimension names, another fill value."""
    from ftrain.ckpt.__main__ import main

    state = TensorDict({"step": torch.tensor(1), "params": {"w": torch.ones(8, 4)}}, [])
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(state)
    step = tmp_path / "step_00000001"

    def edit(doc):
        doc |= {"ext": {"must_understand": False}, "dimension_names": ["r", "c"], "fill_value": 1}

    _edit_step_doc(step, "params/w/zarr.json", edit)
    _edit_step_doc(step, "zarr.json", lambda d: edit(d[_W[0]][_W[1]]["params/w"]))
    assert main(["verify", str(tmp_path)]) == 0, capsys.readouterr()


def test_a_step_recorded_as_true_is_not_step_1(tmp_path, capsys):
    """``"step": true`` in the marker and manifest of ``step_00000001`` counted as committed
    step 1 and verified ok (``True == 1`` in Python); ``format_version: true`` was refused."""
    from tests.unit.test_ckpt_fuzz import _reseal

    state = TensorDict({"step": torch.tensor(1), "params": {"w": torch.ones(8, 4)}}, [])
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(state)
    step = tmp_path / "step_00000001"
    for rel in ("manifest.json", "COMMITTED"):
        doc = json.loads((step / rel).read_text())
        doc["step"] = True
        (step / rel).write_text(json.dumps(doc))
        _reseal(step, rel)
    assert CheckpointManager(tmp_path).all_steps() == []
