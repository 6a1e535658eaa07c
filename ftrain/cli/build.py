"""Turn a resolved config into the run's parts: model, optimizer, data, checkpoint manager.

Each builder reads one config section. Models and sources are looked up in small
registries so a recipe can add its own (``register_model``; ``ftrain.data.register_source``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ftrain import optim, rng
from ftrain.ckpt import (
    AnyOf,
    BestN,
    CheckpointManager,
    EveryKSteps,
    EveryNSeconds,
    EveryNSteps,
    LatestN,
)
from ftrain.cli.finetune import group_settings, labeller, lora_enabled, uses_groups
from ftrain.config import ConfigError
from ftrain.data import Source
from ftrain.data.sources import source_from_config
from ftrain.lora import apply_lora

__all__ = [
    "build_manager",
    "build_model",
    "build_sources",
    "build_tx",
    "pick_device",
    "register_model",
]

ModelBuilder = Callable[[DictConfig, torch.Generator], tuple[nn.Module, Callable]]
_MODELS: dict[str, ModelBuilder] = {}


def register_model(name: str):
    """Register ``builder(model_cfg, generator) -> (module, loss_fn)`` under ``model.name``."""

    def add(builder: ModelBuilder) -> ModelBuilder:
        _MODELS[name] = builder
        return builder

    return add


@register_model("gpt2")
def _gpt2(model_cfg: DictConfig, generator: torch.Generator):
    from ftrain.recipes.gpt2 import GPT, GPTConfig, lm_loss

    fields = {
        k: model_cfg[k]
        for k in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "dropout", "bias")
    }
    return GPT(GPTConfig(**fields), generator=generator), lm_loss


def pick_device(name: str) -> torch.device:
    """``auto`` = CUDA when present, else CPU; otherwise the named device.

    Raises:
        ConfigError: not a device name, or CUDA asked for where there is none.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(
            f"trainer.device={name!r} is not a device; use auto, cpu, cuda or cuda:N"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.device={name!r} but no CUDA device is available; use trainer.device=cpu"
        )
    return device


def build_model(cfg: DictConfig) -> tuple[nn.Module, Callable]:
    """The model (initialised from the run's init key, never global RNG) and its loss.

    Raises:
        ConfigError: unknown ``model.name`` or a shape the model rejects.
    """
    if cfg.model.name not in _MODELS:
        raise ConfigError(f"model.name={cfg.model.name!r} is unknown; known: {sorted(_MODELS)}")
    init_key = rng.fold_in(rng.key(cfg.trainer.seed), rng.STREAM_INIT)
    generator = rng.generator(init_key)
    try:
        model, loss_fn = _MODELS[cfg.model.name](cfg.model, generator)
        if lora_enabled(cfg):  # drawn after the base weights: the base is the same either way
            lo = cfg.model.lora
            apply_lora(
                model,
                rank=int(lo.rank),
                alpha=float(lo.alpha),
                targets=list(lo.targets),
                generator=generator,
                dropout=float(lo.dropout),
            )
    except ValueError as err:  # the model's own validation of its shape, or LoRA's
        raise ConfigError(f"model config rejected: {err}") from None
    return model, loss_fn


def schedule_horizon(cfg: DictConfig, saved: int | None = None) -> int:
    """Steps the LR schedule decays over: ``schedule.decay_steps`` if set, else the horizon a
    checkpoint of this run recorded, else ``trainer.max_steps``.

    Taking the recorded horizon keeps a run's LR curve fixed when a resume only extends
    ``trainer.max_steps``, so the continued run matches one that never stopped.
    """
    if cfg.schedule.decay_steps is not None:
        return int(cfg.schedule.decay_steps)
    return int(saved) if saved is not None else int(cfg.trainer.max_steps)


