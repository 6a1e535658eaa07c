"""GPT-2 weights to and from Hugging Face ``transformers``' layout (without transformers).

HF's ``GPT2LMHeadModel`` stores the four projections of a block (``attn.c_attn``,
``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``) as ``Conv1D`` modules whose weight is
``[in, out]``; ftrain's :class:`~ftrain.recipes.gpt2.GPT` uses ``nn.Linear`` (``[out, in]``),
as nanoGPT does. Both directions transpose exactly those four weights. Why this module
exists at all: ``attn.c_proj`` is square (``[n_embd, n_embd]``), so a load that forgets the
transpose fits every shape check and computes garbage (the tests compare logits).

Names: HF files say ``transformer.h.0.attn.c_attn.weight`` (``GPT2LMHeadModel``) or
``h.0.attn.c_attn.weight`` (``GPT2Model``, the original hub files); both map to ftrain's
``transformer.h.0.attn.c_attn.weight``. ``h.N.attn.bias`` / ``h.N.attn.masked_bias`` in
older files are the causal-mask buffers, not parameters, and are dropped. ``lm_head.weight``
is tied to ``transformer.wte.weight`` (ftrain ties by structure): it is dropped on the way
in after checking it equals the embedding, and left out on the way out (HF re-ties it, as
its own ``save_pretrained`` does with ``tie_word_embeddings=true``).

Files are read with ``safetensors`` only; a ``pytorch_model.bin`` is a pickle and is
refused, never opened.

Example:
    >>> import torch
    >>> hf = {"h.0.attn.c_proj.weight": torch.arange(4.0).view(2, 2)}
    >>> from_hf_names(hf)["transformer.h.0.attn.c_proj.weight"].tolist()
    [[0.0, 2.0], [1.0, 3.0]]
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path

import torch

__all__ = [
    "HFFormatError",
    "from_hf_names",
    "gpt_fields_from_hf",
    "hf_config",
    "infer_fields",
    "read_hf",
    "to_hf_names",
]

# the Conv1D weights of HF GPT-2 (``[in, out]``); every other tensor has the same layout
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# causal-mask buffers some HF files carry (``.attn.bias`` cannot match ``c_attn.bias``)
_BUFFERS = (".attn.bias", ".attn.masked_bias")
# GELU with the tanh approximation: what ftrain's MLP computes
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_FIELDS = {"n_positions": "block_size", "vocab_size": "vocab_size", "n_layer": "n_layer"}


class HFFormatError(ValueError):
    """A Hugging Face GPT-2 file or config ftrain cannot load (the message says why)."""


def _is_conv1d(name: str) -> bool:
    return name.endswith(CONV1D)


def from_hf_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF GPT-2 tensors -> ftrain GPT parameter names and ``nn.Linear`` layout.

    Raises:
        HFFormatError: ``lm_head.weight`` differs from the token embedding (an untied
            head, which ftrain's structurally tied GPT cannot hold).
    """
    out: dict[str, torch.Tensor] = {}
    head = None
    for name, t in tensors.items():
        if name == "lm_head.weight":
            head = t
            continue
        key = name if name.startswith("transformer.") else f"transformer.{name}"
        if key.endswith(_BUFFERS):
            continue
        out[key] = t.t().contiguous() if _is_conv1d(key) else t
    wte = out.get("transformer.wte.weight")
    if head is not None and (wte is None or not torch.equal(head, wte)):
        raise HFFormatError(
            "lm_head.weight differs from transformer.wte.weight: ftrain's GPT ties the output "
            "layer to the token embedding by structure, so an untied head "
            "(tie_word_embeddings=false) cannot be loaded"
        )
    return out


