"""Compose the run's config from ``ftrain/conf`` with Hydra's compose API.

We call ``hydra.compose`` ourselves rather than decorating ``main`` with ``@hydra.main``:
the run directory is ours (``run.dir``), Hydra neither changes the working directory nor
creates ``outputs/``, it works the same under ``torchrun``, and every composition error
becomes one clear :class:`ConfigError` instead of a stack trace. Hydra's flags, sweeps and
shows are in :mod:`ftrain.cli.app` and :mod:`ftrain.cli.sweep`; the ``hydra.*`` settings
ftrain acts on are honoured here (``hydra.run.dir``, ``hydra.searchpath``) and any other is
refused (:func:`check_hydra_overrides`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from contextlib import contextmanager
from dataclasses import fields
from datetime import datetime
from importlib import resources
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.utils import setup_globals
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from ftrain.config.schema import GROUP_SCHEMAS, register_configs

__all__ = [
    "ConfigError",
    "check_hydra_overrides",
    "compose_raw",
    "config_hash",
    "flat_config",
    "recorded_config",
    "finish_config",
    "group_options",
    "hydra_session",
    "load_config",
    "register_all",
    "to_plain",
]


class ConfigError(ValueError):
    """The command-line overrides or YAML files do not make a valid config."""


def _device_pick(cpu_value, gpu_value, *, _root_):
    """``${ftrain_device:CPU,GPU}``: pick by the device the run will use.

    ``trainer.device`` decides when it names one (``cpu``, ``cuda``, ``cuda:N``); with
    ``auto`` it is whether a CUDA device is present.
    """
    wanted = str(_root_.trainer.device) if "trainer" in _root_ else "auto"
    if wanted == "auto":
        return gpu_value if torch.cuda.is_available() else cpu_value
    return gpu_value if wanted.startswith("cuda") else cpu_value


def register_all() -> None:
    """ftrain's schemas in Hydra's ConfigStore and its resolvers (idempotent)."""
    register_configs()
    _register_resolvers()


# set by frozen_now(): the one time ${now:...} reads while a sweep is planned
_FROZEN_NOW: list[datetime] = []


@contextmanager
def frozen_now(at: datetime | None = None):
    """``${now:...}`` reads one time inside the block (``at``, default now): a sweep's
    planning composes every job, and Hydra resolves ``hydra.sweep.dir`` once per sweep (per
    job, the clock ticking between two composes spread ``multirun/${now:%H-%M-%S}`` over
    several directories)."""
    _FROZEN_NOW.append(at or datetime.now())
    try:
        yield
    finally:
        _FROZEN_NOW.clear()
        setup_globals()  # Hydra's own resolver again


def _freeze_now() -> None:
    """Inside :func:`frozen_now`: ``${now:...}`` is its time (Hydra's start re-registers
    its own resolver, so this follows every initialisation)."""
    if _FROZEN_NOW:
        at = _FROZEN_NOW[0]
        OmegaConf.register_new_resolver("now", at.strftime, use_cache=True, replace=True)


def _register_resolvers() -> None:
    setup_globals()  # Hydra's ${now:...} (used in sweep dirs), as under @hydra.main
    if not OmegaConf.has_resolver("ftrain_device"):
        OmegaConf.register_new_resolver("ftrain_device", _device_pick)


def load_config(
    overrides: list[str] | tuple[str, ...] = (), *, config_name: str = "config"
) -> DictConfig:
    """Compose ``conf/config.yaml`` with Hydra ``overrides`` and resolve it.

    Args:
        overrides: Hydra override strings, e.g. ``["+recipe=gpt2", "trainer.max_steps=10"]``;
            ``hydra.searchpath=[file://DIR]`` adds a config directory of the user's,
            ``hydra.run.dir=DIR`` is ``run.dir=DIR``.
        config_name: the primary config (``--config-name``).

    Returns:
        The resolved, read-only config.

    Raises:
        ConfigError: unknown key, wrong type, missing group option, bad ``resume`` value, a
            ``hydra.*`` override ftrain does not act on.

    Example:
        >>> cfg = load_config(["trainer.max_steps=3"])
        >>> cfg.trainer.max_steps
        3
    """
    check_hydra_overrides(overrides, multirun=False)
    raw = compose_raw(overrides, config_name=config_name)
    if any(o.startswith("hydra.run.dir=") for o in overrides):
        _honour_run_dir(raw, overrides)
    return finish_config(raw, overrides)


def compose_raw(overrides, *, config_name: str = "config") -> DictConfig:
    """Hydra's composition with its ``hydra`` node, unresolved (see :func:`finish_config`).

    Raises:
        ConfigError: the composition failed (unknown group option, key, type).
    """
    with hydra_session(overrides):
        return compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)


@contextmanager
def hydra_session(overrides=()):
    """Hydra initialised on ``ftrain.conf`` (schemas and resolvers registered) for the
    block, cleared after it; its errors become one :class:`ConfigError`.

    Example:
        >>> with hydra_session():
        ...     loader = GlobalHydra.instance().config_loader()
    """
    register_all()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="ftrain.conf", version_base="1.3"):
            _freeze_now()
            yield
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_explain(err, overrides)) from None
    except ValueError as err:  # Hydra's own, for a group set to null (model=null)
        if isinstance(err, ConfigError) or "Config group override" not in str(err):
            raise
        raise ConfigError(_explain(err, overrides)) from None
    finally:
        GlobalHydra.instance().clear()


def finish_config(raw: DictConfig, overrides=()) -> DictConfig:
    """Drop the ``hydra`` node, fill ftrain's own keys of options without a schema, resolve
    and validate: the run's read-only config.

    Raises:
        ConfigError: an interpolation fails, or a value a run cannot use.
    """
    cfg = raw.copy()
    try:
        with open_dict(cfg):
            del cfg["hydra"]  # Hydra's own settings are not part of the run's config
            _fill_own_defaults(cfg)
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_explain(err, overrides)) from None
    _check_group_choices(cfg, overrides)
    _check_keys(cfg)
    _check_bool_words(cfg, overrides)
    _check_values(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


_BOOL_WORDS = ("true", "false", "yes", "no", "on", "off", "1", "0")  # OmegaConf's own


def _check_bool_words(cfg: DictConfig, overrides) -> None:
    """A true/false key given another number than 0 or 1: OmegaConf took any non-zero one
    as true (``trainer.donate=2``, ``run.overwrite=2``) — a typo for another key's value,
    or a count, ran as a switch turned on."""
    for o in overrides:
        key, eq, value = str(o).lstrip("+~").partition("=")
        if not eq or key.startswith("hydra.") or "," in value:
            continue  # a sweep list is each job's to check
        current = OmegaConf.select(cfg, key, default=None)
        if isinstance(current, bool) and value.strip().lower() not in _BOOL_WORDS:
            raise _bad(key, value, "a switch takes true or false", f"{key}=true or {key}=false")


# The hydra.* settings ftrain acts on; any other is refused rather than silently ignored.
RUN_HYDRA_KEYS = ("hydra.run.dir", "hydra.searchpath")
SWEEP_HYDRA_KEYS = (
    "hydra.sweep.dir",
    "hydra.sweep.subdir",
    "hydra.searchpath",
    "hydra.job.config.override_dirname.",
)


def check_hydra_overrides(overrides, *, multirun: bool) -> None:
    """Refuse a ``hydra.*`` override (or ``hydra/GROUP=``) that ftrain would not act on.

    Raises:
        ConfigError: the override and the keys that do apply.
    """
    allowed = SWEEP_HYDRA_KEYS if multirun else RUN_HYDRA_KEYS
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        if not (key.startswith("hydra.") or key.startswith("hydra/")):
            continue
        if key in allowed or any(a.endswith(".") and key.startswith(a) for a in allowed):
            continue
        raise ConfigError(_hydra_refusal(o, key, multirun))


def _hydra_refusal(override: str, key: str, multirun: bool) -> str:
    if key == "hydra.run.dir":
        why = "a sweep puts each job in hydra.sweep.dir/hydra.sweep.subdir"
    elif key.startswith("hydra.sweep."):
        why = "it applies to sweeps only; add -m (--multirun), or set run.dir for one run"
    elif key == "hydra.job.chdir":
        why = "ftrain never changes the working directory (paths stay relative to where you run)"
    else:
        why = (
            "ftrain composes its config with Hydra but runs its jobs itself, one after another "
            "in this process (no outputs/ dir, no launcher or logging plugins)"
        )
    keys = ", ".join(
        k.rstrip(".") + ("*" if k.endswith(".") else "")
        for k in (SWEEP_HYDRA_KEYS if multirun else RUN_HYDRA_KEYS)
    )
    return (
        f"{override} is not used by ftrain: {why}; the hydra settings ftrain acts on here: {keys}"
    )


def _honour_run_dir(raw: DictConfig, overrides) -> None:
    """``hydra.run.dir=DIR`` is ``run.dir=DIR`` (refused if both name different dirs)."""
    wanted = str(raw.hydra.run.dir)
    given = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("run.dir=")]
    if given and given[-1] != wanted:
        raise ConfigError(
            f"hydra.run.dir={wanted} and run.dir={given[-1]} name different run directories; "
            "give one of them (they mean the same: where the run's checkpoints and records go)"
        )
    raw.run.dir = wanted


def _fill_own_defaults(cfg: DictConfig) -> None:
    """An option without its group's schema (a user's ``_target_`` YAML) gets the keys ftrain
    reads itself from the schema's defaults (``optim.clip``, ``model.lora``, ...)."""
    for group, keys in OWN_DEFAULTS.items():
        node = cfg.get(group)
        if not isinstance(node, DictConfig) or OmegaConf.get_type(node) is GROUP_SCHEMAS[group]:
            continue
        defaults = OmegaConf.structured(GROUP_SCHEMAS[group])
        for key in keys:
            if key not in node:
                node[key] = defaults[key]
            elif isinstance(node[key], DictConfig):  # e.g. +model.lora.rank=8 alone
                node[key] = OmegaConf.merge(defaults[key], node[key])


