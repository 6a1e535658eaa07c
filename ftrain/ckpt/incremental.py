"""Incremental saves: a leaf that did not change since the last commit is not rewritten.

The state is immutable, so a step that does not update a leaf (a frozen base model, the
base weights under LoRA adapters, a constant key) carries the *same tensor object* into the
new state. :class:`~ftrain.ckpt.manager.CheckpointManager` records, for every leaf of the
step it last committed (or restored, when it resumes a run), who the tensor was (:class:`Identity`) and what was stored
(its manifest entry and a sample fingerprint, :class:`CommittedLeaf`). A leaf of the next
save that is the same object, unchanged, is *reused*: its chunk files are hard-linked
from the previous step (local file systems) or server-side copied (object stores) instead
of being written; the new manifest lists them with the previous crc32c values, so every
step stays complete and self-contained (restore, ``verify``, retention and deleting the
older step treat it like any other). Any reason a chunk cannot be reused (another file
system, a vanished previous step, a refused copy) makes the writer write it normally.

The previous step must still be the one this manager committed: another manager (or
process) on the same location may have replaced it since (a redo of that step sets the
old one aside and commits its own under the same name), and a chunk of the same size but
other bytes would be linked under the old crc32c — a step committed already corrupt.
So before writing, the writer reads the source step's sealed manifest once
(:func:`confirm_sources`) and links or copies only leaves whose entry there is still the
one recorded; the others are written from the caller's tensors, with a warning.

Identity (captured synchronously in ``save``, from the caller's tensors): a weak reference
to the tensor object plus its version counter (``t._version``, bumped by every in-place
op PyTorch tracks), ``data_ptr``, shape, stride, storage offset, dtype and device. The
weak reference is what makes it safe: ``id()`` values and addresses are reused once a
tensor is collected, but a dead weak reference never matches a new tensor. Nothing is
kept alive by the record.

Guarantee against changes PyTorch does not track (writes through ``.data``, ``.numpy()``,
DLPack or a raw pointer keep ``_version``; ``torch.optim``'s fused kernels are made to
count theirs by :mod:`ftrain.ckpt.untracked`): before a leaf is reused, ``save`` checks, on
the caller's tensor,

1. its *sample fingerprint*: the crc32c of :data:`WINDOWS` windows of :data:`WINDOW` bytes
   spread evenly over the leaf (first and last bytes included), against the one taken from
   the bytes last written. A leaf of at most ``WINDOWS * WINDOW`` bytes (32 KiB: biases,
   norms, keys, counters) is covered completely; any change to a larger one that touches
   a window (re-initialising it, scaling, ``zero_()``, copying another tensor in) too.
2. a rotating *chunk audit*: whole chunks of the reused leaves, at least
   :data:`AUDIT_FRACTION` of their bytes per save (at least one chunk), in a fixed order
   that resumes where the previous save stopped; each chunk's crc32c is compared with the
   manifest's (the crc of the very file that is linked). So while a leaf keeps being
   reused, every byte of it is re-checked at least once every ``1 / AUDIT_FRACTION`` saves.
   Compressed arrays are not audited against the tensor (their stored crc covers the
   compressed frame; re-encoding to compare would cost more than writing), only
   fingerprinted.

The files are checked too (:mod:`ftrain.ckpt.links`): before a chunk is linked its size is
compared with the manifest's, and the audited chunks' files are read whole and hashed. A damaged file (bit rot, a stray write) linked again would have been copied
forward into every new step until no step restored; it is written afresh from the caller's
tensor instead, and said.

A mismatch raises :class:`LeafChangedError` (a ``ValueError``) from ``save``, naming the
leaf: nothing is written, the record is unchanged. Not detected: a change outside the
windows of a large leaf until the audit reaches its chunk (up to 32 saves later; the
checkpoints between hold the old bytes of that leaf), and a change that happens after
``save`` returned while an async save is still writing (the documented rule: do not
mutate a state passed to an async save before ``wait()``). Cost: 32 KiB per reused leaf
plus 1/32 of the reused bytes hashed (crc32c, ~12 GB/s here): about 2 ms for GPT-2.

A linked chunk is one file on disk shared by the steps that hold it: bit rot in it shows
in all of them (restore detects it by crc32c in each), where a full save would have given
every step its own copy. New saves stop sharing a damaged file once the audit reaches it
(within ``1 / AUDIT_FRACTION`` saves; at once for a file of another size). ``CheckpointManager(incremental=False)`` writes every leaf of
every save.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import threading
import weakref
from dataclasses import dataclass, field

import crc32c
import torch
from tensordict import TensorDictBase

from ftrain.ckpt.chunkio import tensor_bytes
from ftrain.ckpt.format import ArraySpec, CheckpointFormatError, CorruptCheckpointError, plan_array

__all__ = [
    "AUDIT_FRACTION",
    "WINDOW",
    "WINDOWS",
    "CommittedLeaf",
    "FallbackBytes",
    "Identity",
    "LastCommit",
    "LeafChangedError",
    "Reuse",
    "NO_REUSE",
    "SavePlan",
    "check_unchanged",
    "confirm_sources",
    "host_snapshot",
    "identify",
    "plan_reuse",
    "plan_save",
    "remember",
    "sample_fingerprint",
]

log = logging.getLogger("ftrain.ckpt")

WINDOW = 4096  # bytes per fingerprint window
WINDOWS = 8  # windows per leaf: leaves up to 32 KiB are fingerprinted whole
AUDIT_FRACTION = 1 / 32  # of the reused bytes re-hashed per save (whole chunks)


class LeafChangedError(ValueError):
    """A leaf that ``save`` would reuse (same object, same version counter) holds other
    bytes than the checkpoint it would be reused from: it was modified in place behind
    PyTorch's back. The message names the leaf and what to do instead."""