def to_hf_names(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ftrain GPT parameters -> ``GPT2LMHeadModel`` names and Conv1D layout (no lm_head:
    it is tied). Dtypes are kept."""
    return {k: (t.t() if _is_conv1d(k) else t).contiguous() for k, t in params.items()}


def _finite(value) -> bool:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return ok and math.isfinite(value)


def _count(hf: dict, key: str, default: int) -> int:
    """A size of config.json: a whole number (``64.9`` or ``"64"`` is a damaged file, not
    a size to round)."""
    value = hf.get(key)
    if value is None:
        return default
    if not _finite(value) or value != int(value):  # NaN/Infinity: Python's JSON reads them
        raise HFFormatError(f"config.json: {key}={value!r} is not a whole number")
    return int(value)


def _real(hf: dict, key: str, default: float) -> float:
    value = hf.get(key)
    if value is None:
        return default
    if not _finite(value):
        raise HFFormatError(f"config.json: {key}={value!r} is not a number")
    return float(value)


def gpt_fields_from_hf(hf: dict) -> dict[str, int]:
    """``GPTConfig`` fields (block_size, vocab_size, n_layer, n_head, n_embd) of an HF
    ``config.json``.

    Raises:
        HFFormatError: not GPT-2, or a feature ftrain's GPT does not compute the same way
            (another activation, LayerNorm epsilon, MLP width, cross-attention, ...).
    """
    if hf.get("model_type", "gpt2") != "gpt2":
        raise HFFormatError(f"config.json says model_type={hf.get('model_type')!r}; need gpt2")
    n_embd = _count(hf, "n_embd", 768)
    problems = []
    act = hf.get("activation_function", "gelu_new")
    if act not in _GELU_TANH:
        problems.append(f"activation_function={act!r} (ftrain's MLP is GELU-tanh: gelu_new)")
    eps = _real(hf, "layer_norm_epsilon", 1e-5)
    if not math.isclose(eps, 1e-5, rel_tol=1e-6):
        problems.append(f"layer_norm_epsilon={eps} (ftrain's LayerNorm uses 1e-5)")
    n_inner = hf.get("n_inner")
    if n_inner is not None and n_inner != 4 * n_embd:
        problems.append(f"n_inner={n_inner} (ftrain's MLP is 4 * n_embd = {4 * n_embd} wide)")
    for key, want in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if hf.get(key, want) != want:
            problems.append(f"{key}={hf[key]} (ftrain computes {key}={want})")
    if problems:
        raise HFFormatError("this GPT-2 differs from ftrain's GPT: " + "; ".join(problems))
    fields = {ours: _count(hf, theirs, 0) for theirs, ours in _FIELDS.items()}
    return fields | {"n_head": _count(hf, "n_head", 12), "n_embd": n_embd}


def infer_fields(params: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """The shape fields a set of ftrain-named GPT tensors implies (``n_head`` cannot be
    seen in shapes and is left out)."""
    fields = {}
    wte, wpe = params.get("transformer.wte.weight"), params.get("transformer.wpe.weight")
    if wte is not None and wte.ndim == 2:
        fields |= {"vocab_size": wte.shape[0], "n_embd": wte.shape[1]}
    if wpe is not None and wpe.ndim == 2:
        fields["block_size"] = wpe.shape[0]
    layers = {int(m[1]) for k in params if (m := re.match(r"transformer\.h\.(\d+)\.", k))}
    if layers:
        fields["n_layer"] = max(layers) + 1
    return fields


def hf_config(model: Mapping, dtype: torch.dtype) -> dict:
    """``config.json`` for ``GPT2LMHeadModel`` from ftrain's model config (numbers only).

    Raises:
        HFFormatError: ``bias=false`` (HF GPT-2 always has biases) or a non-integer size.
    """
    sizes = {}
    for key in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
        value = model.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise HFFormatError(f"the run's model.{key}={value!r} is not a positive integer")
        sizes[key] = value
    if model.get("bias", True) is not True:
        raise HFFormatError(
            "model.bias=false has no GPT2LMHeadModel equivalent (HF GPT-2 always has biases); "
            "export with --format safetensors"
        )
    p = float(model.get("dropout") or 0.0)
    eos = 50256 if sizes["vocab_size"] > 50256 else None  # GPT-2's <|endoftext|>, if it exists
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": sizes["vocab_size"],
        "n_positions": sizes["block_size"],
        "n_embd": sizes["n_embd"],
        "n_layer": sizes["n_layer"],
        "n_head": sizes["n_head"],
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": p,
        "embd_pdrop": p,
        "attn_pdrop": 0.0,  # ftrain has no attention-weight dropout (see model.py)
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "dtype": str(dtype).removeprefix("torch."),
    }


def _safetensors_load():
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise HFFormatError(
            "loading HF weights needs the safetensors package: pip install safetensors"
        ) from None
    return load_file


def _files_of(path: Path) -> tuple[list[Path], Path | None]:
    """The safetensors files and the config.json of an HF directory or file."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise HFFormatError(f"{path} is not a .safetensors file{_PICKLE_HINT}")
        config = path.parent / "config.json"
        return [path], config if config.is_file() else None
    if not path.is_dir():
        raise HFFormatError(f"{path}: no such file or directory (a local HF model directory)")
    config = path / "config.json" if (path / "config.json").is_file() else None
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"], config
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / s for s in _shards(index)], config
    found = sorted(p.name for p in path.iterdir())
    shown = ", ".join(found[:8]) + (f", ... ({len(found) - 8} more)" if len(found) > 8 else "")
    raise HFFormatError(f"{path} holds no model.safetensors (found: {shown}){_PICKLE_HINT}")


