"""Typed schemas for the Hydra config: every group's YAML is validated against these.

A wrong type (``trainer.max_steps=abc``) or an unknown key (``trainer.max_step=10``) is
rejected at composition time with the key named, before any training starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class RunConfig:
    name: str = "default"
    dir: str = "runs/${run.name}"
    overwrite: bool = False
    allow_config_change: bool = False
    plot: bool = True


@dataclass
class LoraConfig:
    rank: int = 0  # 0: no adapters; > 0: LoRA on the targets, everything else frozen
    alpha: float = 16.0  # the adapters' update is scaled by alpha / rank
    targets: list[str] = field(default_factory=lambda: ["c_attn", "c_proj"])
    dropout: float = 0.0


@dataclass
class ModelConfig:
    """``model=gpt2``/``gpt2_tiny``: the GPT-2 recipe. A user's own model YAML need not use
    this schema: ``_target_`` (the nn.Module, built with its YAML's other keys) and ``loss``."""

    _target_: str | None = None  # called with the shape keys (ftrain.cli.targets.gpt2)
    loss: str | None = None  # dotted path of loss_fn(model, batch) -> loss | (loss, aux)
    name: str = MISSING
    block_size: int = 64
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class OptimConfig:
    _target_: str | None = None  # _target_(schedule, **other keys) -> GradientTransformation
    name: str = "adamw"
    lr: float = 6e-4
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    momentum: float = 0.0
    nesterov: bool = False
    # Adam's moments and update in torch's fused kernel (optim.adamw(fused=True))
    fused: bool = False
    clip: float | None = 1.0
    # globs over parameter paths that get no gradient and no optimizer state
    freeze: list[str] = field(default_factory=list)
    # per-group settings: {name: {params: [globs], lr: ..., weight_decay: ..., ...}}
    groups: dict[str, Any] = field(default_factory=dict)


@dataclass
class ScheduleConfig:
    _target_: str | None = None  # _target_(lr, horizon, **other keys) -> count -> lr
    name: str = "warmup_cosine"
    warmup_steps: int = 10
    decay_steps: int | None = None  # None: decay over trainer.max_steps
    end_factor: float = 0.1  # final lr = end_factor * optim.lr


@dataclass
class DataConfig:
    _target_: str | None = None  # the source factory; None: the source registered as name
    name: str = "stdlib"
    path: str | None = None
    block_size: int = "${model.block_size}"  # type: ignore[assignment]
    val_fraction: float = 0.05
    shuffle: bool = True
    drop_last: bool = False
    prefetch: int = 2
    allow_changed: bool = False
    cache_dir: str | None = None
    dtype: str = "uint16"


@dataclass
class CheckpointConfig:
    dir: str = "${run.dir}/checkpoints"
    every_steps: int | None = 100
    every_seconds: float | None = None
    keep_last: int | None = 3
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str = "val_loss"
    async_save: bool = True
    fallback_dir: str | None = None
    # a checkpoint location outside run.dir is claimed for one run.dir (ftrain.ckpt.owner);
    # true: take over another run directory's claim (that run is gone)
    take_over: bool = False
    # resume by mapping the step's chunk files copy-on-write (restore(mmap=True)): local
    # directories, replicated state only (docs/checkpointing.md, "Mapped restore")
    mmap_restore: bool = False
    compression: str | None = None
    # link/copy the chunks of unchanged leaves instead of rewriting them (ftrain.ckpt.incremental)
    incremental: bool = True
    # object-store options (endpoint, region, access_key_id, allow_http, ...) over the
    # AWS_*/GOOGLE_*/AZURE_* environment; secrets are never written into checkpoints
    storage: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainerConfig:
    max_steps: int = 200
    seed: int = 0
    batch_size: int = 8
    grad_accum: int = 1
    precision: str = "fp32"
    eval_every: int | None = 50
    eval_batches: int = 4
    log_every: int = 1
    device: str = "auto"
    donate: bool = False
    # true | false | auto: the step's tensor core under torch.compile (ftrain.compiled);
    # auto compiles when the run is long enough to repay the compile (should_compile)
    compile: Any = False
    on_nonfinite: str = "stop"  # stop | skip | continue (ftrain.loop)
    hang_timeout_s: float | None = None  # null: no hang watchdog (ftrain.watchdog)


@dataclass
class DistConfig:
    backend: str = "auto"
    timeout_s: int = 600
    shard: str = "none"  # none | optimizer (ZeRO-1) | full (ZeRO-3): ftrain.sharding


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    # typed by each option's own defaults (/model_schema@_here_ ...): a user's option with
    # a _target_ of its own may carry other keys
    model: Any = MISSING
    optim: Any = MISSING
    schedule: Any = MISSING
    data: Any = MISSING
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    resume: Any = "latest"  # "latest", "none", or a step number
    # {"from": "RUN[:STEP]"}: a fresh start takes its params from another run's checkpoint;
    # {"from_hf": PATH}: from a local Hugging Face GPT-2 (directory or .safetensors file)
    # ("from" is a Python keyword, so this node is a plain dict, checked by the loader)
    init: Any = field(default_factory=lambda: {"from": None, "from_hf": None})
    # {NAME: {_target_: ..., **kwargs}} from the logger group (ftrain.metrics.loggers);
    # metrics.jsonl is always written and needs no entry
    logger: Any = field(default_factory=dict)


# Each config group and the dataclass its options are validated against.
GROUP_SCHEMAS: dict[str, type] = {
    "run": RunConfig,
    "model": ModelConfig,
    "optim": OptimConfig,
    "schedule": ScheduleConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "trainer": TrainerConfig,
    "dist": DistConfig,
}


def register_configs() -> None:
    """Register the schemas so YAML groups are validated (idempotent).

    Each schema is stored at the top level as ``GROUP_schema``, outside its group, so a
    group's YAML extends it with ``- /GROUP_schema@_here_`` in its defaults list while it is
    never a choice: ``model=`` lists, completes and accepts only real options.
    """
    cs = ConfigStore.instance()
    cs.store(name="ftrain_schema", node=Config)
    for group, node in GROUP_SCHEMAS.items():
        if group != "run":  # run has no group directory: its keys live in config.yaml
            cs.store(name=f"{group}_schema", node=node)