@dataclass(frozen=True)
class Identity:
    """Who a leaf tensor was when it was saved (see the module docstring)."""

    ref: weakref.ReferenceType
    facts: tuple  # (_version, data_ptr, shape, stride, storage_offset, dtype, device)

    def matches(self, t: torch.Tensor, facts: tuple) -> bool:
        """``t`` (whose :func:`_facts` are ``facts``) is this very tensor, unchanged."""
        return self.ref() is t and facts == self.facts


def _facts(t: torch.Tensor) -> tuple | None:
    try:
        version = t._version  # inference tensors have no version counter: never reused
        return (version, t.data_ptr(), t.shape, t.stride(), t.storage_offset(), t.dtype, t.device)
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def identify(leaves: dict[str, torch.Tensor]) -> dict[str, Identity]:
    """The identity of every leaf that can have one; O(leaves), a few microseconds each."""
    out = {}
    for key, t in leaves.items():
        facts = _facts(t)
        if facts is not None:
            out[key] = Identity(weakref.ref(t), facts)
    return out


@dataclass(frozen=True)
class CommittedLeaf:
    """A leaf of the last committed step: who it was, its manifest entry, its fingerprint.

    The entry is parsed into an :class:`ArraySpec` only when a later save finds the same
    tensor again: in full training (every leaf new every step) that never happens."""

    identity: Identity
    key: str
    entry: dict = field(repr=False)  # the manifest's entry, written by this process
    fingerprint: int

    @functools.cached_property
    def spec(self) -> ArraySpec:
        return ArraySpec.from_json(self.key, self.entry)


@dataclass
class LastCommit:
    """What the manager last committed (updated only after a commit succeeds)."""

    step: int
    step_dir: object  # Path or ObjectKey of the committed step
    leaves: dict[str, CommittedLeaf]
    audit_cursor: int = 0


@dataclass(frozen=True)
class Reuse:
    """One leaf to reuse: the step its chunks come from, its entry there, and the caller's
    tensor (the bytes to write if a chunk cannot be linked or copied)."""

    source: object
    spec: ArraySpec
    tensor: torch.Tensor = field(repr=False)
    audit: frozenset[int] = frozenset()  # chunks whose source files are read whole first