def _shards(index: Path) -> list[str]:
    """The shard file names of a ``model.safetensors.index.json``."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise HFFormatError(
            f"{index} is not a safetensors index (a JSON object with a 'weight_map' of "
            f"tensor -> shard file: {type(err).__name__}: {err}); re-download or re-save it"
        ) from None
    if not all(isinstance(s, str) and "/" not in s for s in shards):
        raise HFFormatError(f"{index}: its weight_map names no shard files of this directory")
    return shards


def _load_safetensors(load_file, f: Path) -> dict[str, torch.Tensor]:
    """One safetensors file, or an HFFormatError naming it (a git-lfs pointer left by a
    clone without git-lfs, a truncated download)."""
    from safetensors import SafetensorError  # not an OSError

    try:
        return load_file(str(f))
    except SafetensorError as err:
        head = f.read_bytes()[:200] if f.stat().st_size < 4096 else b""
        lfs = b"git-lfs" in head
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
        raise HFFormatError(
            f"{f} is not a readable safetensors file ({reason})"
            + (
                "; it is a git-lfs pointer: fetch the weights (git lfs pull)"
                if lfs
                else "; a truncated or damaged download? Download it again"
            )
        ) from None


_PICKLE_HINT = (
    "; ftrain reads safetensors only and never unpickles pytorch_model.bin: convert it once "
    "where you trust the file (transformers: model.save_pretrained(dir) writes "
    "model.safetensors)"
)


def read_hf(path: str | Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Read a local HF GPT-2 (a directory with ``model.safetensors`` [+ ``config.json``], a
    sharded ``model.safetensors.index.json``, or one ``.safetensors`` file).

    Returns:
        ``(tensors in ftrain's names and layout, config.json as a dict or None)``.

    Raises:
        HFFormatError: no such path, no safetensors file (a pickle is refused), an untied
            head, or a config.json that is not valid JSON.
    """
    files, config = _files_of(Path(path))
    load_file = _safetensors_load()
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors |= _load_safetensors(load_file, f)
    try:
        hf = json.loads(config.read_text()) if config is not None else None
    except json.JSONDecodeError as err:
        raise HFFormatError(f"{config} is not valid JSON: {err}") from None
    if hf is not None and not isinstance(hf, dict):
        raise HFFormatError(f"{config} is not a JSON object ({type(hf).__name__}): damaged?")
    return from_hf_names(tensors), hf
