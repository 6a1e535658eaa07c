"""``python -m ftrain.ckpt list|show|verify|diff DIR [STEP...]``: inspect checkpoints;
``python -m ftrain.ckpt diff DIR_A[:STEP] DIR_B[:STEP]``: compare two runs.
``python -m ftrain.ckpt advise RUN_DIR [--mtbf 6h]``: advise a checkpoint interval.
``python -m ftrain.ckpt export DIR OUT [--step N] [--format safetensors|hf] [--merge-lora]``.

    python -m ftrain.ckpt list ckpt            # committed steps, bytes, metrics
    python -m ftrain.ckpt show ckpt 400        # metadata and arrays of one step (default: newest)
    python -m ftrain.ckpt show runs/a:400      # DIR:STEP, as export, diff and eval take it
    python -m ftrain.ckpt verify ckpt [400]    # check every chunk's size and crc32c (default: all)
    python -m ftrain.ckpt diff ckpt 300 400    # arrays that differ between two steps
    python -m ftrain.ckpt diff runs/a:300 runs/b:300  # ... of two runs (default: newest step)
    python -m ftrain.ckpt list s3://bucket/ckpt   # the same on object storage (any command)
    python -m ftrain.ckpt advise runs/x --mtbf 6h  # Young/Daly interval from the run's costs
    python -m ftrain.ckpt export ckpt out.safetensors --step 400 --merge-lora
    python -m ftrain.ckpt export ckpt hf-out --format hf  # GPT2LMHeadModel.from_pretrained

Exit status: 0 on success; 1 if the directory is missing or holds no committed step, if
list/verify find a corrupt or marker-less step directory, or if diff finds changes; 2 on
a usage error, a step written in a format this ftrain cannot read, a bad location or a
store error (no such bucket, bad credentials), or a diff of a corrupt step. Steps moved aside (replaced/superseded) are listed by ``list``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import threading
from pathlib import Path

import torch

from ftrain._memory import said_out_of_memory
from ftrain._stdio import run_tool
from ftrain.ckpt import advice_report, advisor
from ftrain.ckpt import commit as protocol
from ftrain.ckpt.format import CheckpointFormatError, CheckpointReadError, CorruptCheckpointError
from ftrain.ckpt.index import byte_count
from ftrain.ckpt.location import (
    CheckpointLocationError,
    CheckpointStoreError,
    is_object_url,
    parse_location,
)
from ftrain.ckpt.meta import read_root_attributes
from ftrain.ckpt.reader import read_tree, specs_of, verify_tree


class _Invalid(dict):
    """``step_*`` directories that are not committed checkpoints, with the reason; the
    marker-less prefixes an object store holds while a save or delete runs (or after one
    failed) are not :attr:`damaged`."""

    def __call__(self, path: Path, why: str) -> None:
        self[path] = why
        print(f"not committed: {path}: {why}", file=sys.stderr)

    @property
    def damaged(self) -> dict:
        return {p: why for p, why in self.items() if not why.endswith(protocol.UNFINISHED)}


def _steps(root: Path, invalid: _Invalid | None = None) -> dict[int, Path]:
    """Committed steps; exits 1 with a message if ``root`` is missing or holds none."""
    if not root.is_dir():
        from ftrain.ckpt.readonly import missing_directory

        raise SystemExit(missing_directory(root))
    steps = protocol.committed_steps(
        root, on_invalid=invalid if invalid is not None else _Invalid()
    )
    if not steps and invalid is None:
        raise SystemExit(_none_at(root))
    return steps


def _none_at(root: Path) -> str:
    """ "no committed checkpoints", with what to pass when ``root`` is one step's directory
    or a run directory whose run saved to another ``checkpoint.dir`` (every command but
    ``export`` said only "no committed checkpoints" there)."""
    from ftrain.ckpt.readonly import moved_aside, saved_elsewhere

    hint = protocol.step_dir_hint(root)
    found = (
        (f" ({hint})" if hint else "") + saved_elsewhere(root) + moved_aside(root, with_step=False)
    )
    return f"{root}: no committed checkpoints{found}"


def _pick(roots, step: int | None) -> tuple[int, Path]:
    """``step`` (default: the newest) in a location, or over a list of a run's locations
    (a step in both is the copy saved last, as a resume reads it)."""
    from ftrain.ckpt.readonly import committed_steps_at, name_of

    roots = roots if isinstance(roots, list) else [roots]
    steps = committed_steps_at(roots) if len(roots) > 1 else _steps(roots[0])
    if not steps:
        raise SystemExit(
            _none_at(roots[0]) if len(roots) == 1 else f"{name_of(roots)}: no committed checkpoints"
        )
    step = max(steps) if step is None else step
    if step not in steps:
        raise SystemExit(
            f"step {step} is not committed in {name_of(roots)}; available: {list(steps)}"
        )
    return step, steps[step]


def _summary(path: Path) -> tuple[str, str]:
    """(bytes, metrics JSON) of a committed step, or raises CorruptCheckpointError. The
    marker's ``bytes`` is a figure for people, under no checksum: anything but a count
    shows as ``?`` (a list or 1e400 there stopped the listing)."""
    marker, manifest = protocol.read_committed(path)
    attrs = read_root_attributes(path, manifest)
    nbytes = byte_count(marker.get("bytes", 0))
    shown = "?" if nbytes is None else f"{nbytes:,}"
    return shown, json.dumps(attrs.get("metrics", {}))


def cmd_list(root: Path, _: list[int]) -> int:
    invalid = _Invalid()
    steps = _steps(root, invalid)
    if not steps:
        raise SystemExit(_none_at(root))
    print(f"{'step':>10}  {'bytes':>14}  metrics")
    bad = 0
    for step, path in steps.items():
        try:
            nbytes, metrics = _summary(path)
            print(f"{step:>10}  {nbytes:>14}  {metrics}")
        except CorruptCheckpointError as e:
            how = _gone_how(root, step, "listing")
            if how is not None:
                print(f"{step:>10}  {'gone':>14}  {how}")
                continue
            bad += 1
            print(f"{step:>10}  {'CORRUPT':>14}  {e}")
    for step, paths in protocol.set_aside_steps(root).items():
        for p in paths:
            print(f"{step:>10}  {'set aside':>14}  {p.name} (kept; not a checkpoint any more)")
    return 1 if bad or invalid.damaged else 0


# how often a reader picks the newest step again after a live run's retention deleted
# the one it was reading (each save of keep_last=1 deletes the step before)
_REPICKS = 5


def _read_picked(roots, step: int | None, read) -> tuple[int, Path, object]:
    """``(step, path, read(path))`` of ``step`` (default: the newest). A step a live run's
    retention deletes while it is read is not corruption (``diff`` and ``show`` called it
    CORRUPT, exit 2): the newest is picked again; a named step is said to be gone."""
    roots = roots if isinstance(roots, list) else [roots]
    for _ in range(_REPICKS):
        got, path = _pick(roots, step)
        try:
            return got, path, read(path)
        except CorruptCheckpointError:
            if any(_gone_how(r, got) is None for r in roots):
                raise
            if step is not None:
                raise SystemExit(
                    f"step {got} was deleted or set aside while it was read (a live run); "
                    "pick a step the run keeps, or leave the step out for the newest"
                ) from None
    raise SystemExit(f"the newest step kept being deleted while it was read ({_REPICKS} times)")


def _shown_parts(path):
    marker, manifest = protocol.read_committed(path)
    return marker, dict(read_root_attributes(path, manifest)), specs_of(manifest)


def cmd_show(roots: list, args: list[int]) -> int:
    try:
        step, path, (marker, attrs, specs) = _read_picked(
            roots, args[0] if args else None, _shown_parts
        )
    except CorruptCheckpointError as e:
        print(f"CORRUPT: {e}")
        return 1
    attrs.pop("host_rng", None)
    print(f"{path}\nmarker: {json.dumps(marker)}\nattributes: {json.dumps(attrs, indent=1)}")
    for key, a in specs.items():
        print(f"  {key:<50} {a.dtype:<10} {list(a.shape)} chunks {list(a.chunk_shape)}")
    return 0


def cmd_verify(root: Path, args: list[int]) -> int:
    invalid = _Invalid()
    steps = _steps(root, invalid)
    if not steps and not invalid:
        raise SystemExit(_none_at(root))
    todo = {s: steps.get(s) for s in args} if args else steps
    bad = 0 if args else len(invalid.damaged)  # a step directory without a valid marker
    tried, verified = set(), 0
    for _ in range(_REPICKS):
        for step, path in todo.items():
            tried.add(step)
            outcome = _verify_one(root, step, path)
            bad, verified = bad + (outcome == "bad"), verified + (outcome == "ok")
        if args or verified:
            break
        # every step went away under a live run: verify what it committed since
        todo = {s: p for s, p in _quiet_steps(root).items() if s not in tried}
        if not todo:
            break
    for path, why in invalid.items() if not args else ():
        print(f"{'BAD ' if path in invalid.damaged else 'left'} {path.name}: {why}")
    if not verified and not bad:  # a monitoring job must not read "ok" for nothing checked
        why = (
            "each was deleted or set aside while it was read; run again"
            if tried
            else ("none is committed here yet")
        )
        print(f"verified no step: {why}")
        return 1
    return 1 if bad else 0


def _verify_one(root: Path, step: int, path: Path | None) -> str:
    """Verify one step and print its line: ``"ok"``, ``"bad"`` or ``"gone"``."""
    try:
        if path is None:
            raise CorruptCheckpointError(f"step {step} is not committed")
        _, manifest = protocol.read_committed(path)
        read_root_attributes(path, manifest)
        print(f"ok   step {step}: {verify_tree(path, manifest):,} bytes verified")
        return "ok"
    except CorruptCheckpointError as e:
        how = _gone_how(root, step, "verifying") if path is not None else None
        if how is not None:
            print(f"gone step {step}: {how}")
            return "gone"
        print(f"BAD  step {step}: {e}")
        return "bad"


def _quiet_steps(root) -> dict:
    """The committed steps, the invalid ones left out unsaid (the first listing said them)."""
    return protocol.committed_steps(root, on_invalid={}.__setitem__)


def _gone_how(root, step: int, doing: str = "reading") -> str | None:
    """How a step that failed to read left the listing: deleted by a live run's retention,
    or set aside by a resume that went back; ``None`` while it is still listed (a damaged
    step stays listed, or is listed as invalid: that is corruption)."""
    invalid: dict = {}  # quietly: the first listing reported the invalid ones
    steps = protocol.committed_steps(root, on_invalid=invalid.__setitem__)
    name = protocol.step_dirname(step)
    why = next((r for p, r in invalid.items() if getattr(p, "name", None) == name), None)
    if step in steps or (why is not None and not _deleting(root, why)):
        return None
    if step in protocol.set_aside_steps(root):
        return f"set aside while {doing} (a resume went back past it; kept, not a checkpoint)"
    return f"deleted while {doing} (a live run's retention)"


def _deleting(root, why: str) -> bool:
    """A step that had its marker when listed, listed again without it on an object store:
    retention and a set-aside delete the marker first, then the rest (one request at a
    time), so this is a delete under way, not damage (a local step leaves in one rename)."""
    return not isinstance(root, Path) and protocol.UNFINISHED in why


def _bits(t):
    return t.reshape(-1).view(torch.uint8)


def _side(spec: str) -> tuple[list, int | None]:
    """``DIR[:STEP]`` -> (checkpoint locations, step); a run directory means its checkpoints/
    and fallback."""
    from ftrain.ckpt.readonly import split_step

    where, step = split_step(spec)
    return _roots(where), step


def _checkpoints_at(where: str):
    """The checkpoint location ``where`` names: a run directory means its ``checkpoints/``."""
    root = parse_location(where)
    if isinstance(root, Path) and (root / "checkpoints").is_dir():
        root = root / "checkpoints"
    return root


def _run_checkpoints(where: str) -> str | list[str]:
    """``where``, or a run directory's checkpoint locations (``checkpoints/`` and the
    fallback the run used: :func:`ftrain.ckpt.readonly.run_locations`). A checkpoint
    directory given as such is read alone (a copy of one, or one set aside by
    ``run.overwrite``, records a fallback that may hold another history now): ``list``
    names the fallback its newest step records (:func:`_fallback_hint`)."""
    from ftrain.ckpt.readonly import locations_of

    return where if is_object_url(where) else locations_of(where)


def _roots(where: str) -> list:
    """The checkpoint locations ``where`` names, parsed: one, or a run directory's
    ``checkpoints/`` and the fallback it used."""
    found = _run_checkpoints(where)
    roots = [_checkpoints_at(w) for w in (found if isinstance(found, list) else [found])]
    for root in roots:
        if not isinstance(root, Path):
            root.probe()  # an endpoint that does not answer: said in seconds, not minutes
    return roots


def _each_location(cmd, roots: list, steps: list[int]) -> int:
    """``list``/``verify`` of one location, or of each of a run's locations under a
    heading (its primary, then the fallback its saves went to when the disk was full):
    reading only ``checkpoints/`` showed an older step as the newest. Named steps are
    verified where they are; the exit status is the worst; a location holding nothing
    is said so, and is an error only when no location holds anything."""
    if len(roots) == 1:
        return cmd(roots[0], steps)
    status, held = 0, set()
    for i, root in enumerate(roots):
        print(f"== {root}{' (fallback)' if i else ''}")
        invalid: dict = {}
        here = (
            protocol.committed_steps(root, on_invalid=invalid.__setitem__) if root.is_dir() else {}
        )
        held |= set(here)
        mine = [s for s in steps if s in here]
        if not (here or invalid) or (steps and not mine):
            print(
                "no committed steps" + _elsewhere(root, i)
                if not steps
                else "none of the steps named"
            )
            continue
        status = max(status, cmd(root, mine))
    if not held:
        raise SystemExit(f"{' + '.join(map(str, roots))}: no committed checkpoints")
    for step in sorted(set(steps) - held):
        print(f"BAD  step {step}: not committed in any of the run's locations")
        status = 1
    return status


def _elsewhere(root, i: int) -> str:
    """For a run directory's own place holding nothing: the ``checkpoint.dir`` elsewhere its
    records name (its steps before the saves went to the fallback)."""
    from ftrain.ckpt.readonly import saved_elsewhere

    return saved_elsewhere(root) if i == 0 else ""


def _diff_args(args: list[str]) -> tuple[tuple[list, int | None], tuple[list, int | None]]:
    """``DIR A B`` (two steps of one directory) or ``DIR_A[:STEP] DIR_B[:STEP]``."""
    if len(args) == 3 and all(a.isdigit() for a in args[1:]):
        roots = _roots(args[0])
        return (roots, int(args[1])), (roots, int(args[2]))
    if len(args) == 2 and not (args[1].isdigit() and not Path(args[1]).exists()):
        return _side(args[0]), _side(args[1])
    print(
        "python -m ftrain.ckpt: diff needs two steps of one directory or two directories: "
        "diff DIR STEP_A STEP_B, or diff DIR_A[:STEP] DIR_B[:STEP] (default: newest step)",
        file=sys.stderr,
    )
    raise SystemExit(2)  # a usage error, as argparse's (1 means "they differ")


def _label(roots: list, step: int, other: list) -> str:
    return str(step) if roots == other else f"{' + '.join(map(str, roots))}:{step}"


def cmd_diff(argv: list[str]) -> int:
    (ra, sa), (rb, sb) = _diff_args(argv)
    try:
        sa, _, a = _read_picked(ra, sa, _verified_tree)
        sb, _, b = _read_picked(rb, sb, _verified_tree)
    except CorruptCheckpointError as e:
        print(f"cannot diff: CORRUPT: {e}")
        return 2
    changed = sum(_diff_line(k, a, b) for k in sorted(set(a.keys()) | set(b.keys())))
    total = len(set(a.keys()) | set(b.keys()))
    print(
        f"{changed} of {total} arrays differ between {_label(ra, sa, rb)} and {_label(rb, sb, ra)}"
    )
    return 1 if changed else 0


def _verified_tree(path):
    """A step's arrays, read as restore reads them: the root ``zarr.json`` checked against
    the manifest too (a damaged one made ``diff`` compare a step every other command calls
    corrupt, and exit as if it were fine)."""
    manifest = protocol.read_committed(path)[1]
    read_root_attributes(path, manifest)
    return read_tree(path, manifest).flatten_keys("/")


def _diff_line(k: str, a, b) -> bool:
    """Print how array ``k`` differs between trees ``a`` and ``b``; whether it does."""
    if k not in a or k not in b:
        print(f"{'+' if k in b else '-'} {k}")
    elif a[k].shape != b[k].shape or a[k].dtype != b[k].dtype:
        print(f"~ {k}: {a[k].dtype}{tuple(a[k].shape)} -> {b[k].dtype}{tuple(b[k].shape)}")
    elif not _bits(a[k]).equal(_bits(b[k])):
        print(f"~ {k}: values differ ({_how_far(a[k], b[k])})")
    else:
        return False
    return True


def _how_far(x, y) -> str:
    """How many elements of two same-shape, same-dtype arrays differ, and by how much at
    most: exact for integers (Python ints: int64 extremes and uint64 do not wrap), float64
    for floats, ``|x - y|`` for complex; a bool difference gives the count alone (a
    bit-only one, ``-0.0`` against ``0.0``, counts, with a max abs diff of 0.0)."""
    x, y = x.reshape(-1), y.reshape(-1)
    per = x.element_size()
    differ = (_bits(x).view(-1, per) != _bits(y).view(-1, per)).any(dim=1)
    count = f"{int(differ.sum()):,} of {x.numel():,} elements"
    if x.dtype == torch.bool:
        return count
    xs, ys = x[differ], y[differ]
    if x.is_complex():
        far = (xs.to(torch.complex128) - ys.to(torch.complex128)).abs().max().item()
    elif x.is_floating_point():
        far = (xs.double() - ys.double()).abs().max().item()
    else:
        far = max(abs(int(p) - int(q)) for p, q in zip(xs.tolist(), ys.tolist(), strict=True))
    return f"{count}, max abs diff {far}"


def cmd_advise(run_dir: Path, mtbf_s: float | None) -> int:
    try:
        advice = advisor.advise(advisor.measure(run_dir), mtbf_s)
    except advisor.AdvisorError as e:
        raise SystemExit(f"cannot advise: {e}") from None
    print(advice_report.render(advice))
    return 0


def _duration(text: str) -> float:
    try:
        return advisor.parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@contextlib.contextmanager
def _terminate_unwinds():
    """SIGTERM/SIGHUP/SIGQUIT/SIGUSR1 (the trainer's stop signals: torchrun's, Slurm's
    ``--signal=USR1``) as ``SystemExit(128 + signal)`` for the block, and Ctrl-C as
    ``SystemExit(130)`` with no traceback: their default action ended the process where it
    stood, leaving a model-sized staging file behind (the ``finally`` that removes it never
    ran). Main thread only (signals are set there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum, frame):
        raise SystemExit(128 + signum)

    sigs = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGINT)
    # one ignored on purpose (nohup's SIGHUP, a background job's SIGINT) stays ignored
    previous = {s: signal.signal(s, unwind) for s in sigs if signal.getsignal(s) != signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_export(argv: list[str]) -> int:
    """``export DIR OUT [--step N] [--format safetensors|hf] [--merge-lora] [--lora-alpha A]``."""
    from ftrain.ckpt.export import ExportError, export_params

    p = argparse.ArgumentParser(
        prog="python -m ftrain.ckpt export",
        description="write a step's params and buffers to a safetensors file, or (--format hf) "
        "to a directory transformers.GPT2LMHeadModel.from_pretrained loads",
    )
    p.add_argument("directory", help="a checkpoint directory or URL (s3://bucket/prefix)")
    p.add_argument("out", help="the .safetensors file or (hf) directory to write (must not exist)")
    p.add_argument("--step", type=int, help="the step (default: the newest that verifies)")
    p.add_argument("--format", choices=["safetensors", "hf"], default="safetensors")
    p.add_argument("--merge-lora", action="store_true", help="fold LoRA adapters into W")
    p.add_argument(
        "--lora-alpha",
        type=float,
        help="with --merge-lora: alpha for a run that recorded none (a recorded one is used)",
    )
    ns = p.parse_args(argv)
    if not ns.out.strip():
        p.error(f"OUT={ns.out!r} is empty: name the .safetensors file or (hf) directory to write")
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", ns.out) and not os.path.exists(ns.out):
        # s3://b/x.safetensors wrote a local ./s3:/b/x.safetensors and said "exported"
        print(
            f"python -m ftrain.ckpt export: OUT={ns.out!r} looks like a URL; export writes a "
            "local file or directory (copy it to object storage afterwards)",
            file=sys.stderr,
        )
        return 2
    from ftrain.ckpt.readonly import split_step

    where, step = split_step(ns.directory)  # DIR:STEP, as eval, diff and init.from take it
    if step is not None and ns.step is not None and step != ns.step:
        p.error(f"{ns.directory} names step {step} but --step is {ns.step}: give one")
    try:
        with _terminate_unwinds():
            done = export_params(
                _run_checkpoints(where),
                ns.out,
                step=ns.step if step is None else step,
                merge_lora=ns.merge_lora,
                lora_alpha=ns.lora_alpha,
                format=ns.format,
            )
    except (ExportError, FileNotFoundError, CorruptCheckpointError) as e:
        print(f"python -m ftrain.ckpt export: {e}", file=sys.stderr)
        return 2 if isinstance(e, ExportError | CorruptCheckpointError) else 1
    merged = f", {len(done['merged'])} LoRA modules merged" if done["merged"] else ""
    print(
        f"exported step {done['step']}: {done['tensors']} tensors, {done['bytes']:,} bytes{merged} -> {ns.out}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except Exception as e:
        if not said_out_of_memory("python -m ftrain.ckpt", e):
            raise
        return 1


def _main(argv: list[str]) -> int:
    if argv[:1] in (["export"], ["diff"]):
        try:
            return cmd_export(argv[1:]) if argv[0] == "export" else cmd_diff(argv[1:])
        except _TOOL_ERRORS as e:
            return _failed(e)
    p = argparse.ArgumentParser(prog="python -m ftrain.ckpt", description=_FIRST_DOC_LINE)
    p.add_argument("command", choices=["list", "show", "verify", "diff", "advise", "export"])
    p.add_argument("directory", help="a checkpoint directory or URL (s3://bucket/prefix)")
    p.add_argument("steps", type=int, nargs="*")
    p.add_argument("--mtbf", type=_duration, help="advise: mean time between failures (6h)")
    ns = p.parse_args(argv)
    _take_colon_step(p, ns)
    _check_step_count(p, ns)
    if ns.command == "advise":
        try:
            return cmd_advise(Path(ns.directory), ns.mtbf)
        except PermissionError as e:
            return _failed(e)
    try:
        roots = _roots(ns.directory)
        if ns.command == "show":
            return cmd_show(roots, ns.steps)
        if ns.command == "list":
            status = _each_location(cmd_list, roots, [])
            _fallback_hint(roots)
            return status
        return _each_location(cmd_verify, roots, ns.steps)
    except _TOOL_ERRORS as e:
        return _failed(e)


def _fallback_hint(roots: list) -> None:
    """A checkpoint directory (not a run directory) whose newest step records a
    ``checkpoint.fallback_dir`` holding steps: named, since saves may have gone there (a
    full disk) and its steps are not listed here."""
    from ftrain.ckpt.readonly import _recorded_fallback

    if len(roots) != 1 or not isinstance(roots[0], Path):
        return
    fallback = _recorded_fallback(roots[0])
    if fallback and Path(fallback).is_absolute() and protocol.committed_steps(Path(fallback)):
        print(
            f"note: the newest step here records checkpoint.fallback_dir={fallback}, which "
            "holds steps too (saves go there when this location fails): list it, or pass "
            "the run directory to see both"
        )


_TOOL_ERRORS = (
    CheckpointFormatError,
    CheckpointLocationError,
    CheckpointStoreError,
    CheckpointReadError,
    PermissionError,  # a run directory of another user's (a traceback from pathlib before)
)


def _failed(e: Exception) -> int:
    """One line; exit 1 for a limit of this machine (retry), 2 otherwise."""
    print(f"python -m ftrain.ckpt: {e}", file=sys.stderr)
    return 1 if isinstance(e, CheckpointReadError) and not isinstance(e, PermissionError) else 2


def _take_colon_step(p: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """``show DIR:STEP`` / ``verify DIR:STEP``, as export, eval, diff and init.from take
    it (it was "looks like a URL but is not one")."""
    from ftrain.ckpt.readonly import split_step

    if ns.command not in ("show", "verify", "list"):
        return
    where, step = split_step(ns.directory)
    if step is None:
        return
    if ns.steps and ns.steps != [step]:
        p.error(f"{ns.directory} names step {step} but the steps given are {ns.steps}: give one")
    ns.directory, ns.steps = where, [step]


def _check_step_count(p: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Steps only where the command reads them: ``show DIR 4 2`` showed step 4 and dropped
    the 2 without a word, ``list DIR 4`` listed every step."""
    if ns.command == "advise" and ns.steps:
        p.error("advise takes a run directory only (python -m ftrain.ckpt advise RUN_DIR)")
    if ns.command == "advise" and is_object_url(ns.directory):  # read as s3:/b/run before
        p.error(
            f"advise reads a run's local records (run.dir), not its checkpoints: give the "
            f"run directory of the run that saved to {ns.directory}"
        )
    if ns.command == "list" and ns.steps:
        p.error("list takes no step: it lists them all (show DIR STEP, verify DIR STEP...)")
    if ns.command == "show" and len(ns.steps) > 1:
        p.error(f"show takes one step, got {ns.steps}: run it once per step")
    if ns.mtbf is not None and ns.command != "advise":
        p.error(
            f"--mtbf is advise's (python -m ftrain.ckpt advise RUN_DIR --mtbf=6h), not {ns.command}'s"
        )


# `python -OO` strips docstrings (``__doc__`` is None: the tool failed before its work)
_FIRST_DOC_LINE = (__doc__ or "inspect checkpoints").splitlines()[0]


if __name__ == "__main__":
    sys.exit(run_tool(main, "ftrain.ckpt"))
