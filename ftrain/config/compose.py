"""Compose the run's config from ``ftrain/conf`` with Hydra's compose API.

We call ``hydra.compose`` ourselves rather than decorating ``main`` with ``@hydra.main``:
the run directory is ours (``run.dir``), Hydra neither changes the working directory nor
creates ``outputs/``, it works the same under ``torchrun``, and every composition error
becomes one clear :class:`ConfigError` instead of a stack trace.
"""

from __future__ import annotations

import hashlib
import json

import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ftrain.config.schema import register_configs

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
            cfg = compose(config_name="config", overrides=list(overrides))
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_explain(err, overrides)) from None
    finally:
        GlobalHydra.instance().clear()
    _check_values(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _explain(err: Exception, overrides) -> str:
    msg = str(err).strip()
    cause = err.__cause__ or err.__context__
    if cause is not None and str(cause).strip() not in msg:
        msg += "\n  " + str(cause).strip().replace("\n", "\n  ")
    hint = (
        "check the key against `python -m ftrain --cfg` (keys: run, model, optim, schedule, data, "
        "checkpoint, trainer, dist, resume); add a new key with +key=value only if a recipe expects it"
    )
    return f"invalid config from overrides {list(overrides)}:\n  {msg}\n  fix: {hint}"


def _check_values(cfg: DictConfig) -> None:
    resume = cfg.resume
    if not (resume in ("latest", "none") or (isinstance(resume, int) and resume >= 0)):
        raise ConfigError(
            f"resume must be 'latest', 'none' or a step number >= 0, got resume={resume!r}"
        )
    t = cfg.trainer
    if t.precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"trainer.precision must be fp32, bf16 or fp16, got {t.precision!r}")
    for name in ("max_steps", "batch_size", "grad_accum", "log_every"):
        if getattr(t, name) < (0 if name == "max_steps" else 1):
            raise ConfigError(f"trainer.{name} must be positive, got {getattr(t, name)}")
    if t.batch_size % t.grad_accum:
        raise ConfigError(
            f"trainer.batch_size={t.batch_size} must be divisible by trainer.grad_accum={t.grad_accum}"
        )


def to_plain(cfg: DictConfig) -> dict:
    """The resolved config as plain JSON-able Python data."""
    return OmegaConf.to_container(cfg, resolve=True)


def config_hash(plain: dict) -> str:
    """A stable short hash of a config section (sorted-key JSON, sha256)."""
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:16]