# per group: the keys ftrain itself reads, filled in for options without the group's schema
OWN_DEFAULTS = {
    "model": ("lora",),
    "optim": ("clip", "freeze", "groups"),
    "schedule": ("decay_steps",),
    "data": ("shuffle", "drop_last", "prefetch", "allow_changed", "val_fraction"),
}


# "Could not find" for GROUP=OPTION, "Could not load" for an option inside a list
_NOT_FOUND = re.compile(r"Could not (?:find|load) '(\w+)/([\w.\-]+)'")
_FULL_KEY = re.compile(r"full_key: ([\w.\-]+)")
# omegaconf's words for a value of the wrong type (not an unknown key)
_TYPE_ERRORS = (
    "Cannot assign",
    "could not be converted",
    "is not a valid",
    "Invalid value assigned",
    "is not Optional",  # trainer.max_steps=null
)
# Hydra's override parser on a value it cannot tokenize
_GRAMMAR_ERRORS = (
    "token recognition error",
    "mismatched input",
    "extraneous input",
    "no viable alternative",  # optim.freeze=[a.*,h.[0-1].*]: a glob's brackets unquoted
)
_CONTAINER_ERRORS = ("Cannot assign", "is not a ListConfig", "is not a DictConfig")


def _explain(err: Exception, overrides) -> str:
    msg = str(err).strip()
    cause = err.__cause__ or err.__context__
    if cause is not None and str(cause).strip() not in msg:
        msg += "\n  " + str(cause).strip().replace("\n", "\n  ")
    hint = (
        "check the key against `python -m ftrain --cfg job` or `--help` (keys: run, model, optim, "
        "schedule, data, checkpoint, trainer, dist, logger, resume, init); +key=value adds a key "
        "only outside those groups, for a recipe that reads it"
    )
    missing, full_key = _NOT_FOUND.search(msg), _FULL_KEY.search(msg)
    if missing:
        hint = _option_hint(*missing.groups())
    elif full_key and any(t in msg for t in _TYPE_ERRORS):
        key = full_key.group(1)
        hint = f"{key} takes another type, as said above (its current value: `python -m ftrain --cfg job --package {key}`)"
        if any(t in msg for t in _CONTAINER_ERRORS):
            hint += (
                f"; a list or mapping is written whole and quoted: '{key}=[a,b]', '{key}={{k: v}}'"
            )
    elif "Config group override must be" in msg:  # model=null
        nulls = [o for o in overrides if re.fullmatch(r"\+*[\w/]+=null", str(o))]
        hint = (
            f"{', '.join(nulls) or 'GROUP=null'}: a config group takes one of its options, never "
            "null (`python -m ftrain --help` lists them; logger=jsonl is the logger group's none)"
        )
    elif full_key and re.fullmatch(r"logger\.\w+", full_key.group(1)) and "not in struct" in msg:
        name = full_key.group(1).split(".")[1]  # logger.tensorboard.flush_secs=5 alone
        hint = (
            f"the logger {name!r} is not chosen: add logger={name} (or logger=[jsonl,{name}]) "
            f"to set its keys"
            if name in group_options("logger")
            else f"{name!r} is not a logger of ftrain's ({', '.join(group_options('logger'))}); "
            f"add one of your own with +logger.{name}._target_=module.Class"
        )
    elif "Ambiguous value for argument" in msg:  # dist.backend=cpu:gloo,cuda:nccl
        hint = (
            "a comma makes Hydra read a list (or a sweep); quote a value that holds one: "
            "\"dist.backend='cpu:gloo,cuda:nccl'\""
        )
    elif any(t in msg for t in _GRAMMAR_ERRORS):  # run.dir=~/x, run.dir=/a b=c
        hint = (
            "Hydra could not read a value: quote one that holds characters of its grammar "
            "(a space, '=', ',', brackets, '~'): \"run.dir='/data/my run'\", a glob in a list "
            "'optim.freeze=[transformer.wte.*,\"transformer.h.[0-1].*\"]'; a path under "
            "your home is given in full (run.dir=$HOME/x: the shell expands $HOME)"
        )
    elif "Cannot find primary config" in msg:
        hint = "--config-name takes a config of ftrain's conf/ (the default: config) or of --config-dir"
    elif "Interpolation key 'model.block_size' not found" in msg:
        hint = (
            "the data option reads its sample length from model.block_size, which this model "
            "has not: give the model YAML a block_size key, or set data.block_size=N"
        )
    return f"invalid config from overrides {list(overrides)}:\n  {msg}\n  fix: {hint}"


