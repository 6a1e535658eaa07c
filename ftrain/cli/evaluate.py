"""``python -m ftrain.eval RUN [--step N] [--json] [KEY=VALUE ...]``: val loss and perplexity.

    python -m ftrain.eval runs/x                      # the newest step that verifies
    python -m ftrain.eval runs/x --step 400           # exactly step 400
    python -m ftrain.eval runs/x data.path=other/ trainer.eval_batches=50 --json

Loads the step's params (and buffers) only, read-only (:mod:`ftrain.ckpt.readonly`: no
sweep, no index, no lock: the run may still be training), so no optimizer state is needed.
The model and the validation data are rebuilt from the config the run recorded in that
checkpoint, merged with the overrides. Only ``data.*`` and ``trainer.{eval_batches,
batch_size,device,precision}`` may be overridden: the model is the checkpoint's. The
recorded config is data: its ``_target_``s must be ftrain's built-in options' (compared as
strings; a checkpoint from before options had targets gets them by ``name``); any other
target is refused, never imported. The batches are the training
run's evaluator's (:func:`ftrain.data.val_batches` of ``trainer.eval_batches`` x
``trainer.batch_size``), so with no data override the result reproduces the ``val_loss``
the run recorded at that step.

A separate entry point rather than ``python -m ftrain mode=eval``: evaluating takes a run
and a step, not a training config; it must never claim, resume or write the run directory
that ``python -m ftrain`` owns; and the training CLI stays one thing.

Exit status: 0 done; 1 no such run, step or checkpoint; 2 a bad override, a config this
ftrain cannot rebuild, a corrupt step, or data that cannot be read.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tensordict import TensorDict

from ftrain._memory import said_out_of_memory
from ftrain.ckpt import CheckpointReadError, CorruptCheckpointError
from ftrain.ckpt.format import CheckpointFormatError
from ftrain.ckpt.location import CheckpointLocationError, CheckpointStoreError
from ftrain.ckpt.readonly import StepSpecError, name_of, read_model
from ftrain.cli.build import (
    build_model,
    check_block_size,
    check_vocab,
    model_vocab,
    pick_device,
    repeat_note,
)
from ftrain.cli.finetune import parse_init_from
from ftrain.cli.targets import check_recorded_targets
from ftrain.config import ConfigError
from ftrain.config.compose import check_data, check_int64, check_precision
from ftrain.config.schema import GROUP_SCHEMAS
from ftrain.data import DataFormatError, DataPathError, val_batches
from ftrain.data.sources import source_from_config
from ftrain.metrics.jsonl import json_safe
from ftrain.state import place
from ftrain.state.tree import flatten
from ftrain.step import check_params_match, evaluate, make_eval_step

__all__ = ["evaluate_run", "main"]

# what an evaluation may change: the data it reads and how it batches/runs them
ALLOWED = ("data.", "trainer.eval_batches", "trainer.batch_size", "trainer.device")
ALLOWED += ("trainer.precision",)
_SOURCE_KEYS = ("data.name", "data._target_")  # which source reads the data: the run's


def eval_config(recorded: dict, overrides: list[str]) -> DictConfig:
    """The run's recorded config with ``overrides`` (``KEY=VALUE``), checked by the schema.

    Raises:
        ConfigError: an override outside :data:`ALLOWED`, an unknown key or a bad type, or a
            recorded config that names code other than a built-in option's ``_target_``.
    """
    for group in ("model", "data", "trainer"):
        if not isinstance(recorded.get(group), dict):
            raise ConfigError(
                f"the checkpoint's recorded config has no usable {group!r} section "
                f"(got {recorded.get(group)!r:.60}): it cannot be evaluated from its record"
            )
    recorded = check_recorded_targets(recorded)  # only ftrain's built-in options' targets
    # Hydra's "+key=value" / "++key=value" spellings mean the same here: every allowed key
    # exists already (given unstripped, "+trainer.eval_batches" was a new top-level key
    # that nothing read: the evaluation ran with the recorded value and exited 0)
    overrides = [item.lstrip("+") for item in overrides]
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or not key.startswith(ALLOWED) or key in _SOURCE_KEYS:
            raise ConfigError(
                f"ftrain.eval override {item!r}: only data.* (but the source: data.name and "
                "data._target_ are the run's; point data.path at other data) and "
                "trainer.eval_batches, trainer.batch_size, trainer.device, trainer.precision "
                "may change (the model is the checkpoint's), as KEY=VALUE"
            )
    try:
        cfg = OmegaConf.create(recorded)
        for group in ("data", "trainer"):  # validate (types, unknown keys) by the schema
            cfg[group] = OmegaConf.merge(OmegaConf.structured(GROUP_SCHEMAS[group]), cfg[group])
        given = OmegaConf.from_dotlist(overrides)
        for group in ("data", "trainer"):
            if group in given:
                cfg[group] = OmegaConf.merge(cfg[group], given[group])
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)  # the message's first line does not name it
        where = f"{key}: " if key else ""
        raise ConfigError(
            f"bad override or recorded config: {where}{err}".splitlines()[0]
        ) from None
    check_int64(cfg)  # trainer.eval_batches=10**23: OverflowError in the loader
    # what evaluation uses, checked as a training start checks it (the recorded training-only
    # keys, grad_accum or eval_every, are the run's and play no part here)
    check_precision(cfg.trainer)
    if not cfg.trainer.eval_batches >= 1 or not cfg.trainer.batch_size >= 1:
        raise ConfigError("trainer.eval_batches and trainer.batch_size must be >= 1")
    check_data(cfg.data)
    check_block_size(cfg)
    return cfg


def evaluate_run(run: str | Path, step: int | None = None, overrides=()) -> dict:
    """Val loss and perplexity of a run's checkpoint (see the module doc).

    Args:
        run: a run directory (its ``checkpoints/``), a checkpoints directory or URL,
            optionally ``:STEP``.
        step: the step (default: ``:STEP`` of ``run``, else the newest that verifies).
        overrides: ``KEY=VALUE`` strings (:data:`ALLOWED` keys).

    Returns:
        ``{"step", "val_loss", "perplexity", "batches", "samples", "tokens", "data",
        "note"}`` (``note``: an evaluation that reads some samples twice says so, else None).

    Raises:
        FileNotFoundError: no such run or step. CorruptCheckpointError: it does not verify.
        ConfigError: see :func:`eval_config`; no recorded config; a model that rejects it.

    Example:
        >>> evaluate_run("runs/x", 400, ["trainer.eval_batches=8"])  # doctest: +SKIP
        {'step': 400, 'val_loss': 1.92, 'perplexity': 6.8, ...}
    """
    try:
        where, at = parse_init_from(str(run))
    except StepSpecError as err:  # RUN:abc of a RUN that exists: a usage error, as below
        raise ConfigError(str(err)) from None
    if step is not None and at is not None and step != at:
        raise ConfigError(f"{run} names step {at} but --step {step}: give the step once")
    try:
        got, tree, attrs = read_model(where, step if step is not None else at)
    except StepSpecError as err:  # RUN:abc:5: the :5 split off, RUN:abc is the same usage error
        raise ConfigError(str(err)) from None
    except CheckpointLocationError as err:  # RUN that reads as a URL ("r1:abc")
        tail = str(run).rsplit(":", 1)[-1]
        hint = f"; RUN:STEP takes a step number, got {tail!r}" if "://" not in str(run) else ""
        raise ConfigError(f"{err}{hint}") from None
    except ValueError as err:  # no params group: a state saved by other code
        raise ConfigError(f"{where}: {err}; ftrain.eval evaluates a model's params") from None
    recorded = attrs.get("config")
    if not isinstance(recorded, dict) or "model" not in recorded:
        raise ConfigError(
            f"step {got} of {name_of(where)} records no run config (not written by python -m ftrain); "
            "evaluate it in Python with ftrain.make_eval_step"
        )
    cfg = eval_config(recorded, list(overrides))
    _refuse_cache_inside(cfg, where)
    device = pick_device(cfg.trainer.device)
    model, loss_fn = build_model(cfg)
    try:  # a missing parameter was evaluated fresh from the module, silently
        check_params_match(model, flatten(tree["params"])[0])
    except ValueError as err:
        raise ConfigError(f"step {got} of {name_of(where)}: {err}") from None
    data = OmegaConf.to_container(cfg.data, resolve=True)
    try:
        val = source_from_config(data, split="val")
    except DataFormatError:  # an empty val split: say why when the run held none out
        _check_held_out(recorded, overrides, f"step {got} of {name_of(where)}")
        raise
    if not _picks_other_data(overrides) and not _allowed_changed(overrides):
        _check_same_val(val, attrs, cfg, f"step {got} of {name_of(where)}")
    check_vocab(cfg.model, val)
    state = TensorDict(
        params=tree["params"], buffers=tree.get("buffers", TensorDict()), batch_size=[]
    )
    t = cfg.trainer
    out = evaluate(
        make_eval_step(model.to(device), loss_fn, precision=t.precision),
        place(state, device),
        val_batches(
            val, t.eval_batches, t.batch_size, device=device, vocab_size=model_vocab(cfg.model)
        ),
    )
    loss = out["loss"]
    return {
        "step": got,
        "val_loss": loss,
        "perplexity": _perplexity(loss),
        "batches": int(t.eval_batches),
        "samples": int(out["samples"]),
        "tokens": int(out["tokens"]) if "tokens" in out else None,  # None: the loss counts none
        "data": val.describe(),
        # more samples asked for than the split holds: some counted more than once
        "note": repeat_note(t, len(val)),
    }


def _refuse_cache_inside(cfg: DictConfig, where) -> None:
    """``data.cache_dir`` inside a checkpoint location read from: evaluation is read-only,
    yet the tokenized corpus (MBs) was cached into the checkpoint directory."""
    cache = cfg.data.get("cache_dir")
    if not cache:
        return
    there = Path(cache).resolve()
    for root in where if isinstance(where, list) else [where]:
        if "://" not in str(root) and (
            there == Path(root).resolve() or Path(root).resolve() in there.parents
        ):
            raise ConfigError(
                f"data.cache_dir={cache} is inside the checkpoint directory {root}, which "
                "ftrain.eval only reads; put the data cache elsewhere"
            )


def _perplexity(loss: float) -> float:
    """``exp(loss)``; a diverged (NaN) loss has a NaN perplexity, not an infinite one."""
    if math.isnan(loss):
        return math.nan
    return math.exp(loss) if loss < 700 else math.inf


# data.* keys that change how the data is read, never which data: they keep the check
# (data.prefetch=0 skipped it, and an edited corpus's numbers came back as the run's)
_SAME_DATA_KEYS = ("data.shuffle", "data.drop_last", "data.prefetch", "data.allow_changed",
                   "data.cache_dir")  # fmt: skip


def _picks_other_data(overrides) -> bool:
    """Whether an override points the evaluation at other data (data.path, val_fraction,
    block_size, dtype, a source's own keys): then the run's fingerprint does not apply."""
    keys = [o.lstrip("+").split("=", 1)[0] for o in overrides]
    return any(k.startswith("data.") and k not in _SAME_DATA_KEYS for k in keys)


def _allowed_changed(overrides) -> bool:
    """``data.allow_changed=true`` given to this evaluation: the run's own recorded value
    (set once at a resume after fixing its data) would skip the check for good."""
    given = OmegaConf.from_dotlist([o.lstrip("+") for o in overrides])
    return bool(OmegaConf.select(given, "data.allow_changed", default=False))


def _check_held_out(recorded: dict, overrides, what: str) -> None:
    """A run of ``data.val_fraction=0`` whose val split is a token range has none: said so,
    not "split 'val' has 0 tokens ... change val_fraction" (whose fix evaluates tokens the
    run trained on). A token directory's ``val.bin`` is read whatever the fraction."""
    if recorded["data"].get("val_fraction") != 0 or _picks_other_data(overrides):
        return
    raise ConfigError(
        f"{what} was trained with data.val_fraction=0: it held out no data, so there is no "
        "val split to evaluate; point data.path at other data (data.val_fraction=F evaluates "
        "the last F of the run's tokens, which it trained on)"
    )


def _check_same_val(val, attrs: dict, cfg: DictConfig, what: str) -> None:
    """With no ``data.*`` override eval promises the run's own val split: one that differs
    from the fingerprint the checkpoint recorded (a relative ``data.path`` read from
    another directory, files edited since) gave other numbers with exit 0."""
    saved = attrs.get("val_fingerprint")
    if not isinstance(saved, str) or val.fingerprint == saved:
        return
    path = cfg.data.get("path")
    if isinstance(path, str) and not Path(path).is_absolute():
        why = (
            f"data.path={path!r} read from {Path.cwd()} gives {val.fingerprint}: run from the "
            "directory the run started in, or pass data.path=<absolute path>"
        )
    else:  # the files themselves (or this Python's standard library, data=stdlib) differ
        where = f"data.path={path!r}" if path else f"data.name={cfg.data.get('name')!r}"
        why = f"{where} gives {val.fingerprint} here: the data changed since the run"
    raise ConfigError(
        f"{what} was trained with a val split of fingerprint {saved}, but {why} (to evaluate "
        "other data on purpose: data.allow_changed=true, or an override that picks the data "
        f"such as data.path=... or data.val_fraction={cfg.data.get('val_fraction')})"
    )


_ERRORS = (
    ConfigError,
    CorruptCheckpointError,
    CheckpointReadError,  # a limit of this machine (exit 1: retry)
    CheckpointFormatError,
    CheckpointLocationError,
    CheckpointStoreError,
    DataPathError,
    DataFormatError,
    FileNotFoundError,
    PermissionError,  # a run directory of another user's: one line, exit 2
)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    p = argparse.ArgumentParser(
        prog="python -m ftrain.eval",
        description="val loss and perplexity of a run's checkpoint (params only, read-only)",
    )
    p.add_argument("run", help="a run directory, checkpoints directory or URL, [:STEP]")
    p.add_argument("--step", type=int, help="the step (default: the newest that verifies)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("overrides", nargs="*", help="data.* / trainer.eval_batches=... overrides")
    ns = p.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    try:
        r = evaluate_run(ns.run, ns.step, ns.overrides)
    except _ERRORS as err:
        print(f"python -m ftrain.eval: {err}", file=sys.stderr)
        not_found = isinstance(err, FileNotFoundError) and not isinstance(err, DataPathError)
        limit = isinstance(err, CheckpointReadError) and not isinstance(err, PermissionError)
        return 1 if not_found or limit else 2
    except Exception as err:
        if not said_out_of_memory("python -m ftrain.eval", err):
            raise
        return 1
    if r["note"]:
        print(f"python -m ftrain.eval: note: {r['note']}", file=sys.stderr)
    if ns.json:  # strict JSON: non-finite numbers as metrics.jsonl writes them ("nan")
        print(json.dumps({k: json_safe(v) for k, v in r.items()}, allow_nan=False))
    else:
        print(
            f"step {r['step']}: val_loss {r['val_loss']:.4f} perplexity {r['perplexity']:.2f} "
            f"({r['batches']} batches, {r['samples']} samples"
            + (f", {r['tokens']:,} tokens)" if r["tokens"] is not None else ")")
        )
    return 0
