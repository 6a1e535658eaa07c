"""Export a checkpoint's parameters to safetensors or an HF directory (``ckpt export``).

Params and module buffers (no optimizer state, step, cursor or RNG), named by their dotted
paths, which are the model's ``state_dict()`` names (a tied weight appears once, under its first name,
as safetensors' ``save_model`` writes it; its ``load_model`` loads it
back into a model with the tie). Dtypes are kept: bf16 stays bf16.

``merge_lora=True`` folds LoRA adapters into their base weights (``W + (alpha/rank) B A``,
:func:`ftrain.lora.merge`) and leaves them out, so the file loads into the plain model.
``alpha`` is the run's recorded ``model.lora.alpha`` unless given; ``rank`` is read from
the adapters' shapes. The checkpoint is only read: its directory is never changed.

``format="hf"`` (gpt2 recipe) writes a directory that ``transformers``'
``GPT2LMHeadModel.from_pretrained`` loads: ``config.json`` built from the run's recorded
``model.*`` numbers (never code) and ``model.safetensors`` in HF's names and Conv1D layout
(:mod:`ftrain.recipes.gpt2.hf`; the tied ``lm_head`` is left out, HF re-ties it). LoRA
runs need ``merge_lora=True`` here: HF GPT-2 has no place for adapters.
"""

from __future__ import annotations

import errno
import glob
import json
import math
import os
import shutil
from pathlib import Path

import torch

from ftrain._umask import plain_file_mode
from ftrain.ckpt.commit import _pid_alive
from ftrain.ckpt.location import CheckpointLocationError
from ftrain.ckpt.readonly import read_model, read_subtree
from ftrain.lora import merge
from ftrain.recipes.gpt2.hf import HFFormatError, hf_config, to_hf_names
from ftrain.state.tree import flatten, path_str

__all__ = ["ExportError", "export_params"]


class ExportError(ValueError):
    """The export cannot be done as asked (the message says why and what to do)."""


def _safetensors():
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ExportError(
            "export needs the safetensors package: pip install 'ftrain[export]'"
        ) from None
    return save_file


def recorded_alpha(attrs: dict) -> float | None:
    """``model.lora.alpha`` from a checkpoint's recorded config (a number, or None; None
    also where the recorded ``model.lora.rank`` is 0: the default alpha of a run without
    LoRA says nothing about adapters a custom model carries itself)."""
    lora = attrs.get("config")
    for key in ("model", "lora"):
        lora = lora.get(key) if isinstance(lora, dict) else None
    rank = lora.get("rank") if isinstance(lora, dict) else None
    if not (isinstance(rank, int) and rank > 0):
        return None
    node = lora.get("alpha")
    ok = isinstance(node, int | float) and not isinstance(node, bool) and math.isfinite(node)
    return float(node) if ok and node > 0 else None


def _check_alpha(alpha: float | None) -> None:
    """A given LoRA alpha is a finite number > 0 (nan, inf, 0 or below would merge NaN,
    infinite or no adapters without a word)."""
    if alpha is not None and not (
        isinstance(alpha, int | float) and math.isfinite(alpha) and alpha > 0
    ):
        raise ExportError(
            f"--lora-alpha {alpha!r} must be a finite number > 0 (the run's model.lora.alpha)"
        )


def _merge_alpha(step: int, given: float | None, recorded: float | None) -> float | None:
    """The alpha to merge with: the run's own; ``--lora-alpha`` only where it recorded none
    (a different one would merge wrongly scaled weights without a word)."""
    if given is not None and recorded is not None and given != recorded:
        raise ExportError(
            f"--lora-alpha {given:g}: step {step} was trained with model.lora.alpha="
            f"{recorded:g}; drop --lora-alpha (the recorded alpha is used)"
        )
    return recorded if recorded is not None else given


def _scalings(params, alpha: float) -> dict[str, float]:
    """``{module: alpha / rank}`` with each module's rank from its ``lora_A`` rows."""
    keys, leaves = flatten(params)
    return {
        path_str(k).rsplit(".", 1)[0]: alpha / t.shape[0]
        for k, t in zip(keys, leaves, strict=True)
        if path_str(k).endswith(".lora_A") and t.ndim == 2 and t.shape[0] > 0
    }