def _same_layout(a: ArraySpec, b: ArraySpec) -> bool:
    return (a.dtype, a.shape, a.chunk_shape, a.compression, a.separator) == (
        b.dtype,
        b.shape,
        b.chunk_shape,
        b.compression,
        b.separator,
    )


def plan_reuse(
    last: LastCommit | None,
    leaves: dict[str, torch.Tensor],
    identities: dict[str, Identity],
    chunk_bytes: int,
    compression: str | None,
) -> dict[str, Reuse]:
    """The leaves that are the same, unchanged objects as in ``last`` and would be stored
    with the same chunks (same ``chunk_bytes`` and ``compression``)."""
    if last is None:
        return {}
    out = {}
    for key, ident in identities.items():
        prev = last.leaves.get(key)
        t = leaves[key]
        if prev is None or not prev.identity.matches(t, ident.facts):
            continue
        if _same_layout(plan_array(key, t, chunk_bytes, compression), prev.spec):
            out[key] = Reuse(last.step_dir, prev.spec, t)
    return out


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The leaf's bytes as a 1-d uint8 tensor on its own device (what the chunks hold)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8)


def _crc(b: torch.Tensor, value: int = 0) -> int:
    return crc32c.crc32c(memoryview(b.cpu().numpy()), value=value)


def _windows(n: int) -> list[tuple[int, int]]:
    """The fingerprint's byte ranges in a leaf of ``n`` bytes (all of it if small)."""
    if n <= WINDOW * WINDOWS:
        return [(0, n)]
    return [(s, s + WINDOW) for s in (j * (n - WINDOW) // (WINDOWS - 1) for j in range(WINDOWS))]


def _cpu_view(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor without copying. A plain contiguous tensor is read at its
    ``data_ptr`` directly (a fingerprint of every leaf is taken after every save: the eight
    torch calls of :func:`~ftrain.ckpt.chunkio.tensor_bytes` would cost more than the
    hashing); anything else goes through ``tensor_bytes``."""
    if t.is_contiguous() and not t.is_conj() and not t.is_neg() and t.numel():
        nbytes = t.numel() * t.element_size()
        return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")
    return tensor_bytes(t)


def sample_fingerprint(t: torch.Tensor) -> int:
    """The crc32c of the leaf's sample windows, end to end (the whole leaf if it is 32 KiB
    or less). On the CPU straight from the tensor's memory; elsewhere the windows are
    gathered on the device and copied to the host together."""
    if t.device.type == "cpu":
        view, crc = _cpu_view(t), 0
        for start, stop in _windows(len(view)):
            crc = crc32c.crc32c(view[start:stop], value=crc)
        return crc
    flat = _flat_bytes(t)
    return _crc(torch.cat([flat[a:b] for a, b in _windows(flat.numel())]))


def _chunk_crc(t: torch.Tensor, spec: ArraySpec, i: int) -> int:
    """The crc32c an uncompressed chunk file of ``t`` would carry (payload + zero pad)."""
    start, stop = spec.chunk_span(i)
    crc = _crc(_flat_bytes(t)[start:stop])
    pad = spec.chunk_nbytes - (stop - start)
    return crc32c.crc32c(bytes(pad), value=crc) if pad else crc


def _changed(key: str, last: LastCommit, how: str) -> LeafChangedError:
    return LeafChangedError(
        f"state leaf {key!r} is the same tensor object, with the same version counter, as "
        f"in step {last.step} that this CheckpointManager committed, but {how}: it was "
        "modified in place where PyTorch does not see it (through .data, .numpy(), DLPack, "
        "a raw pointer, or an optimizer kernel that does not count its writes: a step of "
        "torch.optim's or a torch.optim.Optimizer subclass is counted). ftrain recognises unchanged leaves by identity and would have "
        f"linked step {last.step}'s copy. Make a new tensor instead (new = old + delta, or "
        "old.clone() and change the clone), or change it with an in-place op on the tensor "
        "itself (t.add_(...) bumps its version, so it is rewritten); "
        "CheckpointManager(incremental=False) rewrites every leaf. Nothing was saved"
    )


def check_unchanged(
    reuse: dict[str, Reuse], last: LastCommit | None
) -> tuple[int, dict[str, set[int]]]:
    """Fingerprint every leaf to reuse and audit the next chunks (module docstring).

    Returns:
        The audit cursor for the next save, and the chunks audited (``{key: {i}}``): their
        source files are read whole before they are linked (:mod:`ftrain.ckpt.links`).

    Raises:
        LeafChangedError: a leaf's bytes differ from the ones it would be reused from.
    """
    if last is None or not reuse:
        return (last.audit_cursor if last else 0), {}
    for key, r in reuse.items():
        if sample_fingerprint(r.tensor) != last.leaves[key].fingerprint:
            raise _changed(key, last, "its sampled bytes differ from the ones saved")
    chunks = [(k, i) for k in sorted(reuse) for i in range(reuse[k].spec.n_chunks)]
    if not chunks:
        return last.audit_cursor, {}
    budget = sum(reuse[k].spec.chunk_nbytes for k, _ in chunks) * AUDIT_FRACTION
    pos, done, audited = last.audit_cursor % len(chunks), 0, {}
    for _ in range(len(chunks)):
        key, i = chunks[pos]
        spec = reuse[key].spec
        # a compressed chunk's crc covers the compressed frame: only its file is checked
        if not spec.compression and _chunk_crc(reuse[key].tensor, spec, i) != spec.crc32c[i]:
            raise _changed(key, last, f"its chunk {i} differs from the one saved (crc32c)")
        audited.setdefault(key, set()).add(i)
        pos, done = (pos + 1) % len(chunks), done + spec.chunk_nbytes
        if done >= budget:
            break
    return pos, audited


@dataclass(frozen=True)
class SavePlan:
    """What ``save`` decided synchronously: the identities of the caller's leaves, the
    leaves to reuse, and where the chunk audit resumes after this save."""

    identities: dict[str, Identity]
    reuse: dict[str, Reuse]
    cursor: int = 0


NO_REUSE = SavePlan({}, {})


def plan_save(
    last: LastCommit | None,
    leaves: dict[str, torch.Tensor],
    chunk_bytes: int,
    compression: str | None,
) -> SavePlan:
    """Identify the caller's leaves, pick the ones to reuse and check them.

    Raises:
        LeafChangedError: a leaf to reuse was changed behind PyTorch's back.
    """
    identities = identify(leaves)
    reuse = plan_reuse(last, leaves, identities, chunk_bytes, compression)
    cursor, audited = check_unchanged(reuse, last)
    reuse = {
        k: dataclasses.replace(r, audit=frozenset(audited[k])) if k in audited else r
        for k, r in reuse.items()
    }
    return SavePlan(identities, reuse, cursor)


def confirm_sources(plan: SavePlan, read_committed) -> SavePlan:
    """``plan`` with only the reuses whose source step still holds the recorded entry.

    Args:
        plan: what ``save`` decided.
        read_committed: ``step -> (marker, manifest)``, cross-checked
            (:func:`ftrain.ckpt.commit.read_committed`).

    A reuse whose source step was replaced, removed or damaged since it was recorded
    keeps its place in the plan with no source (its bytes come from the caller's tensor,
    as for a chunk that cannot be linked), so what :func:`remember` records is unchanged.
    """
    if not plan.reuse:
        return plan
    confirmed: dict[str, Reuse] = {}
    for source in {r.source for r in plan.reuse.values()}:
        arrays, unreadable = _arrays_of(source, read_committed)
        mine = {k: r for k, r in plan.reuse.items() if r.source == source}
        for key, r in mine.items():
            entry = arrays.get(key)
            if entry is not None and ArraySpec.from_json(key, entry) == r.spec:
                confirmed[key] = r
        lost = sum(k not in confirmed for k in mine)
        if unreadable is not None:
            log.warning(
                "could not read %s to link from (%s): %d unchanged leaves are written again",
                source,
                unreadable,
                lost,
            )
        elif lost:
            log.warning(
                "%s no longer holds what this CheckpointManager committed there (another "
                "writer replaced it): %d unchanged leaves are written again instead of "
                "linked; keep other writers off this location",
                source,
                lost,
            )
    reuse = {
        k: confirmed.get(k) or dataclasses.replace(r, source=None) for k, r in plan.reuse.items()
    }
    return dataclasses.replace(plan, reuse=reuse)


def _arrays_of(source, read_committed) -> tuple[dict, Exception | None]:
    """The manifest's arrays of a committed step, and why it could not be read (if not)."""
    try:
        arrays = read_committed(source)[1].get("arrays")
    except (OSError, CorruptCheckpointError, CheckpointFormatError) as e:
        return {}, e
    return (arrays, None) if isinstance(arrays, dict) else ({}, None)


def host_snapshot(
    state: TensorDictBase, leaves: dict[str, torch.Tensor], reuse: dict[str, Reuse]
) -> TensorDictBase:
    """The tree the writer reads: ``state`` itself when every leaf is on the CPU
    (immutable: the writer just holds the reference), else a host copy. Reused leaves on a
    device are not copied: a shape-only ``meta`` tensor stands in (their chunks are linked;
    a chunk that cannot be is written from the caller's tensor, ``Reuse.tensor``)."""
    if all(t.device.type == "cpu" for t in leaves.values()):
        return state
    skip = [k for k in reuse if leaves[k].device.type != "cpu"]
    if not skip:
        return state.to("cpu")
    host = state.exclude(*[tuple(k.split("/")) for k in skip]).to("cpu")
    host = host.unlock_() if host.is_locked else host
    host.clear_device_()  # or a device-bound tree would move the placeholders to the CPU
    for k in skip:
        host[tuple(k.split("/"))] = leaves[k].to("meta")
    return host


def remember(
    last: LastCommit | None,
    step: int,
    step_dir: object,
    manifest: dict,
    written: dict[str, torch.Tensor],
    plan: SavePlan,
) -> LastCommit | None:
    """The :class:`LastCommit` of a step just committed: the identities captured in
    ``save``, the manifest entries, and a fingerprint of the bytes just written (``written``:
    the writer's host leaves); reused leaves keep theirs (their bytes were checked against
    it). ``None`` if nothing was identified (incremental saves off)."""
    if not plan.identities:
        return None
    leaves = {}
    for key, ident in plan.identities.items():
        entry = manifest["arrays"][key]
        if key in plan.reuse:  # its bytes were checked against the old fingerprint
            fingerprint = last.leaves[key].fingerprint
        else:
            fingerprint = sample_fingerprint(written[key])
        leaves[key] = CommittedLeaf(ident, key, entry, fingerprint)
    return LastCommit(step, step_dir, leaves, plan.cursor)


class FallbackBytes:
    """The bytes of a reused leaf's chunk, made on first need (a chunk that could not be
    linked or copied is written from them); thread-safe, one host copy per leaf."""

    def __init__(self, reuse: dict[str, Reuse]) -> None:
        self._reuse = reuse
        self._bytes: dict[str, memoryview] = {}
        self._lock = threading.Lock()

    def chunk(self, key: str, spec: ArraySpec, i: int) -> tuple[memoryview, int]:
        """``(payload, pad)`` of chunk ``i`` (``spec`` as planned for this save)."""
        with self._lock:
            if key not in self._bytes:
                self._bytes[key] = tensor_bytes(self._reuse[key].tensor)
        start, stop = spec.chunk_span(i)
        return self._bytes[key][start:stop], spec.chunk_nbytes - (stop - start)
