"""Optional chunk compression: bit-exact round-trips, plain-zarr readability, corruption."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from ftrain.ckpt import CheckpointManager
from ftrain.ckpt import commit as protocol
from ftrain.ckpt.codecs import parse_compression
from ftrain.ckpt.format import CorruptCheckpointError
from ftrain.ckpt.reader import read_tree
from ftrain.ckpt.store import groups_and_arrays, write_tree

from .test_ckpt_format import DTYPES, PLAIN_ZARR_READER, assert_same, bits, random_bits

CODECS = ["zstd", "zstd:7", "blosc-lz4", "blosc-zstd:2"]


def _state(step: int = 1) -> TensorDict:
    tensors = {f"t_{str(d)[6:]}": random_bits((33, 5), d, seed=i) for i, d in enumerate(DTYPES)}
    tensors["scalar"] = torch.tensor(7, dtype=torch.int64)
    tensors["empty"] = torch.empty(0, 4)
    tensors["smooth"] = torch.linspace(0, 1, 3000).reshape(300, 10)  # compressible
    return TensorDict({"step": torch.tensor(step), "p": tensors, "g": {}}, [])


def _write(tmp_path, td, compression, chunk_bytes=256):
    st = protocol.begin(tmp_path, int(td["step"]))
    man = write_tree(st.path, td, {"hello": 1}, chunk_bytes=chunk_bytes, compression=compression)
    return protocol.commit(st, man)


@pytest.mark.parametrize("codec", CODECS)
def test_roundtrip_bit_exact(tmp_path, codec):
    td = _state()
    final = _write(tmp_path, td, codec)
    _, manifest = protocol.read_committed(final)
    spec = parse_compression(codec).spec
    assert manifest["compression"] == spec
    w = manifest["arrays"]["p/smooth"]
    assert w["compression"] == spec and len(w["stored_nbytes"]) == len(w["crc32c"]) > 1
    assert_same(read_tree(final, manifest), td)


@pytest.mark.parametrize("codec", CODECS)
def test_plain_zarr_reads_compressed_checkpoint(tmp_path, codec):
    td = _state(9)
    _write(tmp_path, td, codec)
    res = subprocess.run(
        [sys.executable, "-c", PLAIN_ZARR_READER, str(tmp_path / "step_00000009")],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    )  # fmt: skip
    got = json.loads(res.stdout)
    _, leaves = groups_and_arrays(td)
    assert set(got["arrays"]) == set(leaves)
    for k, t in leaves.items():
        _, shape, hexbytes = got["arrays"][k]
        assert shape == list(t.shape) and bytes.fromhex(hexbytes) == bits(t), k


def test_compression_shrinks_compressible_data(tmp_path):
    td = TensorDict({"step": torch.tensor(1), "w": torch.zeros(1000, 100)}, [])
    raw = json.loads((_write(tmp_path / "a", td, None, 1 << 20) / "manifest.json").read_text())
    small = json.loads((_write(tmp_path / "b", td, "zstd", 1 << 20) / "manifest.json").read_text())
    assert raw["compression"] is None and "stored_nbytes" not in raw["arrays"]["w"]
    assert small["nbytes"] < raw["nbytes"] / 50


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_corruption_detected_and_restore_falls_back(tmp_path, damage):
    m = CheckpointManager(tmp_path, async_save=False, compression="zstd", chunk_bytes=512)
    good, bad = _state(1), _state(2)
    m.save(good)
    m.save(bad)
    chunk = tmp_path / "step_00000002" / "p" / "smooth" / "c.1.0"
    data = bytearray(chunk.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[:-9]
    else:  # a valid frame of another chunk, with its own valid trailer: manifest crc catches it
        data = bytearray((chunk.parent / "c.0.0").read_bytes())
    chunk.write_bytes(bytes(data))
    _, manifest = protocol.read_committed(chunk.parents[2])
    with pytest.raises(CorruptCheckpointError, match="smooth"):
        read_tree(chunk.parents[2], manifest)
    with pytest.warns(RuntimeWarning, match="corrupt"):
        assert_same(m.restore(), good)


def test_restore_reads_raw_and_compressed_steps(tmp_path):
    CheckpointManager(tmp_path, async_save=False).save(_state(1))
    CheckpointManager(tmp_path, async_save=False, compression="blosc-lz4").save(_state(2))
    m = CheckpointManager(tmp_path)
    assert_same(m.restore(1), _state(1))
    assert_same(m.restore(2), _state(2))
    assert_same(m.restore(only=("p",))["p"], _state(2)["p"])


@pytest.mark.parametrize("value", ["gzip", "zstd:0", "zstd:99", "zstd:x", "blosc-lz4:10", "", 3])
def test_bad_codec_name_is_a_clear_value_error(tmp_path, value):
    with pytest.raises(ValueError, match="compression=") as e:
        CheckpointManager(tmp_path, compression=value)
    assert repr(value) in str(e.value) and "zstd" in str(e.value) and "blosc-lz4" in str(e.value)


def test_codec_names_canonicalise():
    assert parse_compression(None) is None and parse_compression("none") is None
    assert parse_compression("zstd").spec == "zstd:1"
    assert parse_compression("blosc-zstd").spec == "blosc-zstd:3"


@pytest.mark.parametrize("spec", ["zstd:3", "blosc-lz4", "blosc-zstd"])
def test_a_frame_that_decodes_short_is_refused_not_padded_with_old_memory(spec):
    """A valid frame of half the chunk (its checksums resealed, or written by a broken
    tool) decoded into the first half and left the rest as whatever the memory held:
    restore returned it, verify said ok, export wrote it out. The frame's declared size
    must be the chunk's."""
    codec = parse_compression(spec)
    data = np.arange(32, dtype=np.float32).tobytes()
    whole = codec.encode(memoryview(data), 4)
    out = bytearray(len(data))
    codec.decode_into(whole, memoryview(out), 4)
    assert bytes(out) == data
    short = codec.encode(memoryview(data[:64]), 4)
    with pytest.raises(ValueError, match="its frame declares 64 bytes, the chunk holds 128"):
        codec.decode_into(short, memoryview(bytearray(len(data))), 4)
    with pytest.raises(ValueError, match="cannot decode the chunk"):
        codec.decode_into(whole[:-3], memoryview(bytearray(len(data))), 4)


