"""Compose the run's config from ``ftrain/conf`` with Hydra's compose API.

We call ``hydra.compose`` ourselves rather than decorating ``main`` with ``@hydra.main``:
the run directory is ours (``run.dir``), Hydra neither changes the working directory nor
creates ``outputs/``, it works the same under ``torchrun``, and every composition error
becomes one clear :class:`ConfigError` instead of a stack trace.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import fields
from importlib import resources

import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from ftrain.config.schema import GROUP_SCHEMAS, register_configs

__all__ = ["ConfigError", "config_hash", "load_config", "to_plain"]


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


def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("ftrain_device"):
        OmegaConf.register_new_resolver("ftrain_device", _device_pick)


def load_config(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose ``conf/config.yaml`` with Hydra ``overrides`` and resolve it.

    Args:
        overrides: Hydra override strings, e.g. ``["+recipe=gpt2", "trainer.max_steps=10"]``.

    Returns:
        The resolved, read-only config.

    Raises:
        ConfigError: unknown key, wrong type, missing group option, bad ``resume`` value.

    Example:
        >>> cfg = load_config(["trainer.max_steps=3"])
        >>> cfg.trainer.max_steps
        3
    """
    register_configs()
    _register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="ftrain.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        choices = dict(cfg.hydra.runtime.choices)
        with open_dict(cfg):
            del cfg["hydra"]  # Hydra's own settings are not part of the run's config
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_explain(err, overrides)) from None
    finally:
        GlobalHydra.instance().clear()
    _check_choices(choices)
    _check_keys(cfg)
    _check_values(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _explain(err: Exception, overrides) -> str:
    # the typed schemas live in each group's namespace (so YAML can extend them) but are
    # not choices: leave them out of Hydra's "Available options" lists
    msg = re.sub(r"\n\t\w+_schema(?=\n|$)", "", str(err).strip())
    cause = err.__cause__ or err.__context__
    if cause is not None and str(cause).strip() not in msg:
        msg += "\n  " + str(cause).strip().replace("\n", "\n  ")
    hint = (
        "check the key against `python -m ftrain --cfg` (keys: run, model, optim, schedule, data, "
        "checkpoint, trainer, dist, resume); +key=value adds a key only outside those groups, "
        "for a recipe that reads it"
    )
    return f"invalid config from overrides {list(overrides)}:\n  {msg}\n  fix: {hint}"


def _group_options(group: str) -> list[str]:
    """The YAML options of a group in ftrain's own config package."""
    folder = resources.files("ftrain.conf") / group
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def _check_choices(choices: dict) -> None:
    """Refuse a schema picked as a group option: it has no values (``model=model_schema``)."""
    for group, option in choices.items():
        if isinstance(option, str) and option.endswith("_schema") and "/" not in group:
            raise ConfigError(
                f"{group}={option} is the typed schema of the {group} group, not an option; "
                f"pick one of: {', '.join(f'{group}={o}' for o in _group_options(group))}"
            )


def _check_keys(cfg: DictConfig) -> None:
    """Refuse keys a group's schema does not have, also when added with ``+key=value``.

    Hydra lets ``+trainer.max_step=10`` into a typed node; we do not: a typo must not be
    accepted silently. A group option that does not extend its schema (a user's own model
    YAML without ``model_schema`` in its defaults) may carry any keys.
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
    resume = cfg.resume
    if not (resume in ("latest", "none") or (isinstance(resume, int) and resume >= 0)):
        raise ConfigError(
            f"resume must be 'latest', 'none' or a step number >= 0, got resume={resume!r}"
        )
    _check_trainer(cfg.trainer)
    _check_checkpoint(cfg.checkpoint)
    _check_optim(cfg.optim)
    _check_groups(cfg.optim)
    _check_lora(cfg.model.get("lora"))
    _check_init(cfg.get("init"))
    _check_schedule(cfg.schedule)
    _check_data(cfg.data)
    _check_shard(cfg)


def _check_trainer(t: DictConfig) -> None:
    if t.precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"trainer.precision must be fp32, bf16 or fp16, got {t.precision!r}")
    for name in ("max_steps", "batch_size", "grad_accum", "log_every"):
        if getattr(t, name) < (0 if name == "max_steps" else 1):
            raise ConfigError(f"trainer.{name} must be positive, got {getattr(t, name)}")
    if t.batch_size % t.grad_accum:
        raise ConfigError(
            f"trainer.batch_size={t.batch_size} must be divisible by trainer.grad_accum={t.grad_accum}"
        )
    _check_fault_keys(t)


def _check_fault_keys(t: DictConfig) -> None:
    """``trainer.on_nonfinite`` and ``trainer.hang_timeout_s`` (see docs/fault-tolerance.md)."""
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


def _check_optim(o: DictConfig) -> None:
    if not (math.isfinite(o.lr) and o.lr > 0):
        raise _bad("optim.lr", o.lr, "the learning rate must be a finite number > 0")
    if o.clip is not None and not (o.clip > 0):
        raise _bad(
            "optim.clip",
            o.clip,
            "the gradient-norm clip must be > 0",
            "use optim.clip=null for no clipping",
        )
    for name in ("b1", "b2"):
        if not 0 <= o[name] < 1:
            raise _bad(f"optim.{name}", o[name], "must be in [0, 1)")
    if not o.eps > 0:
        raise _bad("optim.eps", o.eps, "must be > 0")
    for name in ("weight_decay", "momentum"):
        if not o[name] >= 0:
            raise _bad(f"optim.{name}", o[name], "must be >= 0")


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
        merged = OmegaConf.merge(o, {k: v for k, v in group.items() if k != "params"})
        try:
            _check_optim(merged)
        except ConfigError as err:
            raise ConfigError(f"{key}: {err}") from None


def _check_lora(lora) -> None:
    if lora is None:
        return
    if lora.rank < 0:
        raise _bad("model.lora.rank", lora.rank, "must be >= 0", "0 turns LoRA off")
    if not lora.alpha > 0:
        raise _bad("model.lora.alpha", lora.alpha, "must be > 0")
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


def _check_shard(cfg: DictConfig) -> None:
    shard, t = cfg.dist.shard, cfg.trainer
    if shard not in ("none", "optimizer", "full"):
        raise _bad("dist.shard", shard, "must be none, optimizer or full")
    clash = [
        f"{k}={v}" for k, v in (("trainer.donate", t.donate), ("trainer.compile", t.compile)) if v
    ] + (["trainer.precision=fp16"] if t.precision == "fp16" else [])
    if shard != "none" and clash:
        raise _bad(
            "dist.shard",
            shard,
            f"a sharded optimizer state does not combine with {', '.join(clash)} yet",
            "drop those settings or use dist.shard=none",
        )


def _check_schedule(s: DictConfig) -> None:
    if s.warmup_steps < 0:
        raise _bad("schedule.warmup_steps", s.warmup_steps, "must be >= 0")
    if s.decay_steps is not None and s.decay_steps < 1:
        raise _bad(
            "schedule.decay_steps",
            s.decay_steps,
            "must be >= 1",
            "use schedule.decay_steps=null to decay over trainer.max_steps",
        )
    if not 0 <= s.end_factor <= 1:
        raise _bad("schedule.end_factor", s.end_factor, "must be in [0, 1]")


# data sources that read the user's files: what data.path must name
_NEEDS_PATH = {
    "text": "a directory or glob of text files",
    "tokens": "a directory holding train.bin and val.bin",
}


def _check_data(d: DictConfig) -> None:
    if not 0 <= d.val_fraction < 1:
        raise _bad(
            "data.val_fraction", d.val_fraction, "must be in [0, 1) (a share of the data held out)"
        )
    if d.name in _NEEDS_PATH and not d.path:
        raise ConfigError(
            f"data={d.name} needs data.path: set data.path=PATH to {_NEEDS_PATH[d.name]}"
        )
    if d.prefetch < 0:
        raise _bad("data.prefetch", d.prefetch, "must be >= 0")


def to_plain(cfg: DictConfig) -> dict:
    """The resolved config as plain JSON-able Python data."""
    return OmegaConf.to_container(cfg, resolve=True)


def config_hash(plain: dict) -> str:
    """A stable short hash of a config section (sorted-key JSON, sha256)."""
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:16]