def _params(location, step, merge_lora, lora_alpha, with_buffers: bool):
    """``(step, {name: tensor}, root attributes, merged modules)`` of the step to export:
    params, and with ``with_buffers`` the module buffers (a BatchNorm's running statistics
    are ``state_dict()`` entries: without them a strict load fails, a loose one computes
    with fresh statistics)."""
    try:
        if with_buffers:
            got, tree, attrs = read_model(location, step)
        else:
            got, tree, attrs = read_subtree(location, step, only=("params",))
    except CheckpointLocationError:  # DIR that reads as a URL: its own message says why
        raise
    except ValueError as err:  # no params group: a state saved by other code
        raise ExportError(f"{location}: {err}; export writes a model's params") from None
    params = tree["params"]
    merged = []
    if merge_lora:
        alpha = _merge_alpha(got, lora_alpha, recorded_alpha(attrs))
        scalings = _scalings(params, alpha or 0.0)
        if not scalings:
            raise ExportError(f"--merge-lora: step {got} has no LoRA adapters (no *.lora_A)")
        if alpha is None:
            raise ExportError(
                f"--merge-lora: step {got} records no model.lora.alpha; pass --lora-alpha"
            )
        try:
            params, merged = merge(params, scalings), sorted(scalings)
        except ValueError as err:  # a tied or malformed adapter: named, not a traceback
            raise ExportError(f"--merge-lora: step {got}: {err}") from None
    tensors, paths = {}, {}
    for tree_part in (params, tree.get("buffers")) if with_buffers else (params,):
        if tree_part is not None:
            keys, leaves = flatten(tree_part)
            for k, t in zip(keys, leaves, strict=True):
                _add_named(tensors, paths, k, t, got)
    return got, tensors, attrs, merged


def _add_named(tensors: dict, paths: dict, key: tuple, t: torch.Tensor, step: int) -> None:
    """``tensors[name] = t`` under its ``state_dict()`` name, refusing what the file cannot
    hold as such: two key paths with one dotted name (``a``/``b.c`` and ``a.b``/``c``: the
    second replaced the first, "exported" with one tensor fewer)."""
    name = path_str(key)
    if name in paths:
        raise ExportError(
            f"step {step}: tensors {'/'.join(paths[name])!r} and {'/'.join(key)!r} both export "
            f"as {name!r} (state_dict names join keys with '.'); rename one of them"
        )
    paths[name] = key
    tensors[name] = t.contiguous()


def export_params(
    location: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    merge_lora: bool = False,
    lora_alpha: float | None = None,
    format: str = "safetensors",
) -> dict:
    """Write ``step``'s params (default: the newest that verifies) to ``out``.

    Args:
        format: ``"safetensors"`` (one file, the model's ``state_dict()`` names) or ``"hf"``
            (a directory ``GPT2LMHeadModel.from_pretrained`` loads; gpt2 recipe only).

    Returns:
        ``{"step", "tensors", "bytes", "merged"}`` (``merged``: adapted modules folded).

    Raises:
        ExportError: nothing to merge, no alpha known, safetensors missing, ``out`` exists,
            or (``hf``) a run that is not the gpt2 recipe, has unmerged adapters or no biases.
        FileNotFoundError / CorruptCheckpointError: as :func:`read_subtree`.

    Example:
        >>> export_params("runs/x/checkpoints", "x.safetensors", step=400)  # doctest: +SKIP
    """
    if format not in ("safetensors", "hf"):
        raise ExportError(f"format={format!r} is unknown; use safetensors or hf")
    _check_alpha(lora_alpha)
    if lora_alpha is not None and not merge_lora:
        raise ExportError("--lora-alpha applies only with --merge-lora (nothing is merged)")
    save_file = _safetensors()
    if format == "safetensors" and str(out).endswith(("/", os.sep)):  # Path() drops the "/"
        raise ExportError(
            f"{out} names a directory, but a safetensors export is one file: give a file "
            f"path such as {Path(out) / 'model.safetensors'}, or --format hf for a directory"
        )
    out = Path(out)
    _refuse_inside(out, location)
    if out.exists():
        raise ExportError(f"{out} exists; export never overwrites, pick another path")
    if out.parent.exists() and not out.parent.is_dir():
        raise ExportError(f"{out.parent} is not a directory; pick an output path in one")
    # HF GPT-2 has no persistent buffers of ours to take (its own masks are built)
    got, tensors, attrs, merged = _params(location, step, merge_lora, lora_alpha, format != "hf")
    try:
        if format == "hf":
            nbytes = _write_hf(out, tensors, attrs, got, save_file)
        else:
            nbytes = _write_file(out, tensors, got, save_file)
    except OSError as err:  # a full disk, a file size limit, EIO: no half an export is left
        raise ExportError(f"writing {out} failed: {err}") from None
    return {"step": got, "tensors": len(tensors), "bytes": nbytes, "merged": merged}