# groups config.yaml's defaults list does not name: chosen with +GROUP=OPTION (a hint of
# GROUP=OPTION named a command Hydra refuses, "No match in the defaults list")
_ADDED_GROUPS = ("recipe",)


def _option_hint(group: str, option: str) -> str:
    plus = "+" if group in _ADDED_GROUPS else ""
    choices = ", ".join(f"{plus}{group}={o}" for o in group_options(group))
    if option == f"{group}_schema":
        return f"{group}={option} is the typed schema of the {group} group, not an option; pick one of: {choices}"
    return f"{group}={option} is not an option; pick one of: {choices} (or add DIR/{group}/{option}.yaml with --config-dir DIR)"


def group_options(group: str) -> list[str]:
    """The YAML options of a group in ftrain's own config package."""
    folder = resources.files("ftrain.conf") / group
    if not folder.is_dir():
        return []
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


# groups that take one option; only logger takes a list (several loggers at once)
_ONE_OPTION_GROUPS = ("model", "optim", "schedule", "data", "trainer", "checkpoint", "dist")


def _check_group_choices(cfg: DictConfig, overrides) -> None:
    """``optim=[adamw,sgd]`` (a sweep without ``-m``) merged both options, the last one
    winning, and trained one run without a word; ``~model`` removed a group every run
    needs and failed with omegaconf's ``MissingMandatoryValue`` deep in the checks."""
    for o in map(str, overrides):
        m = re.fullmatch(r"\+*([\w/]+)=\[(.*)\]", o)
        if m and m.group(1) in _ONE_OPTION_GROUPS:
            group, options = m.group(1), m.group(2)
            raise ConfigError(
                f"{o}: the {group} group takes one option, and a list merges them (the last "
                f"one wins); a sweep over them is written without brackets, under -m: "
                f"python -m ftrain -m {group}={options}"
            )
    for group in (*_ONE_OPTION_GROUPS, "run", "resume"):
        if group not in cfg or OmegaConf.is_missing(cfg, group):
            raise ConfigError(
                f"{group} cannot be removed (~{group}): every run needs it; pick one of its "
                f"options ({_choices(group)}) or leave it out"
            )


