"""A step's root metadata (``zarr.json`` attributes), checksummed and type-checked.

Everything a restore trusts from the root attributes — the step, the metrics, the host
RNG states, and whatever the caller stored (config, schedule horizon, data fingerprint,
layout) — is covered by the crc32c recorded in the manifest (itself covered by the
``COMMITTED`` marker). A mismatch, or a reserved field of the wrong type, is corruption:
restore falls back to an older step.
"""

from __future__ import annotations

import math
import platform
from importlib import metadata as importlib_metadata
from pathlib import Path

import numpy as np
import torch

from ftrain.ckpt.format import CorruptCheckpointError, read_json
from ftrain.ckpt.reader import doc_checksum

__all__ = ["json_scalar", "read_root_attributes", "versions"]

# reserved attribute -> the JSON types it may have
_TYPES: dict[str, tuple[type, ...]] = {
    "format_version": (int,),
    "step": (int,),
    "time": (int, float),
    "metrics": (dict,),
    "versions": (dict,),
    "host_rng": (dict,),
}


def read_root_attributes(step_dir: Path, manifest: dict) -> dict:
    """The root group's attributes of a committed step, verified.

    Args:
        step_dir: the committed step directory.
        manifest: its parsed, marker-checked manifest.

    Returns:
        The attributes (a dict).

    Raises:
        CorruptCheckpointError: the document does not match its checksum, is not a group,
            or a reserved field has the wrong type or disagrees with the manifest's step.
    """
    checksum = doc_checksum(manifest, "zarr.json")
    if isinstance(step_dir, Path):
        doc = read_json(step_dir / "zarr.json", checksum=checksum)
    else:  # an object-store step (ftrain.ckpt.objstore)
        doc = step_dir.read_document("zarr.json", checksum=checksum)
    where = f"{step_dir}/zarr.json"
    attrs = doc.get("attributes")
    if doc.get("node_type") != "group" or not isinstance(attrs, dict):
        raise CorruptCheckpointError(f"{where}: not a group with attributes")
    for name, types in _TYPES.items():
        value = attrs.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise CorruptCheckpointError(
                f"{where}: attribute {name!r} is {value!r}, "
                f"expected {' or '.join(t.__name__ for t in types)}"
            )
    if attrs.get("step", manifest.get("step")) != manifest.get("step"):
        raise CorruptCheckpointError(f"{step_dir}: root attributes name another step")
    return attrs


def json_scalar(v: object) -> object:
    """A metric value as JSON (a 0-d tensor as its number; non-finite as a string)."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:  # .item() raised a bare RuntimeError from the background writer
            raise ValueError(
                f"a metric must be a number or a one-element tensor, got shape {tuple(v.shape)}"
                "; log its mean (or each element under a name of its own)"
            )
        v = v.item()
    elif isinstance(v, np.generic):  # np.float32(0.5): "not JSON serializable" in the writer
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "nan" / "inf": JSON has no non-finite numbers
    return v


def versions() -> dict:
    """The ``versions`` attribute: ftrain, torch and Python versions of the writer."""
    try:
        ftrain_version = importlib_metadata.version("ftrain")
    except importlib_metadata.PackageNotFoundError:
        ftrain_version = "unknown"
    return {
        "ftrain": ftrain_version,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