def build_schedule(cfg: DictConfig, horizon: int, lr: float | None = None):
    """The LR schedule of ``cfg.schedule`` over ``horizon`` steps (see :func:`schedule_horizon`),
    peaking at ``lr`` (default ``optim.lr``; a parameter group's own ``lr``).

    Raises:
        ConfigError: unknown ``schedule.name``.
    """
    s, lr = cfg.schedule, cfg.optim.lr if lr is None else lr
    if s.name == "constant":
        return optim.schedule.constant(lr)
    if s.name == "warmup_cosine":
        return optim.schedule.warmup_cosine(
            lr, s.warmup_steps, max(horizon, s.warmup_steps + 1), lr * s.end_factor
        )
    raise ConfigError(f"schedule.name={s.name!r} is unknown; use warmup_cosine or constant")


def build_tx(cfg: DictConfig, horizon: int | None = None):
    """The whole gradient pipeline: ``optim.clip`` clipping, then the optimizer (one per
    parameter group, frozen parameters left out: :mod:`ftrain.cli.finetune`), inside fp16
    loss scaling when ``trainer.precision=fp16``.

    Raises:
        ConfigError: unknown ``optim.name``.
    """
    horizon = horizon if horizon is not None else schedule_horizon(cfg)
    if uses_groups(cfg):
        transforms = {"default": _optimizer(cfg, cfg.optim, horizon)}
        transforms |= {n: _optimizer(cfg, o, horizon) for n, o in group_settings(cfg).items()}
        transforms["frozen"] = optim.frozen()
        tx = optim.multi_transform(transforms, labeller(cfg))
    else:
        tx = _optimizer(cfg, cfg.optim, horizon)
    if cfg.optim.clip is not None:
        tx = optim.chain(optim.clip_by_global_norm(cfg.optim.clip), tx)
    if cfg.trainer.precision == "fp16":
        tx = optim.dynamic_loss_scale(tx)
    return tx


def _optimizer(cfg: DictConfig, o: DictConfig, horizon: int):
    """The optimizer ``o`` (the optim group, or a parameter group's merged settings) as an
    ftrain.optim chain; decay only on >= 2-D weights (GPT-2 practice).

    Raises:
        ConfigError: unknown ``optim.name``.
    """
    sched = build_schedule(cfg, horizon, o.lr)
    if o.name == "adamw":
        return optim.adamw(
            sched,
            b1=o.b1,
            b2=o.b2,
            eps=o.eps,
            weight_decay=o.weight_decay,
            mask=optim.masks.ndim_at_least(2),
        )
    if o.name == "sgd":
        return optim.sgd(
            sched, momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay
        )
    raise ConfigError(f"optim.name={o.name!r} is unknown; use adamw or sgd")


def build_sources(cfg: DictConfig) -> tuple[Source, Source]:
    """The train and val splits of ``data.name`` (any registered source).

    Raises:
        ConfigError: unknown ``data.name``; DataPathError / DataFormatError: bad data.
    """
    d = OmegaConf.to_container(cfg.data, resolve=True)
    try:
        return source_from_config(d, split="train"), source_from_config(d, split="val")
    except KeyError as err:  # unknown source name: the message lists the known ones
        raise ConfigError(str(err.args[0]) if err.args else str(err)) from None


def build_manager(cfg: DictConfig) -> CheckpointManager:
    """The checkpoint manager with the configured save and keep policies."""
    c = cfg.checkpoint
    save = [EveryNSteps(c.every_steps)] if c.every_steps else []
    save += [EveryNSeconds(c.every_seconds)] if c.every_seconds else []
    keep = [LatestN(c.keep_last)] if c.keep_last else []
    keep += [EveryKSteps(c.keep_every)] if c.keep_every else []
    keep += [BestN(c.best_metric, c.keep_best, mode="min")] if c.keep_best else []
    return CheckpointManager(
        c.dir,
        save_policy=AnyOf(*save) if save else _Never(),
        keep_policy=AnyOf(*keep) if keep else None,
        async_save=c.async_save,
        fallback_directory=c.fallback_dir,
        compression=c.compression,
    )


class _Never:
    """Save policy when neither every_steps nor every_seconds is set: only forced saves."""

    def should_save(self, ctx) -> bool:
        return False