def _refuse_inside(out: Path, location) -> None:
    """``out`` inside a checkpoint location read from: an export into a committed step was
    a file the step's manifest does not list (``verify`` failed it), and the next
    retention deleted the step with the export in it, or set it aside."""
    for root in location if isinstance(location, list) else [location]:
        if "://" in str(root):
            continue
        base, there = Path(root).resolve(), out.resolve()
        if there == base or base in there.parents:
            raise ExportError(
                f"{out} is inside the checkpoint directory {root}: retention deletes what is "
                "there with the steps, and a step holding it no longer verifies; export "
                "outside it (e.g. beside the run directory)"
            )


def _stage_dir(out: Path) -> Path:
    """A hidden staging directory beside ``out`` for this process (safetensors' own
    temporary file lands inside it too), after removing those of exports to ``out`` that
    died (SIGKILL: no ``finally`` ran) on this host. Hidden, so a leftover is never taken
    for a finished export; swept, so it does not keep a model's worth of disk."""
    out.parent.mkdir(parents=True, exist_ok=True)
    # a legal name of 250 bytes made a stage name past NAME_MAX: ENAMETOOLONG, refused
    prefix = os.fsencode(out.name)[:200].decode(errors="ignore")
    for old in out.parent.glob(f".{glob.escape(prefix)}.tmp-*"):
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    stage = out.with_name(f".{prefix}.tmp-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)  # a dead export's, whose pid this one reuses
    stage.mkdir()
    return stage


def _write_file(out: Path, tensors: dict, step: int, save_file) -> int:
    """One safetensors file, written in a staging directory beside ``out`` and linked into
    place only if ``out`` still does not exist (two exports to one path: one wins, the
    other is refused)."""
    stage = _stage_dir(out)
    try:
        _save(save_file, tensors, stage / out.name, step)
        _place(stage / out.name, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out.stat().st_size


def _place(stage: Path, out: Path) -> None:
    """``stage`` at ``out`` unless ``out`` exists: a hard link (atomic, create-only), or on
    a filesystem without them (vfat, FUSE mounts of object stores) an exclusively created
    placeholder replaced by the file."""
    taken = f"{out} exists; export never overwrites, pick another path"
    try:
        os.link(stage, out)
        return
    except FileExistsError:
        raise ExportError(taken) from None
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
    try:
        os.close(os.open(out, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        raise ExportError(taken) from None
    os.replace(stage, out)


def _save(save_file, tensors: dict, path: Path, step: int) -> None:
    """``save_file`` with the mode the umask gives (safetensors writes 0600: a serving
    process of another user could not read the model) and its errors as ``OSError``."""
    from safetensors import SafetensorError

    try:
        save_file(tensors, str(path), metadata={"format": "pt", "ftrain_step": str(step)})
    except SafetensorError as err:  # an I/O error inside the Rust writer
        raise OSError(str(err)) from None
    except KeyError as err:  # a dtype safetensors has no name for (complex32, complex128...)
        dtype = err.args[0] if err.args else None
        names = [n for n, t in tensors.items() if t.dtype == dtype] or ["?"]
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        raise ExportError(
            f"step {step}: tensor {names[0]!r}{more} is {dtype}, which safetensors cannot "
            "hold; save the state with a dtype it has (float32, complex64, ...) to export it"
        ) from None
    os.chmod(path, plain_file_mode())


def _recorded_model(attrs: dict, step: int) -> dict:
    model = (attrs.get("config") or {}).get("model")
    if not isinstance(model, dict) or model.get("name") != "gpt2":
        name = model.get("name") if isinstance(model, dict) else None
        raise ExportError(
            f"--format hf writes GPT2LMHeadModel directories for the gpt2 recipe; step {step} "
            f"records model.name={name!r}: export with --format safetensors"
        )
    return model


def _write_hf(out: Path, tensors: dict, attrs: dict, step: int, save_file) -> int:
    """``out/config.json`` + ``out/model.safetensors`` (HF names, Conv1D layout); returns
    their bytes. Written into a staging directory renamed at the end: no half an export."""
    adapters = [k for k in tensors if ".lora_" in k]
    if adapters:
        raise ExportError(
            f"step {step} has LoRA adapters ({adapters[0]}, ...), which GPT2LMHeadModel has "
            "no place for: add --merge-lora"
        )
    wte = tensors.get("transformer.wte.weight")
    try:
        config = hf_config(_recorded_model(attrs, step), getattr(wte, "dtype", torch.float32))
    except HFFormatError as err:
        raise ExportError(f"--format hf: {err}") from None
    stage = _stage_dir(out)
    try:
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _save(save_file, to_hf_names(tensors), stage / "model.safetensors", step)
        nbytes = sum(f.stat().st_size for f in stage.iterdir())
        stage.rename(out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return nbytes