def test_a_chunk_blosc_cannot_take_is_refused_at_save_naming_the_leaf(tmp_path):
    """A leaf whose one row of dim 0 is past 2 GiB (a chunk is at least a row): save()
    returned True and the background writer failed with numcodecs' "Codec does not support
    buffers of > 2147483647 bytes", naming neither the leaf nor the fix. A chunk_bytes past
    the limit is refused when the manager is made. Meta leaves: no memory is needed."""
    from ftrain.ckpt.store import check_chunk_sizes

    m = CheckpointManager(tmp_path, compression="blosc-lz4", async_save=False)
    wide = torch.empty(1, 2**31 + 4096, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match=r"leaf 'w' needs chunks of 2147487744 bytes \(1 row"):
        check_chunk_sizes({"w": wide}, m.chunk_bytes, m.compression)
    rows = torch.empty(4, 2**30, dtype=torch.uint8, device="meta")  # 1 GiB rows
    with pytest.raises(ValueError, match=r"\(2 row\(s\).*or a smaller chunk_bytes"):
        check_chunk_sizes({"w": rows}, (2**31) - 2**26, m.compression)
    check_chunk_sizes({"w": rows}, (2**31) - 2**26, m.compression, rows_only=True)  # sharded
    tall = torch.empty(2**31 + 4096, dtype=torch.uint8, device="meta")  # many small rows
    check_chunk_sizes({"w": tall}, m.chunk_bytes, m.compression)
    check_chunk_sizes({"w": wide}, m.chunk_bytes, "zstd:1")  # zstd has no such limit
    with pytest.raises(ValueError, match=r"chunk_bytes=3221225472 is past"):
        CheckpointManager(tmp_path, compression="blosc-zstd", chunk_bytes=3 << 30)
    assert m.all_steps() == []
