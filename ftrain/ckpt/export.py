"""Export a checkpoint's parameters to a safetensors file (``python -m ftrain.ckpt export``).

Params only (no optimizer state, step, cursor or RNG), named by their dotted paths, which
are the model's ``state_dict()`` names (a tied weight appears once, under its first name,
as ``safetensors.torch.save_model`` writes it; ``safetensors.torch.load_model`` loads it
back into a model with the tie). Dtypes are kept: bf16 stays bf16.

``merge_lora=True`` folds LoRA adapters into their base weights (``W + (alpha/rank) B A``,
:func:`ftrain.lora.merge`) and leaves them out, so the file loads into the plain model.
``alpha`` is the run's recorded ``model.lora.alpha`` unless given; ``rank`` is read from
the adapters' shapes. The checkpoint is only read: its directory is never changed.
"""

from __future__ import annotations

import math
from pathlib import Path

from ftrain.ckpt.readonly import read_subtree
from ftrain.lora import merge
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
    """``model.lora.alpha`` from a checkpoint's recorded config (a number, or None)."""
    node = attrs.get("config")
    for key in ("model", "lora", "alpha"):
        node = node.get(key) if isinstance(node, dict) else None
    ok = isinstance(node, int | float) and not isinstance(node, bool) and math.isfinite(node)
    return float(node) if ok and node > 0 else None


def _scalings(params, alpha: float) -> dict[str, float]:
    """``{module: alpha / rank}`` with each module's rank from its ``lora_A`` rows."""
    keys, leaves = flatten(params)
    return {
        path_str(k).rsplit(".", 1)[0]: alpha / t.shape[0]
        for k, t in zip(keys, leaves, strict=True)
        if path_str(k).endswith(".lora_A") and t.ndim == 2 and t.shape[0] > 0
    }


def export_params(
    location: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    merge_lora: bool = False,
    lora_alpha: float | None = None,
) -> dict:
    """Write ``step``'s params (default: the newest that verifies) to ``out`` (safetensors).

    Returns:
        ``{"step", "tensors", "bytes", "merged"}`` (``merged``: adapted modules folded).

    Raises:
        ExportError: nothing to merge, no alpha known, safetensors missing, ``out`` exists.
        FileNotFoundError / CorruptCheckpointError: as :func:`read_subtree`.
    """
    save_file = _safetensors()
    out = Path(out)
    if out.exists():
        raise ExportError(f"{out} exists; export never overwrites, pick another path")
    got, tree, attrs = read_subtree(location, step, only=("params",))
    params = tree["params"]
    merged = []
    if merge_lora:
        alpha = lora_alpha if lora_alpha is not None else recorded_alpha(attrs)
        scalings = _scalings(params, alpha or 0.0)
        if not scalings:
            raise ExportError(f"--merge-lora: step {got} has no LoRA adapters (no *.lora_A)")
        if alpha is None:
            raise ExportError(
                f"--merge-lora: step {got} records no model.lora.alpha; pass --lora-alpha"
            )
        params, merged = merge(params, scalings), sorted(scalings)
    keys, leaves = flatten(params)
    tensors = {path_str(k): t.contiguous() for k, t in zip(keys, leaves, strict=True)}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"format": "pt", "ftrain_step": str(got)})
    return {"step": got, "tensors": len(tensors), "bytes": out.stat().st_size, "merged": merged}
