"""The ``_target_`` of each of ftrain's own config options, and how a target is called.

Every option of the ``model``, ``optim``, ``schedule`` and ``data`` groups names the
callable that builds it with ``_target_`` (Hydra's ``instantiate``), so a user's own option
is one YAML file in a config directory of theirs (``--config-dir DIR`` or
``hydra.searchpath=[file://DIR]``), with no Python wrapper around ftrain:

* ``model``: ``_target_(**keys) -> nn.Module`` (``generator=`` is passed when the target
  takes it, else it is built under a forked torch RNG seeded from the run's init key),
  plus ``loss``: the dotted path of ``loss_fn(model, batch) -> loss | (loss, aux)``.
* ``optim``: ``_target_(schedule, **keys) -> GradientTransformation``.
* ``schedule``: ``_target_(lr, horizon, **keys) -> (count -> lr)``.
* ``data``: ``_target_(split=..., **the keys it accepts) -> Source``.

The keys ftrain itself reads (``OWN_KEYS``: ``name``, ``lr``, ``clip``, ...) are not passed.
Targets are only ever taken from the config composed from the user's command line and
config files, never from a checkpoint's recorded config (loading a checkpoint runs no code).

The factories below are the built-in options' targets: they take exactly the keys of
their group's schema (:mod:`ftrain.config.schema`), so the recorded config of a run keeps
the same keys as before targets existed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import torch
from hydra._internal.utils import _locate  # instantiate's own lookup (no error logging)
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ftrain import optim
from ftrain.config import ConfigError

__all__ = [
    "BUILTIN_TARGETS",
    "OWN_KEYS",
    "adamw",
    "build_optimizer",
    "call_target",
    "check_recorded_targets",
    "constant",
    "gpt2",
    "instantiate_model",
    "resolve_loss",
    "sgd",
    "unused_option_settings",
    "warmup_cosine",
]

# The keys of each group that ftrain reads itself: never passed to the group's target.
OWN_KEYS = {
    "model": ("_target_", "name", "loss", "lora"),
    "optim": ("_target_", "name", "lr", "clip", "freeze", "groups", "fused"),
    "schedule": ("_target_", "name", "decay_steps"),
}

# ``(group, name) -> _target_`` of the built-in options: what a checkpoint written before
# options had targets meant (ftrain.cli.resume.ADDED_KEYS).
BUILTIN_TARGETS = {
    "model": {"gpt2": "ftrain.cli.targets.gpt2"},
    "optim": {"adamw": "ftrain.cli.targets.adamw", "sgd": "ftrain.cli.targets.sgd"},
    "schedule": {
        "warmup_cosine": "ftrain.cli.targets.warmup_cosine",
        "constant": "ftrain.cli.targets.constant",
    },
    "data": {
        "stdlib": "ftrain.data.corpus.stdlib_corpus",
        "text": "ftrain.data.text.TextCorpusSource",
        "tokens": "ftrain.data.sources.TokenFileSource",
    },
}


_BUILTIN_LOSSES = {"gpt2": "ftrain.recipes.gpt2.lm_loss"}


def check_recorded_targets(recorded: dict) -> dict:
    """A checkpoint's recorded config, for tools that rebuild a model from it (eval): the
    ``_target_``/``loss`` of each group must be one of ftrain's built-in options' (compared
    as strings, never imported); one recorded before options had targets gets its
    built-in option's target by ``name``. Returns a copy.

    Raises:
        ConfigError: a target (anywhere) that is not a built-in option's: checkpoint
            metadata never decides what code runs.

    Example:
        >>> check_recorded_targets({"model": {"name": "gpt2"}})["model"]["_target_"]
        'ftrain.cli.targets.gpt2'
    """
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in recorded.items()}
    for group, table in BUILTIN_TARGETS.items():
        node = out.get(group)
        if not isinstance(node, dict):
            continue
        name = _builtin_name(table, node)
        expected = {"_target_": table.get(name)}
        if group == "model":
            expected["loss"] = _BUILTIN_LOSSES.get(name)
        for key, value in expected.items():
            node.setdefault(key, value)
            if node[key] != value or value is None:
                raise ConfigError(
                    f"the run's recorded config names code ({group}.{key}={node[key]!r}, "
                    f"{group}.name={name!r}), not one of ftrain's built-in options; a "
                    "checkpoint's metadata never decides what is imported: "
                    + _REBUILD.get(group, _REBUILD["model"])
                )
    _refuse_nested_targets(out, "")
    return out


# what to do instead, by the group whose recorded target is not a built-in's
_REBUILD = {
    "model": "rebuild the model in Python (ftrain.make_eval_step, ftrain.evaluate)",
    "data": "build your data source in Python and evaluate with it (ftrain.evaluate)",
}


def _builtin_name(table: dict, node: dict) -> str | None:
    """The built-in option a recorded group is: by its ``_target_`` when it names one (a
    user's option file may reuse a built-in target under a name of its own), else by its
    ``name`` (a checkpoint recorded before options had targets)."""
    by_target = {t: n for n, t in table.items()}
    return by_target.get(node.get("_target_"), node.get("name"))


# Hydra's instantiate acts on these keys wherever they are (in dicts and in lists):
# ``_target_`` imports and calls, ``_args_`` passes arguments, the others change how.
_HYDRA_KEYS = ("_target_", "_args_", "_partial_", "_recursive_", "_convert_")


def _refuse_nested_targets(node, where: str) -> None:
    """Refuse Hydra's keys anywhere in a recorded config but a group's own ``_target_``
    (checked against the built-ins by the caller), in dicts and in lists alike."""
    if isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _refuse_nested_targets(v, f"{where.rstrip('.')}[{i}].")
        return
    if not isinstance(node, dict):
        return
    for k, v in node.items():
        top = where.count(".") == 1 and k == "_target_"  # checked above
        if k in _HYDRA_KEYS and not top:
            raise ConfigError(
                f"the run's recorded config names code or its arguments ({where}{k}={v!r}); "
                "a checkpoint's metadata never decides what is imported or called: rebuild "
                "the model in Python (ftrain.make_eval_step, ftrain.evaluate)"
            )
        _refuse_nested_targets(v, f"{where}{k}.")


def gpt2(
    *,
    block_size: int,
    vocab_size: int,
    n_layer: int,
    n_head: int,
    n_embd: int,
    dropout: float,
    bias: bool,
    generator: torch.Generator,
) -> nn.Module:
    """``model=gpt2``/``gpt2_tiny``: the GPT-2 recipe's model of this shape.

    Example:
        >>> m = gpt2(block_size=8, vocab_size=16, n_layer=1, n_head=1, n_embd=8,
        ...          dropout=0.0, bias=True, generator=torch.Generator().manual_seed(0))
        >>> type(m).__name__
        'GPT'
    """
    from ftrain.recipes.gpt2 import GPT, GPTConfig

    shape = GPTConfig(
        block_size=block_size,
        vocab_size=vocab_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        dropout=dropout,
        bias=bias,
    )
    return GPT(shape, generator=generator)


def adamw(lr, *, b1, b2, eps, weight_decay, momentum=0.0, nesterov=False, fused=False):
    """``optim=adamw``: decay only on >= 2-D weights (GPT-2 practice). ``momentum`` and
    ``nesterov`` are the optim schema's SGD settings, unused here; ``fused``:
    ``optim.fused``."""
    del momentum, nesterov
    mask = optim.masks.ndim_at_least(2)
    return optim.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask, fused=fused)


def sgd(lr, *, momentum, nesterov, weight_decay, b1=0.9, b2=0.95, eps=1e-8):
    """``optim=sgd``: SGD with optional (Nesterov) momentum. ``b1``, ``b2``, ``eps`` are the
    optim schema's Adam settings, unused here."""
    del b1, b2, eps
    return optim.sgd(lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)


def warmup_cosine(lr: float, horizon: int, *, warmup_steps: int, end_factor: float):
    """``schedule=warmup_cosine``: linear warmup to ``lr``, cosine decay to
    ``end_factor * lr`` at step ``horizon``."""
    return optim.schedule.warmup_cosine(
        lr, warmup_steps, max(horizon, warmup_steps + 1), lr * end_factor
    )


def constant(lr: float, horizon: int, *, warmup_steps: int = 0, end_factor: float = 0.1):
    """``schedule=constant``: ``lr`` at every step (the schema's warmup and end settings
    do not apply)."""
    del horizon, warmup_steps, end_factor
    return optim.schedule.constant(lr)


# The schema keys each built-in option takes but does not use (its signature has them so
# the recorded config keeps every schema key), with the value its YAML or the schema gives
# them: another value set there changes nothing.
_UNUSED_BY = {
    ("optim", "ftrain.cli.targets.adamw"): {"momentum": 0.0, "nesterov": False},
    ("optim", "ftrain.cli.targets.sgd"): {"b1": 0.9, "b2": 0.95, "eps": 1e-8},
    ("schedule", "ftrain.cli.targets.constant"): {"warmup_steps": 0, "end_factor": 0.1},
    # byte-level text has no token dtype (data.dtype is the token files')
    ("data", "ftrain.data.text.TextCorpusSource"): {"dtype": "uint16"},
    ("data", "ftrain.data.corpus.stdlib_corpus"): {"dtype": "uint16"},
}


def unused_keys(group: str, target: object) -> frozenset[str]:
    """The settings of config group ``group`` that its built-in option ``target`` does not
    read (``optim.momentum`` under adamw): a change of one changes nothing a step computes.

    Example:
        >>> sorted(unused_keys("optim", "ftrain.cli.targets.adamw"))
        ['momentum', 'nesterov']
    """
    return frozenset(_UNUSED_BY.get((group, target), ()))


def unused_option_settings(cfg: DictConfig) -> list[str]:
    """Warnings for settings the chosen built-in option ignores, set away from their
    default (``optim=adamw optim.momentum=0.9``, ``schedule=constant
    schedule.warmup_steps=100``): they were dropped without a word.

    Example:
        >>> from ftrain.config import load_config
        >>> unused_option_settings(load_config(["optim=sgd", "optim.b1=0.8"]))[0][:34]
        'warning: optim.b1=0.8 is not used '
    """
    out = _unused_checkpoint_settings(cfg.get("checkpoint"))
    for (group, target), neutral in _UNUSED_BY.items():
        node = cfg.get(group)
        if node is None or node.get("_target_") != target:
            continue
        places = [(group, node)]  # and each parameter group's own overrides
        groups = (node.get("groups") or {}) if group == "optim" else {}
        places += [(f"optim.groups.{n}", g) for n, g in groups.items()]
        for where, settings in places:
            changed = [
                f"{where}.{k}={settings[k]}" for k, v in neutral.items() if settings.get(k, v) != v
            ]
            if changed:
                one = len(changed) == 1
                out.append(
                    f"warning: {', '.join(changed)} {'is' if one else 'are'} not used by "
                    f"{group}={node.get('name')} (settings of other options); pick the {group} "
                    f"option that uses {'it' if one else 'them'}"
                )
    return out


def _unused_checkpoint_settings(c) -> list[str]:
    """``checkpoint.storage`` (object-store settings) with no ``s3://``-style location, and
    ``checkpoint.best_metric`` without ``keep_best``: both were dropped without a word."""
    if c is None:
        return []
    out = []
    urls = [d for d in (c.get("dir"), c.get("fallback_dir")) if d and "://" in str(d)]
    if c.get("storage") and not urls:
        out.append(
            f"warning: checkpoint.storage ({', '.join(sorted(c.storage))}) is not used: "
            "neither checkpoint.dir nor checkpoint.fallback_dir is an object-store URL "
            "(s3://bucket/prefix)"
        )
    if c.get("best_metric") != "val_loss" and not c.get("keep_best"):
        out.append(
            f"warning: checkpoint.best_metric={c.best_metric} is not used without "
            "checkpoint.keep_best=N (the number of best steps to keep by it)"
        )
    return out


def _spec(group: str, node: Mapping) -> dict:
    plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    target = plain.get("_target_")
    name = plain.get("name", "?")
    if not target:
        raise ConfigError(
            f"{group}={name} has no {group}._target_: set it to the dotted path of the callable "
            f"that builds it (see docs/configuration.md, 'Your own model, optimizer, data')"
        )
    own = OWN_KEYS.get(group, ("_target_", "name"))
    return {"_target_": target, **{k: v for k, v in plain.items() if k not in own}}


def call_target(group: str, node: Mapping, *args, **kwargs):
    """Instantiate ``node._target_`` with ``args``, ``kwargs`` and the node's other keys
    (those ftrain reads itself, ``OWN_KEYS[group]``, left out).

    Raises:
        ConfigError: no ``_target_``, it cannot be imported, or it rejects the keys.
    """
    spec = _spec(group, node)
    try:
        return instantiate(spec, *args, _convert_="all", **kwargs)
    except InstantiationException as err:
        raise _target_error(group, spec["_target_"], err) from None


def _target_error(group: str, target: str, err: Exception) -> ConfigError:
    cause = err.__cause__ or err
    if isinstance(cause, ImportError) or "Error locating target" in str(err):
        fix = f"check that {target.rsplit('.', 1)[0]} is importable (on PYTHONPATH or installed)"
    else:  # it was found and called, and refused what it was given
        fix = f"check the {group}.* values (and that the target takes the {group} config's keys)"
    return ConfigError(
        f"{group}._target_={target!r} could not be built: {str(err).splitlines()[0]}"
        f"\n  cause: {type(cause).__name__}: {cause}"
        f"\n  fix: {fix}"
    )


def _takes(target: str, name: str) -> bool:
    fn = _locate(target)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def build_optimizer(node: Mapping, schedule):
    """``optim._target_(schedule, **other keys)``, with ``fused=True`` added when
    ``optim.fused`` is set (a target without that argument is a clear error, not ignored).

    Raises:
        ConfigError: see :func:`call_target`; ``optim.fused=true`` for a target that takes
            no ``fused``.
    """
    if not node.get("fused", False):
        return call_target("optim", node, schedule)
    target = _spec("optim", node)["_target_"]
    try:
        takes_fused = _takes(target, "fused")
    except Exception as err:  # not importable: reported like an instantiate failure
        raise _target_error("optim", target, err) from None
    if not takes_fused:
        raise ConfigError(
            f"optim.fused=true, but optim._target_={target!r} takes no 'fused' argument "
            "(the fused kernel is Adam's: optim=adamw); drop optim.fused, or give your "
            "target a fused argument"
        )
    return call_target("optim", node, schedule, fused=True)


def instantiate_model(node: Mapping, generator: torch.Generator) -> nn.Module:
    """The ``model`` option's module, its weights drawn from ``generator``'s stream.

    A target without a ``generator`` argument is built under ``torch.random.fork_rng``
    seeded from ``generator`` (the run's init key), so its init is reproducible and the
    global RNG is as it was afterwards.

    Raises:
        ConfigError: see :func:`call_target`; the target did not return an ``nn.Module``.
    """
    target = _spec("model", node)["_target_"]
    try:
        takes_generator = _takes(target, "generator")
    except Exception as err:  # not importable: reported like an instantiate failure
        raise _target_error("model", target, err) from None
    if takes_generator:
        module = call_target("model", node, generator=generator)
    else:
        seed = int(torch.randint(0, 2**62, (), generator=generator))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = call_target("model", node)
    if not isinstance(module, nn.Module):
        raise ConfigError(
            f"model._target_={target!r} returned a {type(module).__name__}, not a torch.nn.Module"
        )
    return module


def resolve_loss(node: Mapping) -> Callable:
    """``model.loss``: a dotted path (``mypkg.my_loss``) or a ``_target_`` node (use
    ``_partial_: true`` for a function with settings).

    Raises:
        ConfigError: no loss, or it cannot be imported.
    """
    loss = node.get("loss")
    if loss is None:
        raise ConfigError(
            f"model={node.get('name', node.get('_target_'))} has no model.loss: set it to the "
            "dotted path of loss_fn(model, batch) -> loss or (loss, {'tokens': n})"
        )
    try:
        return _locate(loss) if isinstance(loss, str) else call_target("loss", loss)
    except Exception as err:
        if isinstance(err, ConfigError):
            raise
        raise _target_error("model.loss", str(loss), err) from None
