"""The command line of ``python -m ftrain``: Hydra's flags, ftrain's run.

The arguments are parsed by Hydra's own parser (``hydra._internal.utils.get_args_parser``),
so every Hydra flag means what it means in a Hydra app:

* ``--help``: the config groups with their options and every key with its value (Hydra's
  app-help layout; the typed ``*_schema`` configs are not options and are not listed).
* ``--cfg job`` (``--cfg`` alone too): the composed, resolved, checked config.
  ``--cfg hydra|all``, ``--info``, ``--hydra-help``, ``-sc install=bash`` are Hydra's own.
* ``-m/--multirun``: a sweep (:mod:`ftrain.cli.sweep`).
* ``--config-dir DIR`` (or ``hydra.searchpath=[file://DIR]``): a config directory of the
  user's, whose ``model/NAME.yaml`` etc. become options.

What the compose API bought is kept: no working-directory change, no ``outputs/``
directory, the same behaviour under torchrun, and every config error one message with exit
code 2 (also for a ``hydra.*`` override ftrain does not act on).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from datetime import datetime

from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType
from omegaconf import DictConfig, ListConfig, OmegaConf

from ftrain.config import ConfigError, load_config
from ftrain.config.compose import compose_raw, hydra_session, register_all
from ftrain.signals import EXIT_CONFIG, EXIT_OK, EXIT_PREEMPTED

__all__ = ["app_help", "parse_args", "run_app"]

_CFG_KINDS = ("job", "hydra", "all")
_HYDRA_SHOWS = ("hydra_help", "info", "shell_completion", "package")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Hydra's command-line parser; ``--cfg`` without a kind means ``--cfg job``.

    Raises:
        SystemExit: (code 2) a flag argparse does not accept, with the usage.
    """
    from hydra._internal.utils import get_args_parser

    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg in ("--cfg", "-c") and (i + 1 == len(argv) or argv[i + 1] not in _CFG_KINDS):
            argv.insert(i + 1, "job")
            break
    parser = get_args_parser()
    parser.prog = "python -m ftrain"
    return parser.parse_args(argv)


def _overrides(args: argparse.Namespace) -> list[str]:
    """The overrides, with ``--config-dir DIR`` as ``hydra.searchpath=[file://DIR]``."""
    overrides = list(args.overrides)
    _check_searchpaths(overrides)
    if args.config_dir is None:
        return overrides
    if any(o.startswith("hydra.searchpath=") for o in overrides):
        raise ConfigError("give a config directory with --config-dir or hydra.searchpath, not both")
    path = os.path.abspath(args.config_dir)
    if not os.path.isdir(path):
        raise ConfigError(f"--config-dir {args.config_dir}: no such directory ({path})")
    return [*overrides, f"hydra.searchpath=[file://{path}]"]


def _check_searchpaths(overrides: list[str]) -> None:
    """A ``file://`` directory in ``hydra.searchpath`` exists, as ``--config-dir``'s must
    (Hydra skips a missing one without a word: the options in it were silently absent)."""
    for o in overrides:
        if not o.lstrip("+").startswith("hydra.searchpath="):
            continue
        for entry in re.findall(r"""file://([^,\]'"]+)""", o):
            if not os.path.isdir(entry.strip()):
                raise ConfigError(
                    f"{o}: no such directory {entry!r}; give an existing config directory "
                    "(or use --config-dir DIR)"
                )


def _refuse_unsupported(args: argparse.Namespace) -> None:
    if args.config_path is not None:
        raise ConfigError(
            f"--config-path {args.config_path}: ftrain's own configs are part of the package; "
            "add a directory of yours with --config-dir DIR"
        )
    if args.experimental_rerun is not None:
        raise ConfigError(
            "--experimental-rerun needs a pickled config, and ftrain loads no pickle; re-run "
            "the original command instead (it resumes the run)"
        )
    modes = [args.multirun, args.cfg is not None, args.shell_completion, args.info is not None]
    if sum(map(bool, modes)) > 1:
        raise ConfigError("give only one of --multirun, --cfg, --info and --shell-completion")


def run_app(argv: list[str], train: Callable[[DictConfig], int]) -> int:
    """Parse ``argv`` and do what it asks; ``train(cfg)`` runs one job. Returns the exit code."""
    args = parse_args(argv)
    try:
        _refuse_unsupported(args)
        overrides = _overrides(args)
        if args.help:
            print(app_help(overrides, args.config_name or "config"))
            return EXIT_OK
        if any(getattr(args, k) for k in _HYDRA_SHOWS) or args.cfg in ("hydra", "all"):
            return _hydra_shows(args, overrides)
        if args.multirun:
            from ftrain.cli.sweep import StoppedWhilePlanning, carried_over, plan_jobs, run_sweep

            carried = carried_over(argv)  # the jobs an earlier process of it ran, if any
            carried.now = carried.now or datetime.now()
            try:
                jobs = plan_jobs(
                    overrides,
                    config_name=args.config_name or "config",
                    now=carried.now,
                    stop_on_signal=not carried.results,
                )
            except StoppedWhilePlanning as stopped:
                print(stopped, flush=True)
                return EXIT_PREEMPTED
            return run_sweep(jobs, train, carried)
        cfg = load_config(overrides, config_name=args.config_name or "config")
    except ConfigError as err:
        print(f"ftrain: {err}", file=sys.stderr)
        return EXIT_CONFIG
    if args.cfg == "job":
        print(OmegaConf.to_yaml(cfg))
        return EXIT_OK
    return train(cfg)


