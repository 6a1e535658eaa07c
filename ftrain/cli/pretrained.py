"""``init.from_hf=PATH``: a fresh GPT-2 run starts from a local Hugging Face GPT-2.

``PATH`` is a directory as ``save_pretrained`` writes it (``config.json`` +
``model.safetensors``, or a sharded ``model.safetensors.index.json``) or one
``.safetensors`` file (a ``config.json`` beside it is used when present). Nothing is
downloaded and nothing is unpickled. Conversion (names, Conv1D transpose, tied head) is
:mod:`ftrain.recipes.gpt2.hf`.

Checked before training, each with the ``model.*`` overrides that fix it: the HF sizes
against the configured model (``vocab_size``, ``n_layer``, ``n_head``, ``n_embd``; the
HF ``n_positions`` may be larger than ``model.block_size``: the position embeddings are
cropped to the first ``block_size`` rows, as nanoGPT's ``crop_block_size`` does), then
every tensor's name and shape. Floating tensors are cast to the model's dtype (a bf16
file into the fp32 params ftrain trains). Params only; the rest of the state is fresh.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from tensordict import TensorDictBase

from ftrain import lora
from ftrain.cli.finetune import load_into
from ftrain.config import ConfigError
from ftrain.recipes.gpt2.hf import HFFormatError, gpt_fields_from_hf, infer_fields, read_hf
from ftrain.state.tree import flatten, path_str

__all__ = ["init_from_hf"]

_WPE = "transformer.wpe.weight"


def init_from_hf(cfg: DictConfig, fresh: TensorDictBase) -> tuple[TensorDictBase, str]:
    """The fresh state with its params taken from ``init.from_hf`` (params only).

    Returns:
        ``(state, report line)``.

    Raises:
        ConfigError: not the gpt2 model, an unreadable or pickled file, HF sizes that
            differ from ``model.*`` (the message lists the overrides), or tensors that do
            not fit.
    """
    where = str(cfg.init["from_hf"])
    what = f"init.from_hf={where!r}"
    if cfg.model.get("name") != "gpt2":
        raise ConfigError(
            f"{what} loads HF GPT-2 weights into model.name=gpt2, not {cfg.model.get('name')!r}"
        )
    try:
        tensors, hf = read_hf(where)
        fields = gpt_fields_from_hf(hf) if hf is not None else infer_fields(tensors)
    except (HFFormatError, OSError) as err:
        raise ConfigError(f"{what}: {err}") from None
    _check_sizes(cfg.model, fields, what, has_config=hf is not None)
    model_dtypes = dict(zip(*_named(fresh["params"]), strict=True))
    table, notes = _fit(tensors, cfg.model.block_size, model_dtypes)
    state, fresh_only = load_into(cfg, fresh, table, what)
    _refuse_missing(fresh_only, what)
    line = f"initialised params from HF GPT-2 {where}: {len(table)} tensors loaded"
    notes += [] if hf is not None else ["no config.json: n_head not checked"]
    if fresh_only:
        notes.append(f"{len(fresh_only)} new ({', '.join(fresh_only[:3])}, ...) initialised fresh")
    return state, line + "".join(f"; {n}" for n in notes)


def _refuse_missing(fresh_only: list[str], what: str) -> None:
    """A GPT-2 file holds every GPT-2 tensor: one missing is a damaged or partial file,
    not a new head (``init.from``'s case). Left at its random start it trained a random
    MLP inside a "pretrained" model, exit 0. Only LoRA adapters start fresh."""
    missing = [p for p in fresh_only if not lora.is_adapter(p)]
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ConfigError(
            f"{what} lacks {len(missing)} GPT-2 tensor(s) the model has ({shown}): a damaged "
            "or partial weights file (a GPT-2 file holds every one); export it again, or "
            "check that model.n_layer and the other sizes are the file's"
        )


def _named(params: TensorDictBase) -> tuple[list[str], list[torch.dtype]]:
    keys, leaves = flatten(params)
    return [path_str(k) for k in keys], [t.dtype for t in leaves]


def _check_sizes(model: DictConfig, fields: dict[str, int], what: str, has_config: bool) -> None:
    """The HF sizes must be the configured model's (``block_size``: at most the HF one)."""
    wrong = {
        k: v for k, v in fields.items() if (model[k] > v if k == "block_size" else model[k] != v)
    }
    if not wrong:
        return
    seen = "config.json" if has_config else "the tensors' shapes"
    got = ", ".join(f"{k}={model[k]} (HF: {v})" for k, v in wrong.items())
    fix = " ".join(f"model.{k}={v}" for k, v in fields.items())
    raise ConfigError(
        f"{what} is a different GPT-2 than the configured model ({seen}): {got}; "
        f"build the HF model's shape with: {fix} (model.block_size may be smaller: the "
        "position embeddings are cropped)"
    )


def _fit(
    tensors: dict[str, torch.Tensor], block_size: int, dtypes: dict[str, torch.dtype]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Crop the position embeddings to ``block_size`` and cast floats to the model's dtypes."""
    notes = []
    wpe = tensors.get(_WPE)
    if wpe is not None and wpe.ndim == 2 and wpe.shape[0] > block_size:
        tensors = tensors | {_WPE: wpe[:block_size].clone()}
        notes.append(f"position embeddings cropped from {wpe.shape[0]} to {block_size}")
    cast = set()
    out = {}
    for name, t in tensors.items():
        want = dtypes.get(name)
        if (
            want is not None
            and t.is_floating_point()
            and want.is_floating_point
            and t.dtype != want
        ):
            cast.add(str(t.dtype).removeprefix("torch."))
            t = t.to(want)
        out[name] = t
    if cast:
        notes.append(f"cast from {', '.join(sorted(cast))} to the model's dtype")
    return out, notes
