"""Turn a resolved config into the run's parts: model, optimizer, data, checkpoint manager.

Each builder reads one config section. Models, optimizers, schedules and data sources
are the ``_target_`` of their config option (:mod:`ftrain.cli.targets`); a script that
calls :func:`ftrain.cli.run.main` itself may also ``register_model`` a builder under a
``model.name`` (it takes precedence over ``_target_``), and data sources registered with
``ftrain.data.register_source`` are picked by ``data.name`` in a data option without one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDictBase
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
from ftrain.ckpt.location import is_object_url
from ftrain.ckpt.store import check_key_lengths, check_path_lengths, groups_and_arrays
from ftrain.cli.finetune import group_settings, labeller, lora_enabled, uses_groups
from ftrain.cli.targets import (
    build_optimizer,
    call_target,
    gpt2,
    instantiate_model,
    resolve_loss,
)
from ftrain.config import ConfigError
from ftrain.config.compose import largest_divisor
from ftrain.data import Source
from ftrain.data.fingerprint import NoCacheDirError, cache_path
from ftrain.data.sources import DataPathError, source_from_config
from ftrain.lora import apply_lora

__all__ = [
    "build_manager",
    "check_checkpoint_paths",
    "build_model",
    "build_sources",
    "build_tx",
    "pick_device",
    "register_model",
]

ModelBuilder = Callable[[DictConfig, torch.Generator], tuple[nn.Module, Callable]]
_MODELS: dict[str, ModelBuilder] = {}


def register_model(name: str):
    """Register ``builder(model_cfg, generator) -> (module, loss_fn)`` under ``model.name``
    (for a script that calls :func:`ftrain.cli.run.main` itself; ``python -m ftrain`` takes
    a model YAML with ``_target_`` instead). A registered name wins over ``_target_``."""

    def add(builder: ModelBuilder) -> ModelBuilder:
        _MODELS[name] = builder
        return builder

    return add


def _gpt2(model_cfg: DictConfig, generator: torch.Generator):
    """The GPT-2 recipe as a ``register_model`` builder (to wrap it in a script)."""
    from ftrain.recipes.gpt2 import lm_loss

    shape = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "dropout", "bias")
    return gpt2(**{k: model_cfg[k] for k in shape}, generator=generator), lm_loss


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
    if device.type not in ("cpu", "cuda"):  # mps, meta, xpu...: failed deep inside torch
        raise ConfigError(
            f"trainer.device={name!r}: ftrain trains on cpu or cuda; use auto, cpu, cuda or cuda:N"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.device={name!r} but no CUDA device is available; use trainer.device=cpu"
        )
    return device


def check_cache_home(cfg: DictConfig) -> None:
    """A data cache directory can be named where the data source keeps its tokens there
    (HOME unset with a uid that has no home was a ``RuntimeError`` traceback from
    ``Path.home()`` at the corpus' first read; a custom source never used the cache).

    Raises:
        ConfigError: naming FTRAIN_CACHE_DIR and data.cache_dir.
    """
    if cfg.data.get("name") not in _CACHED_SOURCES:  # a token file is hashed uncached
        return
    try:
        cache_path(cfg.data.get("cache_dir"))
    except NoCacheDirError as err:
        raise ConfigError(str(err)) from None


_CACHED_SOURCES = ("stdlib", "text")  # sources whose tokens live in the data cache


def build_model(cfg: DictConfig, notes: list[str] | None = None) -> tuple[nn.Module, Callable]:
    """The model (initialised from the run's init key, never global RNG) and its loss.

    ``notes``, given, takes the building's warnings as ``warning: ...`` lines (a LoRA
    target that matches nothing) for the start report, said once by the coordinator, as the
    other start warnings are; else they stay Python warnings.

    Raises:
        ConfigError: no ``model._target_`` (nor a registered ``model.name``), a target that
            cannot be built, or a shape the model rejects.
    """
    init_key = rng.fold_in(rng.key(cfg.trainer.seed), rng.STREAM_INIT)
    generator = rng.generator(init_key)
    try:
        model, loss_fn = _make_model(cfg.model, generator)
        if lora_enabled(cfg):  # drawn after the base weights: the base is the same either way
            _noted(notes, _apply_lora, model, cfg.model.lora, generator)
    except ValueError as err:  # the model's own validation of its shape, or LoRA's
        raise ConfigError(f"model config rejected: {err}") from None
    if next(model.parameters(), None) is None:  # failed at the first step, a traceback
        raise ConfigError(
            f"the model ({type(model).__name__}) has no parameters: nothing to train; "
            "model._target_ (or model.name) must build one that has"
        )
    return model, loss_fn


def _make_model(node: DictConfig, generator: torch.Generator) -> tuple[nn.Module, Callable]:
    name = node.get("name")
    if name in _MODELS:  # registered by the script that runs ftrain: explicit, so it wins
        return _MODELS[name](node, generator)
    return instantiate_model(node, generator), resolve_loss(node)


def schedule_horizon(cfg: DictConfig, saved: int | None = None) -> int:
    """Steps the LR schedule decays over: ``schedule.decay_steps`` if set, else the horizon a
    checkpoint of this run recorded, else ``trainer.max_steps``.

    Taking the recorded horizon keeps a run's LR curve fixed when a resume only extends
    ``trainer.max_steps``, so the continued run matches one that never stopped.
    """
    decay_steps = cfg.schedule.get("decay_steps")
    if decay_steps is not None:
        return int(decay_steps)
    # a recorded 0 (a max_steps=0 start, before 2026-12-06) fixed no curve
    return int(saved) if saved else int(cfg.trainer.max_steps)


def _apply_lora(model: nn.Module, lo: DictConfig, generator: torch.Generator) -> None:
    apply_lora(
        model,
        rank=int(lo.rank),
        alpha=float(lo.alpha),
        targets=list(lo.targets),
        generator=generator,
        dropout=float(lo.dropout),
    )


def _noted(notes: list[str] | None, fn: Callable, *args) -> None:
    """``fn(*args)``, its RuntimeWarnings appended to ``notes`` (when given) as lines."""
    if notes is None:
        fn(*args)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        fn(*args)
    for w in caught:
        if issubclass(w.category, RuntimeWarning):
            notes.append(f"warning: {w.message}")
        else:  # not ours to reword: as it came
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def build_schedule(cfg: DictConfig, horizon: int, lr: float | None = None):
    """The LR schedule of ``cfg.schedule`` over ``horizon`` steps (see :func:`schedule_horizon`),
    peaking at ``lr`` (default ``optim.lr``; a parameter group's own ``lr``).

    Raises:
        ConfigError: no ``schedule._target_`` or one that cannot be built.
    """
    lr = cfg.optim.lr if lr is None else lr
    return call_target("schedule", cfg.schedule, float(lr), int(horizon))


def build_tx(cfg: DictConfig, horizon: int | None = None):
    """The whole gradient pipeline: ``optim.clip`` clipping, then the optimizer (one per
    parameter group, frozen parameters left out: :mod:`ftrain.cli.finetune`), inside fp16
    loss scaling when ``trainer.precision=fp16``.

    Raises:
        ConfigError: no ``optim._target_`` or one that cannot be built.
    """
    horizon = horizon if horizon is not None else schedule_horizon(cfg)
    if uses_groups(cfg):
        transforms = {"default": _optimizer(cfg, cfg.optim, horizon)}
        transforms |= {n: _optimizer(cfg, o, horizon) for n, o in group_settings(cfg).items()}
        transforms["frozen"] = optim.frozen()
        tx = optim.multi_transform(transforms, labeller(cfg))
    else:
        tx = _optimizer(cfg, cfg.optim, horizon)
    clip = cfg.optim.get("clip")
    if clip is not None:
        tx = optim.chain(optim.clip_by_global_norm(clip), tx)
    if cfg.trainer.precision == "fp16":
        tx = optim.dynamic_loss_scale(tx)
    return tx


def _optimizer(cfg: DictConfig, o: DictConfig, horizon: int):
    """The optimizer ``o`` (the optim group, or a parameter group's merged settings):
    ``o._target_(schedule, **o's other keys)``.

    Raises:
        ConfigError: no ``optim._target_`` or one that cannot be built.
    """
    return build_optimizer(o, build_schedule(cfg, horizon, o.lr))


def build_sources(cfg: DictConfig) -> tuple[Source, Source | None]:
    """The train and val splits of ``data.name`` (any registered source); no val split
    when ``data.val_fraction=0`` holds nothing out of a split-by-range source.

    Raises:
        ConfigError: unknown ``data.name``; DataPathError / DataFormatError: bad data.
    """
    d = OmegaConf.to_container(cfg.data, resolve=True)
    try:
        train = source_from_config(d, split="train")
        _check_not_own_files(cfg, train)
        if holds_out_nothing(d, train) or not _uses_val(cfg):
            return train, None
        return train, source_from_config(d, split="val")
    except KeyError as err:  # unknown source name: the message lists the known ones
        raise ConfigError(str(err.args[0]) if err.args else str(err)) from None


def _check_not_own_files(cfg: DictConfig, train: Source) -> None:
    """A text corpus must not take in the run's own files: ``data.path=.`` with the default
    ``run.dir=runs/...`` (or a cache inside the corpus) tokenized the run's records and
    checkpoint chunks, which change on every start, so every restart was refused as
    "the dataset differs" (or, allowed, trained on them).

    Raises:
        DataPathError: naming the corpus entry, the run's directory inside it, the fix.
    """
    files = getattr(train, "files", None)
    if not files:
        return
    own = {
        "run.dir": cfg.run.dir,
        "checkpoint.dir": cfg.checkpoint.dir,
        "checkpoint.fallback_dir": cfg.checkpoint.fallback_dir,
        "the data cache (data.cache_dir / FTRAIN_CACHE_DIR)": str(
            cache_path(cfg.data.get("cache_dir"))
        ),
    }
    resolved = [(f, Path(f).resolve().parents) for f in files]
    for key, where in own.items():
        if not where or "://" in str(where):
            continue
        inside = Path(where).resolve()
        hit = next((f for f, parents in resolved if inside in parents), None)
        if hit is not None:
            raise DataPathError(
                f"data.path={cfg.data.path} takes in {key} ({where}): e.g. {hit}; its files "
                "change on every start (so would the data, refused on resume) and are not "
                "training data. Point data.path at the data alone, or put the run elsewhere "
                "(run.dir=..., data.cache_dir=...)"
            )


def _uses_val(cfg: DictConfig) -> bool:
    """Whether the run reads a val split: it evaluates, or ranks steps by a ``val_*``
    metric (refused later without one). A token directory without ``val.bin`` was refused
    even with evaluation off."""
    c = cfg.checkpoint
    return bool(cfg.trainer.eval_every) or bool(
        c.keep_best and str(c.best_metric).startswith("val_")
    )


def holds_out_nothing(data: dict, train: Source) -> bool:
    """``data.val_fraction=0`` on a source that splits one token range (a text corpus, one
    token file): the train split is every token and there is no val split (a token
    directory's ``val.bin`` is its own file, whatever the fraction)."""
    return data.get("val_fraction") == 0 and getattr(train, "splits_by_range", False)


def evaluates(cfg: DictConfig, val: Source | None) -> bool:
    """Whether this run evaluates at all; with no val split (``data.val_fraction=0``) a
    ranking by a ``val_*`` metric would keep no step by it, silently.

    Raises:
        ConfigError: ``checkpoint.keep_best`` by a ``val_*`` metric with no val split.
    """
    c = cfg.checkpoint
    if val is None and c.keep_best and str(c.best_metric).startswith("val_"):
        raise ConfigError(
            f"checkpoint.best_metric={c.best_metric} ranks steps by evaluations, and "
            "data.val_fraction=0 holds out no data to evaluate on; set data.val_fraction "
            "(e.g. 0.05), or rank by a step metric (checkpoint.best_metric=loss)"
        )
    return val is not None and bool(cfg.trainer.eval_every)


def eval_repeat_note(cfg: DictConfig, val: Source | None) -> str | None:
    """A note when an evaluation asks for more samples than the val split holds
    (``trainer.eval_batches`` x ``trainer.batch_size``): the batches wrap around, so
    ``val_loss`` counts some samples twice and costs more than the split is worth."""
    return repeat_note(cfg.trainer, len(val)) if evaluates(cfg, val) else None


def repeat_note(t: DictConfig, have: int) -> str | None:
    """:func:`eval_repeat_note` for ``trainer`` settings ``t`` and a split of ``have``
    samples (also ``python -m ftrain.eval``'s)."""
    want = t.eval_batches * t.batch_size
    if want <= have:
        return None
    said = (
        f"evaluation reads {want} val samples (trainer.eval_batches={t.eval_batches} x "
        f"trainer.batch_size={t.batch_size}) but the val split holds {have}: samples repeat "
        "in every evaluation; "
    )
    more = "give the val split more data (data.val_fraction, or a bigger val.bin)"
    if have < t.batch_size:  # fewer eval batches cannot help: one batch already repeats
        return said + f"a batch of {t.batch_size} repeats them at any eval_batches: {more}"
    return said + f"trainer.eval_batches={have // t.batch_size} reads each at most once (or {more})"


def check_block_size(cfg) -> None:
    """``data.block_size`` against the model's context (``model.block_size``, where the
    model has one): a longer one passed the start and failed at step 1 with the model's
    traceback, after an emergency save.

    Raises:
        ConfigError: naming both keys and the fix.
    """
    block, most = cfg.data.block_size, cfg.model.get("block_size")
    if isinstance(most, int) and most < 1:  # blamed data.block_size, with an impossible fix
        raise ConfigError(
            f"model.block_size={most} is invalid: the model's context must be >= 1 token"
        )
    if isinstance(most, int) and not 1 <= block <= most:
        raise ConfigError(
            f"data.block_size={block} is invalid: the model reads 1..{most} tokens a sequence "
            f"(model.block_size={most}); use data.block_size={most} or less, or a model with a "
            "longer model.block_size"
        )


def check_batch(trainer, source: Source, world_size: int = 1) -> None:
    """The global batch against the data and the ranks, at start: a batch larger than the
    training split ran out of memory building its epoch order; one the ranks cannot split
    evenly, or whose per-rank share ``trainer.grad_accum`` cannot split, failed on every
    rank after start-up (the second after an emergency save).

    Raises:
        ConfigError: ``trainer.batch_size`` above the split's sample count, not a multiple
            of the world size, or a per-rank share not divisible by ``trainer.grad_accum``.
    """
    batch, accum, n = trainer.batch_size, trainer.grad_accum, len(source)
    if n == 0:  # "use trainer.batch_size=0 or less" was the advice
        raise ConfigError(
            f"the training split holds no sample ({source.describe().get('kind', 'the source')} "
            f"of data.block_size={source.block_size} tokens a sample): point the data at more "
            "text, lower data.block_size, or fix the source's __len__"
        )
    if batch > n:
        raise ConfigError(
            f"trainer.batch_size={batch} is larger than the training split ({n:,} "
            f"samples of data.block_size tokens); use trainer.batch_size={n} or less, or more data"
        )
    # a resume keeps its checkpoint's batch size (a change is refused as a config change):
    # each message also names the fix that keeps it
    if batch % world_size:
        ranks = _ranks_for(batch, accum, world_size)
        raise ConfigError(
            f"trainer.batch_size={batch} (the global batch) does not split over {world_size} "
            f"ranks; use a multiple of {world_size}, e.g. trainer.batch_size="
            f"{max(world_size, batch - batch % world_size)}, or, to keep this batch size (a "
            f"resume), launch {ranks} rank{'s' * (ranks > 1)} (a divisor of {batch})"
        )
    share = batch // world_size
    if share % accum:
        raise ConfigError(
            f"trainer.batch_size={batch} gives each of the {world_size} ranks {share} "
            f"samples, not divisible by trainer.grad_accum={accum}; use a trainer.batch_size "
            f"that is a multiple of {world_size * accum} (ranks x grad_accum), or, to keep "
            f"this batch size (a resume), trainer.grad_accum={largest_divisor(share, accum)}"
        )


def _ranks_for(batch: int, accum: int, at_most: int) -> int:
    """The most ranks (up to ``at_most``) that split ``batch`` into shares ``accum``
    splits too (1 always does when ``accum`` divides ``batch``; else the fewest that fit)."""
    fits = [d for d in range(1, at_most + 1) if batch % d == 0 and (batch // d) % accum == 0]
    return max(fits) if fits else largest_divisor(batch, at_most)


def model_vocab(model_cfg) -> int | None:
    """``model.vocab_size`` when the model has one (an int), else None."""
    ours = model_cfg.get("vocab_size") if model_cfg is not None else None
    return ours if isinstance(ours, int) and not isinstance(ours, bool) else None


def check_vocab(model_cfg, source: Source) -> None:
    """A model whose embedding has fewer rows than the data has token ids fails at the
    first batch deep inside ``F.embedding``; say so at start, with the fix.

    Raises:
        ConfigError: ``model.vocab_size`` below the source's declared ``vocab_size``.
    """
    ours, theirs = model_vocab(model_cfg), source.describe().get("vocab_size")
    if ours is not None and isinstance(theirs, int) and ours < theirs:
        raise ConfigError(
            f"model.vocab_size={ours} is smaller than the data's vocabulary ({theirs} token "
            f"ids, {source.describe().get('tokenizer') or 'as the source declares'}); set "
            f"model.vocab_size={theirs} or more"
        )


def build_manager(cfg: DictConfig) -> CheckpointManager:
    """The checkpoint manager with the configured save and keep policies."""
    c = cfg.checkpoint
    save = [EveryNSteps(c.every_steps)] if c.every_steps else []
    save += [EveryNSeconds(c.every_seconds)] if c.every_seconds else []
    return CheckpointManager(
        c.dir,
        save_policy=AnyOf(*save) if save else _Never(),
        keep_policy=keep_policy_of(c),
        async_save=c.async_save,
        fallback_directory=c.fallback_dir,
        compression=c.compression,
        incremental=c.incremental,
        storage_options=c.storage,
    )


def check_checkpoint_paths(cfg: DictConfig, fresh: TensorDictBase) -> None:
    """Every chunk of this state fits PATH_MAX under the local checkpoint directories, and
    an object store's 1,024-byte keys under a URL: a ``checkpoint.dir`` of ~4,000 bytes
    trained until its first save failed (ENAMETOOLONG, the emergency save too),
    ``checkpoint.every_steps`` of compute lost per attempt."""
    leaves = groups_and_arrays(fresh)[1]
    for key in ("dir", "fallback_dir"):
        where = cfg.checkpoint[key]
        if not where:
            continue
        try:
            if is_object_url(str(where)):  # a store's keys: 1,024 bytes
                check_key_lengths(str(where), leaves)
            else:
                check_path_lengths(Path(where), leaves)
        except ValueError as err:
            raise ConfigError(f"checkpoint.{key} is too long for this state: {err}") from None


# the checkpoint keys that make the keep policy
KEEP_KEYS = ("keep_last", "keep_every", "keep_best", "best_metric")


def keep_policy_of(c) -> AnyOf | None:
    """The keep policy of a ``checkpoint`` config (this run's, or the one a step recorded:
    anything with ``get``); ``None``: keep every step."""
    keep = [LatestN(c.get("keep_last"))] if c.get("keep_last") else []
    keep += [EveryKSteps(c.get("keep_every"))] if c.get("keep_every") else []
    best = c.get("keep_best")
    keep += [BestN(c.get("best_metric") or "val_loss", best, mode="min")] if best else []
    return AnyOf(*keep) if keep else None


class _Never:
    """Save policy when neither every_steps nor every_seconds is set: only forced saves."""

    def should_save(self, ctx) -> bool:
        return False