def _choices(group: str) -> str:
    if group == "resume":
        return "resume=latest, resume=none or resume=STEP"
    return ", ".join(group_options(group)) or "python -m ftrain --help lists them"


def _check_keys(cfg: DictConfig) -> None:
    """Refuse keys a group's schema does not have, also when added with ``+key=value``.

    Hydra lets ``+trainer.max_step=10`` into a typed node; we do not: a typo must not be
    accepted silently. A group option that does not extend its schema (a user's own model
    YAML with a ``_target_`` of its own) may carry any keys.
    """
    for group, schema in GROUP_SCHEMAS.items():
        node = cfg.get(group)
        if not isinstance(node, DictConfig) or OmegaConf.get_type(node) is not schema:
            continue
        known = {f.name for f in fields(schema)}
        unknown = sorted(k for k in node.keys() if k not in known)
        if unknown:
            names = ", ".join(f"{group}.{k}" for k in unknown)
            raise ConfigError(
                f"unknown key(s) {names}: the {group} group has {sorted(known)}; "
                "fix the spelling (a + does not make a new key valid)"
            )


def _bad(key: str, value, rule: str, fix: str = "") -> ConfigError:
    return ConfigError(f"{key}={value!r} is invalid: {rule}" + (f"; {fix}" if fix else ""))


def _check_values(cfg: DictConfig) -> None:
    """Values the schema's types allow but a run cannot use: one message naming key and fix."""
    _check_finite(cfg)
    check_int64(cfg)
    resume = cfg.resume
    step = isinstance(resume, int) and not isinstance(resume, bool) and resume >= 0
    if not (resume in ("latest", "none") or step):
        raise ConfigError(
            f"resume must be 'latest', 'none' or a step number >= 0, got resume={resume!r}"
        )
    _check_run(cfg)
    check_trainer(cfg.trainer)
    _check_checkpoint(cfg.checkpoint)
    _check_optim(cfg.optim)
    _check_groups(cfg.optim)
    _check_gpt2_shape(cfg.model)
    _check_lora(cfg.model.get("lora"))
    _check_init(cfg.get("init"))
    _check_schedule(cfg.schedule)
    check_data(cfg.data)
    _check_dist(cfg.dist)
    _check_shard(cfg)
    _check_best_metric(cfg)


_GPT2_SHAPE = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "dropout", "bias")


def _check_gpt2_shape(model: DictConfig) -> None:
    """The built-in GPT-2's shape rules (``n_embd`` divisible by ``n_head``, ...) when the
    config is composed: they lived only in the model's constructor, so a sweep found
    ``model.n_head=4,3``'s second job impossible after the first had trained."""
    if model.get("_target_") != "ftrain.cli.targets.gpt2":
        return
    from ftrain.recipes.gpt2 import GPTConfig  # torch-free: a dataclass

    try:
        GPTConfig(**{k: model.get(k) for k in _GPT2_SHAPE})
    except (TypeError, ValueError) as err:
        said = str(err).replace("GPTConfig.", "model.")
        raise ConfigError(f"{said} (model={model.get('name')}: the built-in GPT-2)") from None


def _check_finite(cfg: DictConfig) -> None:
    """No NaN or infinity anywhere: the config is recorded as JSON in every checkpoint's
    metadata, where they have no spelling, so ``trainer.hang_timeout_s=inf`` trained and
    then failed every save (and ``optim.clip=inf`` crashed the first step)."""
    found = next(_non_finite(OmegaConf.to_container(cfg, resolve=True)), None)
    if found is not None:
        key, value = found
        raise ConfigError(
            f"{key}={value} is not a finite number: the config is recorded as JSON in every "
            "checkpoint, which has no inf or nan; use null where the key allows 'none' "
            "(trainer.hang_timeout_s=null, optim.clip=null) or a large finite number"
        )