def _hydra_shows(args: argparse.Namespace, overrides: list[str]) -> int:
    """``--info``, ``--hydra-help``, ``-sc``, ``--cfg hydra|all``: Hydra's own output, on
    ftrain's config (checked first: a config error is exit 2 here too)."""
    from hydra._internal.utils import _run_hydra, get_args_parser

    if not args.shell_completion:  # -sc's words (install=bash, query=bash) are not overrides
        compose_raw(overrides, config_name=args.config_name or "config")
    register_all()
    GlobalHydra.instance().clear()
    try:
        _run_hydra(
            args=args,
            args_parser=get_args_parser(),
            task_function=_no_task,
            config_path="pkg://ftrain.conf",
            config_name=args.config_name or "config",
        )
    except SystemExit as done:  # --hydra-help ends with sys.exit(0); Hydra's errors with 1
        return int(done.code or 0)
    finally:
        GlobalHydra.instance().clear()
    return EXIT_OK


def _no_task(cfg: DictConfig) -> None:  # pragma: no cover - Hydra's shows never run a job
    raise AssertionError("ftrain runs its jobs itself")


_HELP_HEAD = """\
ftrain: a functional trainer (pure step, one-pytree state, Zarr v3 checkpoints).
Re-running a command resumes its run from the newest committed checkpoint in run.dir.

usage: python -m ftrain [-m] [+recipe=NAME] [GROUP=OPTION ...] [KEY=VALUE ...]
       python -m ftrain --cfg job|hydra|all | --info | --hydra-help | -sc install=bash
       --config-dir DIR adds your own options (DIR/model/NAME.yaml with a _target_)

  python -m ftrain model=gpt2_tiny run.dir=runs/tiny trainer.max_steps=300
  python -m ftrain -m optim.lr=1e-3,3e-3 trainer.max_steps=300   # a sweep: one run each
"""

_HELP_TAIL = """\
Exit codes: 0 done, 1 error (or a non-finite loss), 2 bad config, 3 stopped by a signal
after saving, 4 hung (trainer.hang_timeout_s), 130 forced. A sweep exits with its first
failed job's code. See docs/configuration.md, docs/resuming.md, docs/fault-tolerance.md."""


def app_help(overrides: list[str], config_name: str = "config") -> str:
    """The ``--help`` text: groups with their options (the chosen one marked ``*``) and the
    composed config's keys, in Hydra's app-help layout.

    Raises:
        ConfigError: the overrides do not compose.
    """
    cfg = load_config(overrides, config_name=config_name)
    raw = compose_raw(overrides, config_name=config_name)
    choices = dict(raw.hydra.runtime.choices)
    lines = [
        _HELP_HEAD,
        "== Configuration groups ==",
        "Compose your configuration from those groups (group=option; * = chosen)",
        "",
    ]
    for group, options in _groups(overrides, config_name).items():
        chosen = _chosen(choices.get(group), cfg.get(group))
        marked = [f"{o}*" if o in chosen else o for o in options]
        add = " (add one with +recipe=NAME)" if group == "recipe" else ""
        lines.append(f"  {group}: {', '.join(marked)}{add}")
    lines += ["", "== Config ==", "Override anything in the config (foo.bar=value)", ""]
    for key, node in cfg.items():
        lines += _keys_line(str(key), node)
    return "\n".join([*lines, "", _HELP_TAIL])


def _chosen(choice, node) -> set[str]:
    """A group's chosen options: Hydra records one name; a list default (``logger:
    [jsonl]``, which went unmarked) it does not, and the composed config holds one entry
    per option chosen."""
    if isinstance(choice, str):
        return {choice}
    if isinstance(choice, Sequence):
        return {str(c) for c in choice}
    return {str(k) for k in node} if isinstance(node, DictConfig) else set()


def _groups(overrides: list[str], config_name: str) -> dict[str, list[str]]:
    """``{group: options}`` in the config search path (the user's directories included),
    without Hydra's own groups and without the typed ``*_schema`` configs."""
    with hydra_session(overrides):
        loader = GlobalHydra.instance().config_loader()
        kw = {"config_name": config_name, "overrides": list(overrides)}
        groups = loader.get_group_options("", ObjectType.GROUP, **kw)
        out = {}
        for group in sorted(g for g in groups if g != "hydra"):
            options = loader.get_group_options(group, ObjectType.CONFIG, **kw)
            out[group] = sorted(o for o in options if not o.endswith("_schema"))
        return out


def _flat_items(node, prefix: str = "") -> list[str]:
    if isinstance(node, DictConfig) and len(node):
        return [i for k, v in node.items() for i in _flat_items(v, f"{prefix}{k}.")]
    value = OmegaConf.to_container(node) if isinstance(node, DictConfig | ListConfig) else node
    text = "null" if value is None else str(value).replace(" ", "")
    if isinstance(value, bool):
        text = text.lower()
    return [f"{prefix[:-1]}={text}"]


def _keys_line(group: str, node) -> list[str]:
    if not isinstance(node, DictConfig):
        return [f"  {_flat_items(node, group + '.')[0]}"]
    items = _flat_items(node)
    wrapped = textwrap.wrap(
        " ".join(items), width=96, break_on_hyphens=False, break_long_words=False
    )
    return [f"  {group}:", *(f"    {line}" for line in wrapped)]
