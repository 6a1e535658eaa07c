"""Format round-trips: every dtype bit-exact, chunking, plain-zarr readability, no pickle."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from tensordict import TensorDict

from ftrain.ckpt import commit as protocol
from ftrain.ckpt.format import ArraySpec, CorruptCheckpointError, array_zarr_json, plan_array
from ftrain.ckpt.reader import read_tree
from ftrain.ckpt.store import groups_and_arrays, write_tree
from ftrain.state.tree import flatten, nodes_and_leaves

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.uint16, torch.uint32, torch.complex128,
]  # fmt: skip


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` filled with arbitrary bit patterns (NaN payloads included)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, itemsize), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def roundtrip(tmp_path: Path, td: TensorDict, chunk_bytes: int = 1 << 20, only=None) -> TensorDict:
    st_ = protocol.begin(tmp_path, int(td["step"]) if "step" in td.keys() else 0)
    manifest = write_tree(st_.path, td, {"hello": 1}, chunk_bytes=chunk_bytes)
    final = protocol.commit(st_, manifest)
    _, manifest = protocol.read_committed(final)
    return read_tree(final, manifest, only=only)


def assert_same(a: TensorDict, b: TensorDict) -> None:
    ga, la = groups_and_arrays(a)
    gb, lb = groups_and_arrays(b)
    assert sorted(ga) == sorted(gb) and sorted(la) == sorted(lb)
    for k in la:
        assert la[k].dtype == lb[k].dtype and la[k].shape == lb[k].shape, k
        assert bits(la[k]) == bits(lb[k]), k


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (33, 5), (4, 3, 2)], ids=str)
def test_every_dtype_roundtrips_bit_exact(tmp_path, dtype, shape):
    td = TensorDict({"step": torch.tensor(1), "x": {"t": random_bits(shape, dtype)}}, [])
    assert_same(roundtrip(tmp_path, td, chunk_bytes=16), td)


def test_nested_empty_groups_and_non_contiguous(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    td = TensorDict(
        {"step": torch.tensor(3), "a": {"b": {}, "c": {"d": base.t()}}, "empty": {}}, []
    )
    out = roundtrip(tmp_path, td, chunk_bytes=32)
    assert_same(out, td)
    assert isinstance(out["a", "b"], TensorDict) and len(out["a", "b"].keys()) == 0


def test_a_step_lists_its_nodes_in_the_trees_one_sorted_walk_whatever_the_insertion_order(
    tmp_path,
):
    """The store walks a state with the library's one flatten (sorted paths), so two trees
    equal but for insertion order write the same manifest, in the same order."""
    leaf = torch.arange(3.0)
    a = TensorDict({"step": torch.tensor(1), "z": {"e": {}}, "b": {"y": leaf, "x": leaf}}, [])
    b = TensorDict({"b": {"x": leaf, "y": leaf}, "z": {"e": {}}, "step": torch.tensor(1)}, [])
    nodes, keys, _ = nodes_and_leaves(a)
    assert nodes == [(), ("b",), ("z",), ("z", "e")] and keys == flatten(a)[0]
    assert groups_and_arrays(a)[0] == ["", "b", "z", "z/e"]
    assert list(groups_and_arrays(a)[1]) == ["b/x", "b/y", "step"]
    manifests = []
    for name, td in (("a", a), ("b", b)):
        staging = protocol.begin(tmp_path / name, 1)
        manifests.append(write_tree(staging.path, td, {}, chunk_bytes=1 << 20))
    first, second = (json.dumps(m["groups"]) + json.dumps(list(m["arrays"])) for m in manifests)
    assert first == second
    with pytest.raises(ValueError, match="'zarr.json' is reserved"):  # manifest.json: root only
        groups_and_arrays(TensorDict({"a": {"manifest.json": leaf}, "zarr.json": leaf}, []))
    with pytest.raises(ValueError, match="leaf 'a/s' is a NonTensorData, not a tensor"):
        groups_and_arrays(TensorDict({"a": {"s": "text"}, "b": leaf}, []))
    # leaves a store cannot hold: refused up front, named, with the fix (a quantized one
    # committed without its scale; a sparse one failed in the background writer)
    q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    for bad, said in (
        (q, "leaf 'w' is quantized (torch.qint8); save t.dequantize()"),
        (torch.eye(3).to_sparse(), "leaf 'w' is torch.sparse_coo, not dense; save t.to_dense()"),
    ):
        with pytest.raises(ValueError, match=re.escape(said)):
            groups_and_arrays(TensorDict({"w": bad}, []))


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(0, 40),
    cols=st.integers(1, 5),
    chunk_bytes=st.integers(1, 400),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.bool]),
)
def test_chunking_roundtrip_property(tmp_path_factory, rows, cols, chunk_bytes, dtype):
    t = random_bits((rows, cols), dtype, seed=rows * 7 + cols)
    td = TensorDict({"step": torch.tensor(0), "t": t}, [])
    assert_same(roundtrip(tmp_path_factory.mktemp("p"), td, chunk_bytes=chunk_bytes), td)


def test_plan_cuts_whole_pages_where_that_pads_little():
    spec = plan_array("w", torch.empty(50257, 768), chunk_bytes=16 << 20)
    n, rows = spec.n_chunks, spec.chunk_shape[0]
    assert n == 10 and spec.chunk_nbytes % 4096 == 0 and (rows * n - 50257) * 8 < rows
    odd = plan_array("o", torch.empty(600, 1025), chunk_bytes=1 << 20)  # pages: 1024-row steps
    assert odd.chunk_shape[0] == 200 and odd.n_chunks == 3  # 824 more rows of 200: not aligned
    small = plan_array("s", torch.empty(4000, 96), chunk_bytes=64 << 10)  # read, not mapped
    assert small.chunk_shape[0] == 167 and small.chunk_nbytes % 4096
    assert spec.chunk_key(3) == "c.3.0" and plan_array("s", torch.tensor(1.0)).chunk_key(0) == "c"


@pytest.mark.parametrize(
    ("dtype", "fmt", "data_type"),
    [
        (torch.bfloat16, 2, "bfloat16"),
        (torch.float8_e4m3fn, 2, "float8_e4m3fn"),
        (torch.float8_e5m2, 2, "float8_e5m2"),
        (torch.float8_e4m3fnuz, 2, "uint8"),  # no Zarr name anywhere: raw bits
        (torch.bfloat16, 1, "uint16"),  # format 1 stored raw bits
        (torch.float8_e5m2, 1, "uint8"),
        (torch.float16, 1, "float16"),
    ],
    ids=str,
)
def test_array_json_data_type_by_format(dtype, fmt, data_type):
    doc = array_zarr_json(plan_array("w", torch.zeros(4, 2, dtype=dtype)), fmt)
    ftrain_attrs = doc["attributes"]["ftrain"]
    assert doc["data_type"] == data_type and ftrain_attrs["dtype"] == str(dtype)[6:]
    assert ("encoding" in ftrain_attrs) == (data_type != str(dtype)[6:])
    assert doc["fill_value"] == (0.0 if "float" in data_type else 0)
    assert doc["codecs"][-1] == {"name": "crc32c"}


DOCS = Path(__file__).resolve().parents[2] / "docs" / "checkpoint-format.md"
# the docs' recipe that teaches a plain zarr-python (no ftrain, no torch) the data types
READER_RECIPE = next(
    b for b in re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S) if "register(" in b
)
PLAIN_ZARR_READER = READER_RECIPE + textwrap.dedent(
    """
    import json, sys, warnings
    import numpy as np, zarr
    warnings.simplefilter("ignore")
    g = zarr.open_group(sys.argv[1], mode="r")
    out = {}
    for path, node in g.members(max_depth=None):
        if isinstance(node, zarr.Array):
            v = node[...]
            out[path] = [str(v.dtype), list(v.shape), v.tobytes().hex()]
    assert "ftrain" not in sys.modules and "torch" not in sys.modules
    print(json.dumps({"attrs": dict(g.attrs), "arrays": out}))
    """
)


def test_plain_zarr_with_the_docs_recipe_reads_every_array_without_ftrain(tmp_path):
    tensors = {f"t_{str(d)[6:]}": random_bits((5, 3), d, seed=i) for i, d in enumerate(DTYPES)}
    tensors["scalar"] = torch.tensor(7, dtype=torch.int64)
    tensors["big"] = random_bits((100, 3), torch.float32)
    td = TensorDict({"step": torch.tensor(9), "p": tensors}, [])
    roundtrip(tmp_path, td, chunk_bytes=64)
    res = subprocess.run(
        [sys.executable, "-c", PLAIN_ZARR_READER, str(tmp_path / "step_00000009")],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    )  # fmt: skip
    got = json.loads(res.stdout)
    assert got["attrs"]["hello"] == 1
    _, leaves = groups_and_arrays(td)
    assert set(got["arrays"]) == set(leaves)
    for k, t in leaves.items():
        dtype, shape, hexbytes = got["arrays"][k]
        assert shape == list(t.shape) and bytes.fromhex(hexbytes) == bits(t), k
    assert got["arrays"]["p/t_bfloat16"][0] == "bfloat16"
    assert got["arrays"]["p/t_float8_e4m3fn"][0] == "float8_e4m3fn"


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_crafted_store_cannot_execute_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    td = TensorDict({"step": torch.tensor(1), "w": torch.zeros(4, dtype=torch.uint8)}, [])
    roundtrip(tmp_path, td)
    step = tmp_path / "step_00000001"
    payload = pickle.dumps(_Boom())
    # a pickle as chunk bytes, as JSON metadata, and an object dtype in the manifest
    (step / "w" / "c.0").write_bytes(payload)
    (step / "zarr.json").write_bytes(payload)
    man = json.loads((step / "manifest.json").read_text())
    man["arrays"]["w"]["dtype"] = "object"
    (step / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CorruptCheckpointError):
        protocol.read_committed(step)
    with pytest.raises(CorruptCheckpointError):
        ArraySpec.from_json("w", man["arrays"]["w"])
    from ftrain.ckpt import CheckpointManager

    with pytest.raises(FileNotFoundError):
        CheckpointManager(tmp_path).restore()
    assert not (tmp_path / "PWNED").exists()
    src = "".join(p.read_text() for p in Path(protocol.__file__).parent.glob("*.py"))
    assert "import pickle" not in src and "torch.load" not in src


def test_reads_stores_with_slash_chunk_keys(tmp_path, monkeypatch):
    """Stores written before the ``.`` separator (``c/0/0`` in subdirectories) still load."""
    import dataclasses

    from ftrain.ckpt import store

    real = store.plan_array
    monkeypatch.setattr(
        store, "plan_array", lambda *a: dataclasses.replace(real(*a), separator="/")
    )
    td = TensorDict({"step": torch.tensor(2), "w": random_bits((40, 3), torch.float32)}, [])
    out = roundtrip(tmp_path, td, chunk_bytes=64)
    assert (tmp_path / "step_00000002" / "w" / "c" / "1" / "0").is_file()
    assert_same(out, td)


def test_large_chunks_go_through_o_direct_or_its_fallback(tmp_path, monkeypatch):
    """Chunks >= 256 KiB use O_DIRECT; EINVAL (tmpfs) falls back to buffered, same bytes."""
    import errno

    from ftrain.ckpt import _direct

    monkeypatch.setattr(_direct, "_refused", set())
    td = TensorDict({"step": torch.tensor(4), "w": random_bits((1001, 777), torch.float32)}, [])
    assert_same(roundtrip(tmp_path / "a", td, chunk_bytes=3 << 20), td)
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            # as Linux on tmpfs/ramfs: the file is created, then O_DIRECT refused (the
            # buffered retry's O_EXCL open failed with EEXIST on the leftover before)
            os.close(real_open(path, flags & ~os.O_DIRECT, *a))
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(_direct.os, "open", no_direct)
    assert_same(roundtrip(tmp_path / "b", td, chunk_bytes=3 << 20), td)
    assert _direct._refused
    a, b = (sorted((tmp_path / d / "step_00000004" / "w").glob("c.*")) for d in "ab")
    assert [f.read_bytes() for f in a] == [f.read_bytes() for f in b]


MIB = 1 << 20


@pytest.mark.parametrize("where", ["start", "second MiB", "payload end", "padding"])
def test_a_flipped_byte_anywhere_in_a_padded_chunk_is_caught(tmp_path, where):
    """A flip at the start, deep inside, at the last payload byte or in the zero padding of
    a multi-MiB chunk must fail its crc32c: restore verifies every byte it reads."""
    rows, cols = 13, MIB // 8  # 3.5 MiB row-chunks of 7 rows; the last has 6: padding
    td = TensorDict({"w": random_bits((rows, cols), torch.float32)}, batch_size=[])
    st_ = protocol.begin(tmp_path, 0)
    manifest = write_tree(st_.path, td, {}, chunk_bytes=7 * cols * 4)
    final = protocol.commit(st_, manifest)
    _, manifest = protocol.read_committed(final)
    assert_same(read_tree(final, manifest), td)  # padded tail: bit-exact
    chunks = sorted((final / "w").glob("c*"), key=lambda p: p.name)
    data = bytearray(chunks[-1].read_bytes())
    chunk_rows = (len(data) - 4) // (cols * 4)
    payload = (rows - chunk_rows * (len(chunks) - 1)) * cols * 4
    assert len(chunks) == 2 and 3 * MIB <= payload < len(data) - 4  # padded, several MiB
    offset = {"start": 3, "second MiB": MIB + 17, "payload end": payload - 1}.get(
        where, payload + 5
    )
    data[offset] ^= 0x40
    os.chmod(chunks[-1], 0o644)
    chunks[-1].write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="crc32c mismatch"):
        read_tree(final, manifest)


@pytest.mark.parametrize(
    "name", ["quint4x2", "qint8", "uint4", "has_cudnn", "_inductor", "Tensor", 3]
)
def test_a_dtype_name_from_metadata_is_only_ever_a_storable_dtype(name):
    # never getattr(torch, name): a packed dtype sized the restore's buffer at half its
    # bytes (a heap overrun), and torch's lazy attributes import modules
    from ftrain.ckpt.format import STORABLE_DTYPES, parse_dtype

    with pytest.raises(CorruptCheckpointError, match="unknown dtype"):
        parse_dtype(name)
    assert all(parse_dtype(n) is d for n, d in STORABLE_DTYPES.items())
    assert set(DTYPES) <= set(STORABLE_DTYPES.values())


def test_a_dtype_the_format_cannot_hold_is_refused_at_save(tmp_path):
    from ftrain.ckpt import CheckpointManager

    state = TensorDict({"step": torch.tensor(1), "w": torch.zeros(4, dtype=torch.uint4)}, [])
    with CheckpointManager(tmp_path) as m:  # async: refused in save(), not in the writer
        with pytest.raises(ValueError, match="leaf 'w': cannot store dtype torch.uint4"):
            m.save(state)
        assert m.all_steps() == []
