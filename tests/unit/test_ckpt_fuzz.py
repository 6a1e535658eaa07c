"""Fuzz a real checkpoint: restore gives a bit-exact committed step or ftrain's own error.

Each example copies two committed steps (compressed and raw arrays, bf16, 0-d, empty
groups), applies one to three mutations to the newest — JSON values anywhere in the
marker, manifest or a ``zarr.json`` (sometimes re-sealed with fresh checksums, as a
consistent forgery would be), flipped/truncated/extended/deleted chunks, chunks replaced
by directories or by symbolic links to a file outside — and then restores. Allowed
outcomes: the original step 2 or step 1 bit for bit, or ``CheckpointNotFoundError`` /
``CheckpointFormatError``. Never another exception, a hang (deadline), an allocation over
64 MiB, an open() outside the checkpoint directory, or a silently different state.

``FTRAIN_FUZZ_EXAMPLES`` (default 60) sets the number of examples; see
``docs/fault-tolerance.md`` for the long run.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import crc32c
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from ftrain.ckpt import (
    CheckpointFormatError,
    CheckpointManager,
    CheckpointNotFoundError,
    reader,
    store,
)
from ftrain.ckpt.__main__ import main as ckpt_main

EXAMPLES = int(os.environ.get("FTRAIN_FUZZ_EXAMPLES", "60"))
OUTCOMES: Counter = Counter()  # written to $FTRAIN_FUZZ_REPORT (JSON) at the end, if set


def event(outcome: str) -> None:
    OUTCOMES[outcome] += 1


@pytest.fixture(scope="module", autouse=True)
def _report_outcomes():
    yield
    if os.environ.get("FTRAIN_FUZZ_REPORT"):
        Path(os.environ["FTRAIN_FUZZ_REPORT"]).write_text(json.dumps(dict(OUTCOMES), indent=1))


MAX_ALLOC = 64 << 20


def make_state(step: int) -> TensorDict:
    g = torch.Generator().manual_seed(step)
    return TensorDict(
        {
            "step": torch.tensor(step),
            "params": {
                "w": torch.randn(96, 16, generator=g),
                "b": torch.randn(16, generator=g).bfloat16(),
                "z": torch.zeros(0, 3),
            },
            "buffers": {},
            "opt": {"count": torch.tensor(step), "mu": {"w": torch.randn(96, 16, generator=g)}},
            "rng": torch.tensor([step, 3], dtype=torch.int64),
        },
        [],
    )


def bits(td: TensorDict) -> dict:
    flat = td.flatten_keys("/")
    return {
        k: (flat[k].dtype, flat[k].shape, flat[k].reshape(-1).view(torch.uint8))
        for k in flat.keys()
    }


def same_state(a: TensorDict, b: TensorDict) -> bool:
    ba, bb = bits(a), bits(b)
    if ba.keys() != bb.keys():
        return False
    if sorted(store.groups_and_arrays(a)[0]) != sorted(store.groups_and_arrays(b)[0]):
        return False  # the same leaves in another group structure is a different state
    return all(
        x[0] == y[0] and x[1] == y[1] and torch.equal(x[2], y[2])
        for x, y in ((ba[k], bb[k]) for k in ba)
    )


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz") / "ck"
    CheckpointManager(root, async_save=False, chunk_bytes=2048).save(make_state(1), force=True)
    CheckpointManager(root, async_save=False, chunk_bytes=2048, compression="zstd").save(
        make_state(2), force=True
    )
    return root


# ---- mutations ---------------------------------------------------------------------------
JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, 1, -1, 10**12, 2**31, 2**63]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(
        ["", "..", "../../outside", "/etc/passwd", "bfloat16", "float64", "zstd:1", "c/0"]
    ),
    st.text(max_size=8),
    st.lists(st.integers(min_value=-3, max_value=10**6), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _paths(doc, prefix=()):
    """Every (container path) in a JSON document, for picking a place to mutate."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


def _set(doc, path, value, op):
    if not path:
        return value
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if op == "delete" and isinstance(parent, dict):
        parent.pop(last)
    elif op == "rename" and isinstance(parent, dict):
        parent[str(value)[:40]] = parent.pop(last)
    else:
        parent[last] = value
    return doc


def _reseal(step_dir: Path, rel: str) -> None:
    """Recompute the checksums that cover ``rel`` (a consistent forgery)."""
    manifest_path = step_dir / "manifest.json"
    if rel != "manifest.json" and rel != "COMMITTED":
        try:
            manifest = json.loads(manifest_path.read_bytes())
            raw = (step_dir / rel).read_bytes()
            manifest["documents"][rel] = [crc32c.crc32c(raw), len(raw)]
            manifest_path.write_text(json.dumps(manifest))
        except (ValueError, KeyError, TypeError, OSError):
            return
    if rel != "COMMITTED":
        try:
            marker = json.loads((step_dir / "COMMITTED").read_bytes())
            raw = manifest_path.read_bytes()
            marker |= {"manifest_crc32c": crc32c.crc32c(raw), "manifest_bytes": len(raw)}
            (step_dir / "COMMITTED").write_text(json.dumps(marker))
        except (ValueError, TypeError, OSError):
            return