def check_int64(cfg: DictConfig) -> None:
    """No whole number past int64 (``trainer.max_steps=99999999999999999999`` passed every
    check and crashed in torch with ``OverflowError``, leaving a lock and an empty run)."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    for key, v in _leaves(plain):
        big = isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v < 2**63
        if big and key != "trainer.seed":  # seeds are 64-bit unsigned, checked below
            raise _bad(
                key,
                v,
                "past the 64-bit range counts and sizes are held in",
                "use a value below 2**63",
            )


def _leaves(node, prefix: str = ""):
    """``(key, value)`` of every leaf (keys ``a.b``, ``a.t[1]``)."""
    if isinstance(node, dict):
        items = ((f"{prefix}.{k}" if prefix else str(k), v) for k, v in node.items())
    else:
        items = ((f"{prefix}[{i}]", v) for i, v in enumerate(node))
    for key, v in items:
        if isinstance(v, dict | list):
            yield from _leaves(v, key)
        else:
            yield key, v


def _non_finite(node, prefix: str = ""):
    """``(key, value)`` of each float leaf that is NaN or infinite (keys ``a.b``, ``a.t[1]``)."""
    for key, v in _leaves(node, prefix):
        if isinstance(v, float) and not math.isfinite(v):
            yield key, v


def _check_no_tilde(key: str, value) -> None:
    """``run.dir='~/x'`` (quoted, as Hydra needs it) trained into a directory named ``~``
    under the working directory, where ``ckpt list ~/x`` (the shell expands it) found
    nothing, and a start from another directory started over. Refused, not expanded: a
    run already in ``./~/x`` would have started fresh in ``$HOME/x``."""
    if isinstance(value, str) and value.split("/", 1)[0].startswith("~"):
        raise _bad(
            key,
            value,
            "'~' is not expanded in a path here (it makes a directory named '~')",
            f"give the full path ({key}={os.path.expanduser(value)}), or ./{value} for that "
            "directory",
        )


def _check_run(cfg: DictConfig) -> None:
    """An empty ``run.dir=`` (or ``checkpoint.dir=``) put the records in the working
    directory and the checkpoints at ``/checkpoints``; ``run.overwrite=true`` without
    ``resume=none`` resumed the old run, silently ignored."""
    if not str(cfg.run.get("name", "x")).strip():  # run.dir became runs/, every run's parent
        raise _bad("run.name", cfg.run.name, "an empty name", "give one, e.g. run.name=exp1")
    name = str(cfg.run.get("name", "x"))
    if any(p in (".", "..") for p in name.split("/")) or Path(name).is_absolute():
        # "." made run.dir runs/ itself (every run's parent), ".." the working directory
        raise _bad(
            "run.name",
            cfg.run.name,
            "a name under runs/ (no '.', '..' or absolute path)",
            "give one, e.g. run.name=exp1, or choose the place with run.dir=PATH",
        )
    for key in ("run.dir", "checkpoint.dir"):  # an empty fallback_dir means none, as null
        value = OmegaConf.select(cfg, key)
        if isinstance(value, str) and not value.strip():
            raise _bad(key, value, "an empty path", f"give a directory, e.g. {key}=runs/x")
    for key in ("run.dir", "checkpoint.dir", "checkpoint.fallback_dir"):
        _check_no_tilde(key, OmegaConf.select(cfg, key))
    if cfg.run.get("overwrite") and cfg.resume != "none":
        raise _bad(
            "run.overwrite",
            True,
            f"it starts the run over, and resume={cfg.resume} continues it",
            "add resume=none to start over (the old run is moved aside), or leave "
            "run.overwrite out to resume",
        )


def _check_best_metric(cfg: DictConfig) -> None:
    c = cfg.checkpoint
    if c.keep_best and not str(c.best_metric or "").strip():  # warned at every save
        raise _bad(
            "checkpoint.best_metric",
            c.best_metric,
            "checkpoint.keep_best ranks steps by a metric, and none is named",
            "name one (checkpoint.best_metric=val_loss, or loss)",
        )
    if c.keep_best and str(c.best_metric).startswith("val_") and not cfg.trainer.eval_every:
        raise _bad(
            "checkpoint.best_metric",
            c.best_metric,
            "val_* metrics come from evaluations, and trainer.eval_every=null runs none, so "
            "checkpoint.keep_best would keep no step by it",
            "set trainer.eval_every"
            + (" and a data.val_fraction above 0" if cfg.data.get("val_fraction") == 0 else "")
            + ", or rank by a step metric (checkpoint.best_metric=loss)",
        )


def check_precision(t: DictConfig) -> None:
    """``trainer.precision`` is one the step knows (also checked by ``ftrain.eval``)."""
    if t.precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"trainer.precision must be fp32, bf16 or fp16, got {t.precision!r}")


def check_trainer(t: DictConfig) -> None:
    """The ``trainer`` group's values a run can use (``ConfigError`` naming key and fix)."""
    check_precision(t)
    for name in ("max_steps", "batch_size", "grad_accum", "log_every"):
        least = 0 if name == "max_steps" else 1  # max_steps=0: build, restore, train nothing
        if getattr(t, name) < least:
            raise ConfigError(f"trainer.{name} must be >= {least}, got {getattr(t, name)}")
    if not 0 <= t.seed < 2**64:
        raise _bad(
            "trainer.seed",
            t.seed,
            "must be in [0, 2**64)",
            "keys are 64-bit: a larger or "
            "negative seed would silently be the same run as its value mod 2**64",
        )
    if t.eval_every is not None and t.eval_every < 0:
        raise _bad("trainer.eval_every", t.eval_every, "must be >= 1", "or 0/null: no evaluation")
    if t.eval_batches < 1:
        raise _bad("trainer.eval_batches", t.eval_batches, "must be >= 1 (batches per evaluation)")
    if t.batch_size % t.grad_accum:
        fits = largest_divisor(t.batch_size, t.grad_accum)
        raise ConfigError(
            f"trainer.batch_size={t.batch_size} must be divisible by trainer.grad_accum="
            f"{t.grad_accum}: use a trainer.batch_size that is a multiple of {t.grad_accum}, or, "
            f"to keep this batch size (a resume), trainer.grad_accum={fits}"
        )
    _check_fault_keys(t)


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` (>= 1) not above ``at_most``, for a fix to suggest; by
    pairs up to sqrt(n) (a loop to ``at_most`` ran for hours at grad_accum=10**12), and 1
    where a huge ``n`` has none below a million."""
    if at_most >= n:
        return n
    best = 1
    for i in range(1, min(math.isqrt(n), 10**6) + 1):
        if n % i == 0:
            best = max([best] + [d for d in (i, n // i) if d <= at_most])
    return best


MIN_HANG_TIMEOUT_S = 1.0  # below it, the watchdog's own poll and the first step's allowance


def _check_fault_keys(t: DictConfig) -> None:
    """``trainer.compile``, ``trainer.on_nonfinite`` and ``trainer.hang_timeout_s`` (see
    docs/configuration.md, docs/fault-tolerance.md)."""
    # 1 == True: an int would pass `in (True, False)` and then fail every `is True` test
    if not (isinstance(t.compile, bool) or t.compile == "auto"):  # ftrain.compiled.should_compile
        raise ConfigError(f"trainer.compile must be true, false or auto, got {t.compile!r}")
    if t.on_nonfinite not in ("stop", "skip", "continue"):
        raise ConfigError(
            f"trainer.on_nonfinite must be stop, skip or continue, got {t.on_nonfinite!r}"
        )
    if t.on_nonfinite == "skip" and t.donate:
        raise ConfigError(
            "trainer.on_nonfinite=skip keeps the state before a bad step, but "
            "trainer.donate=true overwrites it in place; use one of them"
        )
    if t.hang_timeout_s is not None and not t.hang_timeout_s > 0:
        raise ConfigError(
            f"trainer.hang_timeout_s must be > 0 seconds or null (off), got {t.hang_timeout_s}"
        )
    if t.hang_timeout_s is not None and t.hang_timeout_s < MIN_HANG_TIMEOUT_S:
        # every start "hung" at its first step and exited 4, which supervisors restart
        raise ConfigError(
            f"trainer.hang_timeout_s={t.hang_timeout_s} is shorter than a step can be timed: "
            f"every start would be called hung (exit 4) and restarted; use at least "
            f"{MIN_HANG_TIMEOUT_S:g} s, longer than your slowest step, eval or save, or null (off)"
        )


def _check_checkpoint(c: DictConfig) -> None:
    from ftrain.ckpt.codecs import parse_compression  # the checkpoint layer owns the names

    for name in ("every_steps", "keep_last", "keep_every", "keep_best"):
        value = c[name]
        if value is not None and value < 1:
            never = "save only at the end and on signals" if name == "every_steps" else "keep all"
            raise _bad(
                f"checkpoint.{name}",
                value,
                "must be a whole number >= 1",
                f"use checkpoint.{name}=null to {never}",
            )
    secs = c.every_seconds
    if secs is not None and not (math.isfinite(secs) and secs > 0):
        raise _bad(
            "checkpoint.every_seconds",
            secs,
            "must be > 0",
            "use checkpoint.every_seconds=null for no time-based saves",
        )
    try:
        parse_compression(c.compression)
    except ValueError as err:
        raise _bad("checkpoint.compression", c.compression, str(err)) from None
    _check_mmap_restore(c)


def _check_mmap_restore(c: DictConfig) -> None:
    """A mapped restore maps local files: refused with an object-store location."""
    from ftrain.ckpt.location import is_object_url

    remote = [d for d in (c.dir, c.fallback_dir) if d is not None and is_object_url(str(d))]
    if c.mmap_restore and remote:
        raise _bad(
            "checkpoint.mmap_restore",
            True,
            f"a mapped restore maps local files, and {remote[0]} is an object store",
            "use checkpoint.mmap_restore=false there",
        )


def _check_optim(o: DictConfig) -> None:
    lr = o.get("lr")
    # finite in float32 too, where it is applied: 1e300 trained into NaN at step 3
    if not (isinstance(lr, int | float) and math.isfinite(lr) and 0 < lr <= _FLOAT32_MAX):
        raise _bad(
            "optim.lr",
            lr,
            f"the learning rate (the schedule's peak) must be a number > 0 and at most "
            f"{_FLOAT32_MAX:.4g}, float32's largest",
            "set optim.lr (an optimizer YAML of your own needs an lr key)",
        )
    if o.clip is not None and not (o.clip > 0):
        raise _bad(
            "optim.clip",
            o.clip,
            "the gradient-norm clip must be > 0",
            "use optim.clip=null for no clipping",
        )
    for name in ("b1", "b2"):
        if name in o and not 0 <= o[name] < 1:
            raise _bad(f"optim.{name}", o[name], "must be in [0, 1)")
    if "eps" in o and not o.eps > 0:
        raise _bad("optim.eps", o.eps, "must be > 0")
    if "eps" in o and o.eps < _FLOAT32_TINY:  # a subnormal or 0 in fp32: 1e-300, NaN at step 2
        raise _bad(
            "optim.eps",
            o.eps,
            f"must be at least {_FLOAT32_TINY:.3g}, float32's smallest normal number",
        )
    if "weight_decay" in o and not o.weight_decay >= 0:
        raise _bad("optim.weight_decay", o.weight_decay, "must be >= 0")
    if "momentum" in o and not 0 <= o.momentum < 1:  # 1 or more: the velocity never decays
        raise _bad("optim.momentum", o.momentum, "must be in [0, 1)")


_FLOAT32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny, without torch
_FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max
_GROUP_KEYS = ("params", "lr", "b1", "b2", "eps", "weight_decay", "momentum", "nesterov")
_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]*")


def _globs(key: str, value) -> None:
    if not isinstance(value, list | ListConfig) or not all(isinstance(p, str) and p for p in value):
        raise _bad(
            key,
            value,
            "must be a list of glob patterns over parameter paths",
            f"e.g. {key}=[transformer.h.0.*,transformer.wpe.*]",
        )


def _check_groups(o: DictConfig) -> None:
    """``optim.freeze`` and ``optim.groups``: shapes and values (see ftrain.cli.finetune)."""
    _globs("optim.freeze", o.freeze)
    for name, group in o.groups.items():
        key = f"optim.groups.{name}"
        if not _PLAIN.fullmatch(str(name)) or name in ("default", "frozen"):
            raise _bad(key, name, "a group name is a plain name other than default/frozen")
        if not isinstance(group, DictConfig) or "params" not in group:
            raise _bad(
                key,
                group,
                "a group needs params (globs) and its own settings",
                f"e.g. +{key}.params=[transformer.ln_f.*] +{key}.lr=1e-3",
            )
        unknown = sorted(k for k in group if k not in _GROUP_KEYS)
        if unknown:
            raise _bad(
                key,
                dict(group),
                f"unknown setting(s) {unknown}; a group may set {list(_GROUP_KEYS)}",
            )
        _globs(f"{key}.params", group.params)
        if not group.params:  # an empty list matched nothing and failed deep in the glob
            raise _bad(f"{key}.params", [], "a group needs at least one glob", f"or drop {key}")
        own = {k: v for k, v in group.items() if k != "params"}
        try:
            merged = OmegaConf.merge(o, own)
        except OmegaConfBaseException as err:  # a value of the wrong type (lr=abc)
            wrong = [k for k in own if f"optim.{k}" in str(err)] or list(own)
            raise _bad(
                f"{key}.{wrong[0]}",
                own[wrong[0]],
                f"not a value optim.{wrong[0]} takes ({str(err).splitlines()[0]})",
                f"give it as optim.{wrong[0]} would be given",
            ) from None
        try:
            _check_optim(merged)
        except ConfigError as err:  # name the group's own key, not optim.X
            own = [k for k in group if k != "params" and f"optim.{k}=" in str(err)]
            text = str(err).replace(f"optim.{own[0]}", f"{key}.{own[0]}") if own else str(err)
            raise ConfigError(text) from None


def _check_lora(lora) -> None:
    if lora is None:
        return
    if lora.rank < 0:
        raise _bad("model.lora.rank", lora.rank, "must be >= 0", "0 turns LoRA off")
    if not (math.isfinite(lora.alpha) and lora.alpha > 0):  # inf: 0 * inf, NaN at step 1
        raise _bad("model.lora.alpha", lora.alpha, "must be a finite number > 0")
    if not 0 <= lora.dropout < 1:
        raise _bad("model.lora.dropout", lora.dropout, "must be in [0, 1)")
    if not lora.targets or not all(isinstance(t, str) and t for t in lora.targets):
        raise _bad(
            "model.lora.targets",
            lora.targets,
            "must name one or more Linear modules",
            "e.g. model.lora.targets=[c_attn,c_proj]",
        )


def _check_init(init) -> None:
    if not isinstance(init, DictConfig) or set(init.keys()) - {"from", "from_hf"}:
        raise _bad(
            "init",
            init,
            "the init group has two keys, from and from_hf",
            "use init.from=RUN_DIR[:STEP] or init.from_hf=HF_DIR (or null)",
        )
    value = init.get("from")
    if value is not None and not (isinstance(value, str) and value):
        raise _bad(
            "init.from",
            value,
            "must be a run directory, checkpoints directory or URL, optionally with :STEP",
        )
    hf = init.get("from_hf")
    if hf is not None and not (isinstance(hf, str) and hf):
        raise _bad("init.from_hf", hf, "must be a local HF model directory or .safetensors file")
    if value is not None and hf is not None:
        raise ConfigError(
            f"init.from={value!r} and init.from_hf={hf!r} both give a fresh start its params; "
            "set only one (init.from=null or init.from_hf=null)"
        )


_BACKENDS = ("auto", "gloo", "nccl", "mpi", "ucc", "xccl")


def _check_dist(d: DictConfig) -> None:
    """A misspelt backend (``dist.backend=glooo``) or a timeout of 0 failed only once
    torchrun had started every rank, deep in ``init_process_group``."""
    backend = d.get("backend")
    spec = (
        isinstance(backend, str)
        and ":" in backend
        and all(  # "cpu:gloo,cuda:nccl"
            dev.strip() and name.strip() in _BACKENDS[1:]
            for dev, _, name in (pair.partition(":") for pair in backend.split(","))
        )
    )
    if not (backend in _BACKENDS or spec):
        raise _bad(
            "dist.backend",
            backend,
            f"must be one of {', '.join(_BACKENDS)} or a device:backend list "
            "('cpu:gloo,cuda:nccl')",
            "dist.backend=auto picks nccl on CUDA, gloo otherwise",
        )
    timeout = d.get("timeout_s")
    if not (isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0):
        raise _bad(
            "dist.timeout_s",
            timeout,
            "the collectives' timeout must be a number of seconds > 0",
            "the default is 600",
        )


def _check_shard(cfg: DictConfig) -> None:
    shard, t = cfg.dist.shard, cfg.trainer
    if shard not in ("none", "optimizer", "full"):
        raise _bad("dist.shard", shard, "must be none, optimizer or full")
    clash = [
        f"{k}={v}"
        for k, v in (("trainer.donate", t.donate), ("trainer.compile", t.compile is True))
        if v
    ] + (["trainer.precision=fp16"] if t.precision == "fp16" else [])
    if shard != "none" and clash:
        raise _bad(
            "dist.shard",
            shard,
            f"a sharded optimizer state does not combine with {', '.join(clash)} yet",
            "drop those settings or use dist.shard=none",
        )


def _check_schedule(s: DictConfig) -> None:
    if s.get("warmup_steps", 0) < 0:
        raise _bad("schedule.warmup_steps", s.warmup_steps, "must be >= 0")
    if s.decay_steps is not None and s.decay_steps < 1:
        raise _bad(
            "schedule.decay_steps",
            s.decay_steps,
            "must be >= 1",
            "use schedule.decay_steps=null to decay over trainer.max_steps",
        )
    if not 0 <= s.get("end_factor", 0) <= 1:
        raise _bad("schedule.end_factor", s.end_factor, "must be in [0, 1]")
    warmup = s.get("warmup_steps", 0) or 0
    kind = str(s.get("_target_") or s.get("name") or "").rsplit(".", 1)[-1]
    if kind == "warmup_cosine" and s.decay_steps is not None and s.decay_steps <= warmup:
        # it was quietly stretched to warmup_steps + 1, as the library refuses it
        raise _bad(
            "schedule.decay_steps",
            s.decay_steps,
            f"must be above schedule.warmup_steps={warmup} (the step the decay ends at, "
            "counted from 0 with the warmup inside it)",
            f"set schedule.decay_steps above {warmup}, or a smaller schedule.warmup_steps "
            f"(resuming a run that set it: schedule.decay_steps={warmup + 1} is the curve it "
            "trained on, a change a resume accepts)",
        )


# data sources that read the user's files: what data.path must name
_NEEDS_PATH = {
    "text": "a directory or glob of text files",
    "tokens": "a directory holding train.bin and val.bin",
}


def check_data(d: DictConfig) -> None:
    """The ``data`` group's values a run can use (``ConfigError`` naming key and fix)."""
    if not 0 <= d.val_fraction < 1:
        raise _bad(
            "data.val_fraction", d.val_fraction, "must be in [0, 1) (a share of the data held out)"
        )
    if d.get("name") in _NEEDS_PATH and not d.get("path"):
        raise ConfigError(
            f"data={d.name} needs data.path: set data.path=PATH to {_NEEDS_PATH[d.name]}"
        )
    if d.prefetch < 0:
        raise _bad("data.prefetch", d.prefetch, "must be >= 0")
    cache = d.get("cache_dir")
    if isinstance(cache, str) and not cache.strip():  # was the working directory
        raise _bad(
            "data.cache_dir", cache, "an empty path", "give a directory, or null for the default"
        )


def to_plain(cfg: DictConfig) -> dict:
    """The resolved config as plain JSON-able Python data, for records that leave the
    process (checkpoint metadata, loggers): secrets among ``checkpoint.storage`` (e.g.
    ``secret_access_key=${oc.env:...}``) are replaced by ``"<redacted>"``."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    storage = plain.get("checkpoint", {}).get("storage") if isinstance(plain, dict) else None
    if isinstance(storage, dict):
        for key in storage:
            if _SECRET_RE.search(str(key)):
                storage[key] = "<redacted>"
    return plain


# storage option names that hold credentials: never recorded (access key ids included)
_SECRET_RE = re.compile(r"secret|token|password|key|credential|sas", re.IGNORECASE)


def recorded_config(cfg: DictConfig) -> dict:
    """The config a checkpoint records: all of it but ``logger`` (where this start's metrics
    are shown is not part of the run, and checkpoint metadata then names no logger code)."""
    plain = to_plain(cfg)
    plain.pop("logger", None)
    return plain


def flat_config(plain: dict, prefix: str = "") -> dict[str, object]:
    """A plain config as ``{"optim.lr": 0.001, ...}``: dotted keys to leaf values."""
    out: dict[str, object] = {}
    for k, v in plain.items():
        key = f"{prefix}{k}"
        out |= flat_config(v, key + ".") if isinstance(v, dict) else {key: v}
    return out


def config_hash(plain: dict) -> str:
    """A stable short hash of a config section (sorted-key JSON, sha256)."""
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:16]
