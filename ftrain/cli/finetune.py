"""Fine-tuning from the config: frozen parameters, parameter groups, LoRA, ``init.from``.

* ``optim.freeze=[GLOB, ...]``: those parameters get no gradient and no optimizer state.
* ``optim.groups.NAME={params: [GLOB, ...], lr: ..., weight_decay: ...}``: a group with its
  own optimizer settings (any of ``lr b1 b2 eps weight_decay momentum nesterov``; the
  schedule's shape is the same, scaled to the group's ``lr``).
* ``model.lora.rank=R``: adapters on ``model.lora.targets``; every parameter that is not
  an adapter (and not in a group) is frozen.
* ``init.from=RUN[:STEP]``: a fresh start takes its parameters from another run's
  checkpoint (params only; the optimizer, step, data cursor and RNG start fresh).

A parameter's label: ``frozen`` if it matches ``optim.freeze``; else the first group whose
``params`` match; else ``frozen`` for a non-adapter under LoRA; else ``default``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDictBase

from ftrain import lora, optim
from ftrain.config import ConfigError
from ftrain.state.tree import flatten, path_str, replace, unflatten

__all__ = [
    "GROUP_KEYS",
    "describe_labels",
    "init_from",
    "labeller",
    "lora_enabled",
    "parse_init_from",
]

# optimizer settings a group may override (the rest are the optim group's)
GROUP_KEYS = ("lr", "b1", "b2", "eps", "weight_decay", "momentum", "nesterov")
_RESERVED_LABELS = ("default", "frozen")


def lora_enabled(cfg: DictConfig) -> bool:
    node = cfg.model.get("lora")
    return node is not None and int(node.rank) > 0


def unused_lora_settings(cfg: DictConfig) -> str | None:
    """A warning when ``model.lora.*`` is set but ``model.lora.rank`` is 0: LoRA is off,
    so the run fine-tunes every parameter (with optimizer state for each), not adapters."""
    from ftrain.config.schema import LoraConfig

    node = cfg.model.get("lora")
    if node is None or lora_enabled(cfg):
        return None
    defaults = OmegaConf.structured(LoraConfig)
    changed = [
        k
        for k in ("alpha", "targets", "dropout")
        if node.get(k) is not None and node.get(k) != defaults[k]  # a user YAML may omit keys
    ]
    if not changed:
        return None
    keys = ", ".join(f"model.lora.{k}" for k in changed)
    return (
        f"warning: {keys} set but model.lora.rank=0, so LoRA is off and every parameter "
        "trains; set model.lora.rank (e.g. 8) for adapters"
    )


def uses_groups(cfg: DictConfig) -> bool:
    """Whether the optimizer needs ``multi_transform`` (anything frozen or grouped)."""
    return bool(cfg.optim.freeze) or bool(cfg.optim.groups) or lora_enabled(cfg)


def group_settings(cfg: DictConfig) -> dict[str, DictConfig]:
    """``{group: the optim config with the group's overrides}``, in config order."""
    out = {}
    for name, group in cfg.optim.groups.items():
        merged = OmegaConf.to_container(cfg.optim, resolve=True)
        merged = {k: v for k, v in merged.items() if k not in ("freeze", "groups")}
        merged |= {k: v for k, v in group.items() if k != "params"}
        out[name] = OmegaConf.create(merged)
    return out


def labeller(cfg: DictConfig):
    """``(path, tensor) -> label`` for ``optim.multi_transform`` (rules in the module doc)."""
    frozen = optim.masks.glob(*cfg.optim.freeze) if cfg.optim.freeze else None
    groups = [(name, optim.masks.glob(*g.params)) for name, g in cfg.optim.groups.items()]
    adapters_only = lora_enabled(cfg)

    def label(path: str, tensor: torch.Tensor) -> str:
        if frozen is not None and frozen(path, tensor):
            return "frozen"
        for name, matches in groups:
            if matches(path, tensor):
                return name
        if adapters_only and not lora.is_adapter(path):
            return "frozen"
        return "default"

    return label


def check_patterns(cfg: DictConfig, paths: list[str]) -> None:
    """Every ``optim.freeze`` / group glob must match one of the parameter ``paths``
    (``model.named_parameters()``' names, as the state's params are keyed): a typo would
    otherwise train (or freeze) something else silently.

    Raises:
        ConfigError: naming the pattern and showing parameter paths to pick from.
    """
    patterns = [("optim.freeze", p) for p in cfg.optim.freeze]
    patterns += [
        (f"optim.groups.{n}.params", p) for n, g in cfg.optim.groups.items() for p in g.params
    ]
    for key, pattern in patterns:
        if not any(optim.masks.glob(pattern)(p, None) for p in paths):
            shown = ", ".join(paths[:6]) + (", ..." if len(paths) > 6 else "")
            raise ConfigError(
                f"{key} pattern {pattern!r} matches no parameter; parameter paths look like: "
                f"{shown} (globs: * matches dots too, e.g. 'transformer.h.[0-5].*')"
            )


def check_labels(cfg: DictConfig, params: TensorDictBase) -> None:
    """What the label rules leave, checked on a fresh start: something to train, and every
    group some parameters (``optim.freeze`` and earlier groups win over a group). Before,
    the first failed at its first step, after an emergency save that then refused the
    corrected config; the second trained nothing while logging the group's rate. (A
    resume is not refused: its optimizer state already has the groups it started with.)

    Raises:
        ConfigError: naming the keys and the fix.
    """
    if not uses_groups(cfg):
        return
    label = labeller(cfg)
    named = [(path_str(k), t) for k, t in zip(*flatten(params), strict=True)]
    labels = [label(p, t) for p, t in named]
    if all(x == "frozen" for x in labels):
        raise ConfigError(
            f"every parameter is frozen (optim.freeze={list(cfg.optim.freeze)}"
            + (", and LoRA trains adapters only" if lora_enabled(cfg) else "")
            + "): nothing would train; freeze fewer parameters"
        )
    for name, group in cfg.optim.groups.items():
        if name in labels:
            continue
        matches = optim.masks.glob(*group.params)
        took = sorted({x for (p, t), x in zip(named, labels, strict=True) if matches(p, t)})
        by = (
            f"optim.freeze={list(cfg.optim.freeze)} freezes them (freezing wins)"
            if took == ["frozen"]
            else f"they go to {took} first (freezing wins, then the first matching group)"
        )
        raise ConfigError(
            f"optim.groups.{name}.params={list(group.params)} take no parameter: {by}, so "
            "the group would train nothing; narrow the other patterns or drop the group"
        )


def frozen_at_random(cfg: DictConfig, params: TensorDictBase) -> str | None:
    """A warning for a fresh start that freezes parameters it did not load (no
    ``init.from``/``init.from_hf``): LoRA or ``optim.freeze`` would then train on a random
    base — almost always a forgotten ``init.from``."""
    if not uses_groups(cfg) or cfg.init["from"] or cfg.init["from_hf"]:
        return None
    label = labeller(cfg)
    frozen = [t for k, t in zip(*flatten(params), strict=True) if label(path_str(k), t) == "frozen"]
    if not frozen:
        return None
    return (
        f"warning: {len(frozen)} frozen parameters ({sum(t.numel() for t in frozen):,} values) "
        "keep their random initialisation: no init.from or init.from_hf is set; set one to "
        "fine-tune a trained base"
    )


def describe_labels(cfg: DictConfig, params: TensorDictBase) -> str | None:
    """One line: parameters per label (``None`` when nothing is frozen or grouped)."""
    if not uses_groups(cfg):
        return None
    label = labeller(cfg)
    counts: dict[str, list[int]] = {}
    for k, t in zip(*flatten(params), strict=True):
        c = counts.setdefault(label(path_str(k), t), [0, 0])
        c[0] += 1
        c[1] += t.numel()
    parts = [
        f"{name}: {n} tensors, {numel:,} params" for name, (n, numel) in sorted(counts.items())
    ]
    return "parameter groups: " + "; ".join(parts)


def parse_init_from(value: str) -> tuple[str | list[str], int | None]:
    """``RUN[:STEP]`` -> ``(checkpoint location(s), step or None)``.

    ``RUN`` is a run directory (its ``checkpoints/`` and the fallback directory the run
    used: :func:`ftrain.ckpt.readonly.run_locations`), a checkpoints directory, or an
    object-store URL of one.
    """
    from ftrain.ckpt.readonly import StepSpecError, _colon_hint, locations_of, split_step

    where, step = split_step(value)
    if (
        step is None
        and "://" not in where
        and not Path(where).exists()
        and _colon_hint(Path(where))
    ):
        # RUN:abc, RUN:-1: "looks like a URL but is not one" named object storage
        raise StepSpecError(f"{where}: no such run directory{_colon_hint(Path(where))}")
    return locations_of(where), step


def init_from(
    cfg: DictConfig, fresh: TensorDictBase, step: int | None = None
) -> tuple[TensorDictBase, str, int]:
    """The fresh state with its params taken from ``init.from`` (params only); ``step``
    (if given) in place of the one ``init.from`` names (:mod:`ftrain.cli.basestep`).

    Every parameter of the checkpoint must exist in the model with the same shape and
    dtype. Model parameters the checkpoint lacks keep their fresh initialisation — LoRA
    adapters, a new head — but not frozen ones: a frozen parameter that stays random is
    a mistake, so it is an error.

    Returns:
        ``(state, report line, the base's step read)``.

    Raises:
        ConfigError: no such run/step, nothing verifies, or the params do not fit.
    """
    from ftrain.ckpt import CorruptCheckpointError
    from ftrain.ckpt.readonly import name_of, read_model

    where, named = parse_init_from(str(cfg.init["from"]))
    step = named if step is None else step
    what = f"init.from={cfg.init['from']!r}"
    if isinstance(where, str) and Path(where).is_file():
        hint = (
            " (a GPT-2 .safetensors file: init.from_hf)" if where.endswith(".safetensors") else ""
        )
        raise ConfigError(f"{what} is a file; init.from takes a run or checkpoints directory{hint}")
    try:  # the buffers too: a BatchNorm's running statistics are part of what was trained
        got_step, loaded, attrs = read_model(where, step, storage=cfg.checkpoint.storage)
    except (FileNotFoundError, CorruptCheckpointError, ValueError) as err:
        raise ConfigError(f"{what}: {err}") from None
    table = dict(zip(*_named(loaded["params"]), strict=True))
    _check_same_function(cfg, attrs, what)
    _check_adapter_alpha(cfg, table, attrs, what)
    state, fresh_only = load_into(cfg, fresh, table, what)
    state, n_buffers = _load_buffers(state, loaded, what)
    line = f"initialised params from {name_of(where)} step {got_step}: {len(table)} tensors loaded"
    line += f" (and {n_buffers} buffers)" if n_buffers else ""
    if fresh_only:
        line += f", {len(fresh_only)} new ({_sample(fresh_only)}) initialised fresh"
    return state, line, got_step


# model keys that change what the params compute without changing any shape: the heads
# split n_embd differently (a base of n_head=4 loaded into n_head=16 loads "fine")
_SHAPELESS_MODEL_KEYS = ("n_head",)


def _check_same_function(cfg: DictConfig, attrs: dict, what: str) -> None:
    """The base run's recorded model keys no shape shows must be this run's."""
    recorded = (attrs.get("config") or {}).get("model")
    if not isinstance(recorded, dict):
        return  # a state saved by other code: its shapes are all there is to check
    wrong = {
        k: recorded[k]
        for k in _SHAPELESS_MODEL_KEYS
        if k in recorded and k in cfg.model and recorded[k] != cfg.model[k]
    }
    if wrong:
        got = ", ".join(f"model.{k}={cfg.model[k]} (base run: {v})" for k, v in wrong.items())
        fix = " ".join(f"model.{k}={v}" for k, v in wrong.items())
        raise ConfigError(
            f"{what} was trained as another model with the same shapes: {got}; its params "
            f"would compute something else here. Build the base's model with: {fix}"
        )


def _check_adapter_alpha(cfg: DictConfig, table: dict, attrs: dict, what: str) -> None:
    """Adapters loaded into a run of another ``model.lora.alpha`` would be scaled by the
    new ``alpha / rank``: step 0 would be neither the base nor the LoRA run."""
    from ftrain.ckpt.export import recorded_alpha

    theirs = recorded_alpha(attrs)
    if not lora_enabled(cfg):  # no adapters here: _check_fit names what to do instead
        return
    ours = cfg.model.get("lora", {}).get("alpha")
    adapters = any(name.endswith(".lora_A") for name in table)
    if adapters and theirs is not None and ours is not None and float(ours) != theirs:
        raise ConfigError(
            f"{what} holds LoRA adapters trained with model.lora.alpha={theirs:g}, this run "
            f"has model.lora.alpha={ours:g}: they would be rescaled; set "
            f"model.lora.alpha={theirs:g}, or start from the weights with the adapters merged "
            "(docs/fine-tuning.md: export --merge-lora --format hf, then init.from_hf)"
        )


def _load_buffers(state: TensorDictBase, loaded: TensorDictBase, what: str):
    """``state`` with the base run's module buffers (BatchNorm running statistics): each
    must be a buffer of this model with the same shape and dtype; buffers the base run did
    not have keep their fresh values. Returns ``(state, buffers loaded)``."""
    if "buffers" not in loaded.keys() or not flatten(loaded["buffers"])[0]:
        return state, 0
    table = dict(zip(*_named(loaded["buffers"]), strict=True))
    keys, leaves = flatten(state["buffers"])
    model = dict(zip(map(path_str, keys), leaves, strict=True))
    unknown = sorted(set(table) - set(model))
    wrong = [p for p in sorted(set(table) & set(model)) if not _same_kind(table[p], model[p])]
    if unknown or wrong:
        raise ConfigError(
            f"{what} does not fit this model: buffers "
            + (f"the model does not have: {_sample(unknown)}" if unknown else "")
            + ("; " if unknown and wrong else "")
            + (f"of another shape/dtype: {_sample(wrong)}" if wrong else "")
            + " (the model config must match the base run's)"
        )
    new = [table.get(path_str(k), t).to(t.device) for k, t in zip(keys, leaves, strict=True)]
    buffers = unflatten(keys, new, device=state["buffers"].device)
    return replace(state, buffers=buffers), len(table)


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype


def _named(params: TensorDictBase) -> tuple[list[str], list[torch.Tensor]]:
    keys, leaves = flatten(params)
    return [path_str(k) for k in keys], leaves


def load_into(
    cfg: DictConfig, fresh: TensorDictBase, table: dict[str, torch.Tensor], what: str
) -> tuple[TensorDictBase, list[str]]:
    """``fresh`` with its params replaced by ``table`` (``{dotted path: tensor}``), after
    :func:`_check_fit`; returns the state and the paths that kept their fresh values.

    Raises:
        ConfigError: ``table`` does not fit the model (the message starts with ``what``).
    """
    keys, leaves = flatten(fresh["params"])
    _check_fit(cfg, table, dict(zip(map(path_str, keys), leaves, strict=True)), what)
    new = [table.get(path_str(k), t).to(t.device) for k, t in zip(keys, leaves, strict=True)]
    fresh_only = [path_str(k) for k in keys if path_str(k) not in table]
    return replace(fresh, params=unflatten(keys, new, device=fresh["params"].device)), fresh_only


def _sample(paths: list[str]) -> str:
    return ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")


def _check_fit(cfg: DictConfig, loaded: dict, model: dict, what: str) -> None:
    unknown = sorted(set(loaded) - set(model))
    wrong = [
        f"{p}: checkpoint {tuple(loaded[p].shape)} {loaded[p].dtype}, model {tuple(model[p].shape)} {model[p].dtype}"
        for p in sorted(set(loaded) & set(model))
        if loaded[p].shape != model[p].shape or loaded[p].dtype != model[p].dtype
    ]
    label = labeller(cfg) if uses_groups(cfg) else None
    random_frozen = [
        p
        for p in sorted(set(model) - set(loaded))
        if label is not None and label(p, model[p]) == "frozen"
    ]
    problems = []
    if unknown:
        problems.append(f"parameters the model does not have: {_sample(unknown)}")
    if any(p.endswith((".lora_A", ".lora_B")) for p in unknown):
        problems.append(
            "the base run trained LoRA adapters: set model.lora.rank (and alpha, targets) "
            "as it did, or export it with --merge-lora --format hf and use init.from_hf"
        )
    if wrong:
        problems.append("shape/dtype mismatches: " + "; ".join(wrong[:3]))
    if random_frozen:
        problems.append(
            f"frozen parameters missing from the checkpoint would stay random: {_sample(random_frozen)}"
        )
    if problems:
        raise ConfigError(
            f"{what} does not fit this model: "
            + "; ".join(problems)
            + " (the model config must match the base run's; LoRA adapters may be new)"
        )