def mutate_json(step_dir: Path, data) -> None:
    docs = ["COMMITTED", "manifest.json", "zarr.json"] + sorted(
        p.relative_to(step_dir).as_posix()
        for p in step_dir.rglob("zarr.json")
        if p.parent != step_dir
    )
    rel = data.draw(st.sampled_from(docs), label="document")
    doc = json.loads((step_dir / rel).read_bytes())
    path = data.draw(st.sampled_from(list(_paths(doc))), label="json path")
    op = data.draw(st.sampled_from(["set", "delete", "rename"]), label="op")
    doc = _set(doc, path, data.draw(JSON_VALUES, label="value"), op)
    (step_dir / rel).write_text(json.dumps(doc))
    if data.draw(st.booleans(), label="reseal"):
        _reseal(step_dir, rel)


def mutate_chunk(step_dir: Path, outside: Path, data) -> None:
    chunks = sorted(
        p
        for p in step_dir.rglob("c*")
        if p.is_file() and not p.is_symlink() and p.name != "COMMITTED"
    )
    chunk = data.draw(st.sampled_from(chunks), label="chunk")
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "delete", "dir", "link"]))
    raw = bytearray(chunk.read_bytes())
    if not raw and how in ("flip", "truncate"):
        how = "extend"
    if how == "flip":
        i = data.draw(st.integers(0, len(raw) - 1), label="byte")
        raw[i] ^= data.draw(st.integers(1, 255), label="xor")
        chunk.write_bytes(bytes(raw))
    elif how == "truncate":
        chunk.write_bytes(bytes(raw[: data.draw(st.integers(0, len(raw) - 1))]))
    elif how == "extend":
        chunk.write_bytes(bytes(raw) + b"\0" * data.draw(st.integers(1, 64)))
    elif how == "delete":
        chunk.unlink()
    elif how == "dir":
        chunk.unlink()
        chunk.mkdir()
    else:  # a link to an identical copy outside: still refused, never read
        outside.write_bytes(bytes(raw))
        chunk.unlink()
        chunk.symlink_to(outside)


# ---- the property ------------------------------------------------------------------------
class _Guard:
    """Records open() calls outside ``root`` and allocations over MAX_ALLOC during restore."""

    def __init__(self, root: Path) -> None:
        self.root = str(root.resolve())
        self.outside: list[str] = []
        self.big: list[int] = []

    def open(self, real):
        def wrapped(path, flags, *a, **k):
            if "dir_fd" not in k and isinstance(path, str | os.PathLike):
                full = os.path.realpath(os.fspath(path))
                if not full.startswith(self.root) and not full.startswith(
                    ("/proc", "/dev", "/sys")
                ):
                    self.outside.append(full)
            return real(path, flags, *a, **k)

        return wrapped

    def empty(self, real):
        def wrapped(shape, dtype):
            n = 1
            for d in shape:
                n *= int(d)
            if n * dtype.itemsize > MAX_ALLOC:
                self.big.append(n)
                raise AssertionError(f"restore tried to allocate {n} elements")
            return real(shape, dtype)

        return wrapped


@settings(
    max_examples=EXAMPLES,
    deadline=20_000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=os.environ.get("FTRAIN_FUZZ_RANDOM") is None,
)
@given(data=st.data())
def test_restore_of_a_mutated_checkpoint_is_exact_or_ftrains_error(pristine, monkeypatch, data):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ck"
        shutil.copytree(pristine, root, symlinks=True)
        step_dir = root / "step_00000002"
        for _ in range(data.draw(st.integers(1, 3), label="mutations")):
            if data.draw(st.booleans(), label="json or chunk"):
                mutate_json(step_dir, data)
            else:
                mutate_chunk(step_dir, Path(tmp) / "outside.bin", data)
            event("mutations")
        event("examples")
        guard = _Guard(root)
        with monkeypatch.context() as m:
            m.setattr(os, "open", guard.open(os.open))
            m.setattr(reader, "_empty", guard.empty(reader._empty))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    got = CheckpointManager(root, async_save=False).restore()
                except (CheckpointNotFoundError, CheckpointFormatError) as e:
                    event(f"outcome: {type(e).__name__}")
                    got = None
        assert not guard.outside, f"opened outside the checkpoint: {guard.outside}"
        assert not guard.big
        if got is not None:
            step = int(got["step"])
            assert step in (1, 2) and same_state(got, make_state(step)), (
                "a silently different state"
            )
            event(f"outcome: restored step {step} bit-exact")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                rc = ckpt_main(["verify", str(root)])
            except SystemExit as e:  # "no committed checkpoints" and friends: a message
                rc = 1 if e.code else 0
        assert rc in (0, 1, 2)
