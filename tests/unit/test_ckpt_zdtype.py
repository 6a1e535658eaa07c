"""bf16 and float8 leaves as real Zarr data types (format 2), and format 1 (raw bits) still
restoring: ftrain, zarr-python after ``import ftrain``, tensorstore, and a plain
zarr-python without ftrain (which refuses the types; the docs give it a recipe)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import zarr
from tensordict import TensorDict
from zarr.core.dtype import data_type_registry

from ftrain.ckpt import CheckpointManager, CorruptCheckpointError, zdtype
from ftrain.ckpt import commit as protocol
from ftrain.ckpt.__main__ import main as ckpt_tool
from ftrain.ckpt.format import FORMAT_VERSION, READABLE_FORMATS, json_bytes

from .test_ckpt_format import assert_same, random_bits

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "format1"
U = {1: np.uint8, 2: np.uint16}


def _state(step: int = 7) -> TensorDict:
    g = torch.Generator().manual_seed(step)
    return TensorDict(
        {
            "step": torch.tensor(step),
            "params": {
                "w": torch.randn(40, 3, generator=g).bfloat16(),  # 3 chunks at chunk_bytes=96
                "nan": random_bits((9,), torch.bfloat16, seed=step),  # NaN payloads included
                "f": torch.randn(5, generator=g),
            },
            "opt": {
                "e4": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
                "e5": torch.randn(6, generator=g).to(torch.float8_e5m2),
                "fnuz": random_bits((6,), torch.float8_e4m3fnuz),  # no Zarr name: raw bits
            },
        },
        batch_size=[],
    )


def _format1_state() -> TensorDict:
    """What ``tests/fixtures/format1`` holds: committed by ftrain 0.1.0 (format 1, git
    35dc4ef) with ``CheckpointManager(dir, async_save=False, chunk_bytes=16).save(it)``."""
    return TensorDict(
        {
            "step": torch.tensor(3),
            "params": {
                "w": random_bits((6, 3), torch.bfloat16, seed=1),
                "b": torch.linspace(-2, 2, 5).bfloat16(),
                "f": torch.arange(4.0),
            },
            "opt": {
                "e4": random_bits((4,), torch.float8_e4m3fn, seed=2),
                "e5": random_bits((4,), torch.float8_e5m2, seed=3),
            },
        },
        batch_size=[],
    )


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8 if t.element_size() == 1 else torch.uint16).numpy()


def _save(tmp_path: Path, state: TensorDict, **kw) -> Path:
    CheckpointManager(tmp_path / "ck", async_save=False, chunk_bytes=96, **kw).save(state)
    return tmp_path / "ck" / f"step_{int(state['step']):08d}"


def _array_doc(step: Path, key: str) -> dict:
    return json.loads((step / key / "zarr.json").read_bytes())


@pytest.mark.parametrize("compression", [None, "zstd:1"])
def test_a_bf16_state_restores_bit_exact_and_is_format_2(tmp_path, compression):
    state = _state()
    step = _save(tmp_path, state, compression=compression)
    assert_same(CheckpointManager(tmp_path / "ck").restore(), state)
    marker, manifest = protocol.read_committed(step)
    assert marker["format_version"] == manifest["format_version"] == FORMAT_VERSION == 2
    want = {
        "params/w": "bfloat16",
        "opt/e4": "float8_e4m3fn",
        "opt/e5": "float8_e5m2",
        "opt/fnuz": "uint8",
    }
    for key, data_type in want.items():
        doc = _array_doc(step, key)
        assert doc["data_type"] == data_type and doc["fill_value"] == (
            0.0 if key != "opt/fnuz" else 0
        )
        assert doc["attributes"]["ftrain"]["dtype"] == str(state[tuple(key.split("/"))].dtype)[6:]
    assert ckpt_tool(["verify", str(tmp_path / "ck")]) == 0


def test_zarr_python_reads_bfloat16_values_after_import_ftrain(tmp_path):
    state = _state()
    step = _save(tmp_path, state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warning-free, as the plain walk of any step
        group = zarr.open_group(step, mode="r")
        arrays = {k: group[k][...] for k in ("params/w", "params/nan", "opt/e4", "opt/e5")}
    for key, got in arrays.items():
        t = state[tuple(key.split("/"))]
        assert got.dtype == getattr(ml_dtypes, str(t.dtype)[6:]) and got.shape == tuple(t.shape)
        assert (got.view(U[t.element_size()]) == _bits(t)).all(), key
    w = state["params", "w"]
    assert (arrays["params/w"].astype(np.float32) == w.float().numpy()).all()


def test_tensorstore_reads_bfloat16_and_float8_values(tmp_path):
    ts = pytest.importorskip("tensorstore")
    state = _state()
    step = _save(tmp_path, state, compression="zstd:1")
    for key in ("params/w", "params/nan", "opt/e4", "opt/e5"):
        t = state[tuple(key.split("/"))]
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(step / key)}}
        arr = ts.open(spec, read=True).result()
        assert arr.dtype == getattr(ts, str(t.dtype)[6:]) and arr.shape == tuple(t.shape)
        got = arr.read().result()
        assert got.dtype == getattr(ml_dtypes, str(t.dtype)[6:])
        assert (got.view(U[t.element_size()]) == _bits(t)).all(), key
    got = ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(step / "params/w")}}
    )
    values = got.result().read().result().astype(np.float32)
    assert (values == state["params", "w"].float().numpy()).all()


def _copy_fixture(tmp_path: Path) -> Path:
    root = tmp_path / "old"
    shutil.copytree(FIXTURE, root)
    return root


def test_a_format_1_step_still_restores_bit_exact(tmp_path):
    assert 1 in READABLE_FORMATS
    root = _copy_fixture(tmp_path)
    step = root / "step_00000003"
    assert json.loads((step / protocol.MARKER).read_bytes())["format_version"] == 1
    assert _array_doc(step, "params/w")["data_type"] == "uint16"
    assert_same(CheckpointManager(root).restore(), _format1_state())
    assert ckpt_tool(["verify", str(root)]) == 0
    group = zarr.open_group(step, mode="r")  # every reader still sees the raw bits
    assert group["params/b"].dtype == np.uint16
    want = _format1_state()["params", "b"]
    assert (group["params/b"][...].view(ml_dtypes.bfloat16) == want.float().numpy()).all()


def test_a_save_after_a_format_1_restore_writes_format_2(tmp_path):
    root = _copy_fixture(tmp_path)
    mgr = CheckpointManager(root, async_save=False, chunk_bytes=16)
    state = mgr.restore()
    mgr.save(state.set("step", torch.tensor(4)))
    step = root / "step_00000004"
    assert protocol.read_committed(step)[0]["format_version"] == 2
    assert _array_doc(step, "params/w")["data_type"] == "bfloat16"
    assert_same(CheckpointManager(root).restore(4), state)
    assert ckpt_tool(["verify", str(root)]) == 0


def _reseal(step: Path, manifest: dict, marker_format: int) -> None:
    """Rewrite the manifest and a marker that matches it (what a forger would do)."""
    raw = json_bytes(manifest)
    (step / protocol.MANIFEST).write_bytes(raw)
    marker = json.loads((step / protocol.MARKER).read_bytes())
    marker |= protocol.marker_document(int(manifest["step"]), raw) | {
        "format_version": marker_format
    }
    (step / protocol.MARKER).write_bytes(json_bytes(marker))


def test_the_format_decides_which_documents_are_expected(tmp_path):
    step = _save(tmp_path, _state())
    _, manifest = protocol.read_committed(step)
    _reseal(step, manifest | {"format_version": 1}, marker_format=2)
    with pytest.raises(CorruptCheckpointError, match="disagree on the format"):
        protocol.read_committed(step)
    _reseal(step, manifest | {"format_version": 1}, marker_format=1)  # a format 2 step as 1
    assert ckpt_tool(["verify", str(tmp_path / "ck")]) == 1  # bfloat16 where 1 wrote uint16


WITHOUT_FTRAIN = textwrap.dedent(
    """
    import json, sys, warnings
    import zarr
    warnings.simplefilter("ignore")  # use_consolidated=False warns about manifest.json
    out = {}
    try:
        zarr.open_group(sys.argv[1], mode="r")
    except ValueError as e:
        out["open"] = str(e)
    g = zarr.open_group(sys.argv[1], mode="r", use_consolidated=False)
    out["f"] = g["params/f"][...].tolist()
    try:
        g["params/w"]
    except ValueError as e:
        out["w"] = str(e)
    assert "ftrain" not in sys.modules and "ml_dtypes" not in sys.modules
    print(json.dumps(out))
    """
)


def test_plain_zarr_without_ftrain_refuses_bf16_but_reads_the_rest(tmp_path):
    """The interop cost of the real data type, as docs/checkpoint-format.md states it."""
    state = _state()
    step = _save(tmp_path, state)
    res = subprocess.run(
        [sys.executable, "-c", WITHOUT_FTRAIN, str(step)],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    )  # fmt: skip
    got = json.loads(res.stdout)
    # the whole step: whichever bf16 / float8 array its consolidated metadata lists first
    assert re.fullmatch(
        r"No Zarr data type found that matches '(bfloat16|float8_\w+)'", got["open"]
    )
    assert got["w"] == "No Zarr data type found that matches 'bfloat16'"
    assert got["f"] == state["params", "f"].tolist()


def test_import_ftrain_registers_the_types_without_importing_ml_dtypes(tmp_path):
    code = "import sys, ftrain, zarr.core.dtype as d; "
    code += "assert 'ml_dtypes' not in sys.modules; print(sorted(d.data_type_registry.contents))"
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    names = json.loads(res.stdout.replace("'", '"'))
    assert {"bfloat16", "float8_e4m3fn", "float8_e5m2"} <= set(names)


def test_registering_again_changes_nothing():
    before = dict(data_type_registry.contents)
    zdtype.register()
    zdtype.register()
    assert data_type_registry.contents == before
    assert data_type_registry.get("bfloat16") is zdtype.BFloat16


def test_hex_fill_values_are_the_raw_bits():
    bf16 = zdtype.BFloat16()
    nan = bf16.from_json_scalar("0x7fc1", zarr_format=3)  # a NaN with a payload
    assert np.array(nan).view(np.uint16) == 0x7FC1
    assert bf16.from_json_scalar("0x3fc0", zarr_format=3) == 1.5  # not read as a float16
    assert zdtype.Float8E5M2().from_json_scalar("0x3c", zarr_format=3) == 1.0
    assert bf16.to_json_scalar(bf16.from_json_scalar(0.0, zarr_format=3), zarr_format=3) == 0.0
    with pytest.raises(ValueError, match="4 hex digits"):
        bf16.from_json_scalar("0x7fc00000", zarr_format=3)
    with pytest.raises(ValueError, match="Zarr v3 data type"):
        bf16.to_json(zarr_format=2)


def test_zarr_reads_what_tensorstore_writes(tmp_path):
    """The other direction: a bf16 array from tensorstore, NaN fill value and all."""
    ts = pytest.importorskip("tensorstore")
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(tmp_path / "a")},
        "metadata": {"shape": [5], "data_type": "bfloat16", "fill_value": "NaN"},
    }
    values = np.array([1.5, -2, 0, 3, 1e30], dtype=ml_dtypes.bfloat16)
    arr = ts.open(spec, create=True).result()
    arr[:4] = values[:4]
    got = zarr.open_array(tmp_path / "a", mode="r")
    assert got.dtype == ml_dtypes.bfloat16
    out = got[...]
    assert (out[:4] == values[:4]).all() and np.isnan(out[4].astype(np.float32))
