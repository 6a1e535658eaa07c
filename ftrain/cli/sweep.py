"""``python -m ftrain -m KEY=A,B ...``: a Hydra sweep, one training job per combination.

The overrides are expanded by Hydra's own override grammar and basic sweeper
(``a,b``, ``range(1,4)``, ``choice(...)``, ``glob(*)``), in Hydra's order. Each job is an
ordinary run whose ``run.dir`` is ``hydra.sweep.dir/hydra.sweep.subdir`` (by default
``runs/${run.name}/multirun/${hydra.job.override_dirname}``: the job's own overrides, less
the settings a resume may change such as ``trainer.max_steps``), so re-running the same
sweep resumes every job where it stopped, and a longer ``trainer.max_steps`` extends them.

Every job's config is composed and checked before the first one starts (a bad value in
any job: exit 2, nothing run), including that no two jobs write the same run, checkpoint,
fallback or logger path. Jobs run one after another in this process; a failed job (exit 1,
2, 4, an exception: exit 1 with its traceback, or ``sys.exit(N)``: exit N) is reported and
the next one starts (a hung job's watchdog ends the process: the sweep goes on in a fresh
one, :func:`exit_process`); a job stopped by a signal (exit 3, 130) ends the sweep there
(re-run it to continue), as does a signal that came as a job was finishing (it ended with exit 0)
or between two jobs. The exit status is the
first failed job's, 0 when all succeeded, 3 when a signal left jobs unstarted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from hydra._internal.config_loader_impl import get_overrides_dirname
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from ftrain import _early_signals
from ftrain.cli.places import logger_places
from ftrain.config import ConfigError
from ftrain.config.compose import (
    check_hydra_overrides,
    compose_raw,
    finish_config,
    frozen_now,
    hydra_session,
)
from ftrain.signals import (
    EXIT_ERROR,
    EXIT_FORCED,
    EXIT_OK,
    EXIT_PREEMPTED,
    STOP_SIGNALS,
    StopFlag,
    received,
    take_received,
)

__all__ = ["Carried", "Job", "carried_over", "exit_process", "expand", "plan_jobs", "run_sweep"]

_STOP_SWEEP = (EXIT_PREEMPTED, EXIT_FORCED)  # a signal: the user wants the sweep to stop


@dataclass
class Job:
    """One combination of a sweep: its number, its overrides and its checked config."""

    num: int
    overrides: list[str]
    cfg: DictConfig


def expand(overrides: list[str]) -> list[list[str]]:
    """The jobs' override lists, as Hydra's basic sweeper expands them.

    Example:
        >>> expand(["optim.lr=1e-3,3e-3", "trainer.max_steps=5"])
        [['optim.lr=0.001', 'trainer.max_steps=5'], ['optim.lr=0.003', 'trainer.max_steps=5']]

    Raises:
        ConfigError: an override that does not parse, or a sweep kind the basic sweeper
            cannot expand (intervals need an optimizing sweeper).
    """
    with hydra_session(overrides):
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        parsed = parser.parse_overrides(list(overrides))
        return BasicSweeper.split_arguments(parsed, max_batch_size=None)[0]


def _refuse_fixed_dirs(overrides: list[str]) -> None:
    for o in overrides:
        key = o.lstrip("+").split("=", 1)[0]
        if key == "run.dir":
            raise ConfigError(
                f"{o}: in a sweep every job has its own run.dir "
                "(hydra.sweep.dir/hydra.sweep.subdir); set hydra.sweep.dir=DIR instead"
            )


def _in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("WORLD_SIZE", "1") not in "01"


def plan_jobs(
    overrides: list[str],
    *,
    config_name: str = "config",
    now: datetime | None = None,
    stop_on_signal: bool = True,
) -> list[Job]:
    """Every job of the sweep with its composed, checked config (nothing is run);
    ``${now:...}`` is ``now`` (default: the time of planning). ``stop_on_signal``: a stop
    signal meanwhile raises :class:`StoppedWhilePlanning` (not in a sweep's continuation,
    whose jobs already ran: the signal stops it between jobs, with its summary).

    Raises:
        ConfigError: under torchrun, a bad override or value in any job, a fixed
            ``run.dir``, or two jobs that would share a run or checkpoint directory.
    """
    if _in_torchrun():
        raise ConfigError(
            "-m/--multirun runs its jobs one after another in one process and cannot run "
            "under torchrun; launch one torchrun command per job instead, e.g. "
            "torchrun --nproc-per-node=2 -m ftrain optim.lr=1e-3 run.dir=runs/lr1e-3"
        )
    check_hydra_overrides(overrides, multirun=True)
    _refuse_fixed_dirs(overrides)
    with frozen_now(now):  # one ${now:...} for every job, as Hydra's one sweep.dir
        jobs = [
            _planned(n, o, config_name, stop_on_signal) for n, o in enumerate(expand(overrides))
        ]
    if not jobs:  # range(0), an empty list: "0/0 jobs succeeded", exit 0, nothing trained
        raise ConfigError(
            f"the sweep {list(overrides)} has no jobs: a swept value list is empty "
            "(range(0), []); give it at least one value"
        )
    _check_distinct(jobs)
    return jobs


class StoppedWhilePlanning(Exception):
    """A stop signal came while the sweep composed its jobs (~0.35 s each: hundreds of
    jobs outlasted a scheduler's grace period, and the signal was acted on only after)."""

    def __init__(self, signal_name: str, planned: int) -> None:
        super().__init__(
            f"[sweep] {signal_name} came while planning the jobs ({planned} composed): "
            "stopping before job 0, nothing ran; run the same command again to start the sweep"
        )


def _planned(num: int, overrides: list[str], config_name: str, stop_on_signal: bool) -> Job:
    """Job ``num`` composed, unless a stop signal came meanwhile (a Ctrl-C is Python's
    KeyboardInterrupt here: one line and exit 130 at once, ftrain.cli.run.main)."""
    came = _early_signals.waiting(STOP_SIGNALS) if stop_on_signal else None
    if came is not None:
        raise StoppedWhilePlanning(came, num)
    return _job(num, overrides, config_name)


def _job(num: int, overrides: list[str], config_name: str) -> Job:
    raw = compose_raw(overrides, config_name=config_name)
    with open_dict(raw):
        raw.hydra.job.num = num
        raw.hydra.job.id = str(num)
        names = _dirname_candidates(raw, overrides, config_name)
        raw.hydra.job.override_dirname = names[0]
        _name_wandb_run(raw, num)
        job_dir = _job_dir(raw, num)
        for earlier in names[1:]:
            if job_dir.exists():
                break
            raw.hydra.job.override_dirname = earlier
            there = _job_dir(raw, num)
            if there.exists():  # a sweep begun under an earlier naming rule: resume there
                print(f"[sweep] job {num}: resuming in {there} (named by an earlier rule)")
                job_dir = there
        raw.run.dir = str(job_dir)
    return Job(num, overrides, finish_config(raw, overrides))


def _name_wandb_run(raw: DictConfig, num: int) -> None:
    """A W&B logger left at its defaults (name ``${run.name}``, no group) names each job's
    run after the job and groups them by the sweep's ``run.name``: every job was a run
    named "default", told apart only by its random id."""
    entry = (raw.get("logger") or {}).get("wandb")
    if not isinstance(entry, DictConfig):
        return
    if OmegaConf.to_container(entry, resolve=False).get("name") == "${run.name}":
        entry.name = f"{raw.run.name}/{raw.hydra.job.override_dirname or f'job{num}'}"
    if entry.get("group") is None:
        entry.group = str(raw.run.name)


# exclude_keys of ftrain <= 2026-12-03, matched exactly as Hydra does: the names of the
# sweep directories made then, so that re-running such a sweep still finds its jobs
_EARLIER_EXCLUDE_KEYS = (
    "trainer.max_steps",
    "trainer.eval_every",
    "trainer.eval_batches",
    "trainer.log_every",
    "trainer.device",
    "trainer.compile",
    "trainer.hang_timeout_s",
    "resume",
    "run.name",
    "run.overwrite",
    "run.allow_config_change",
    "run.plot",
    "checkpoint.every_steps",
    "checkpoint.every_seconds",
    "checkpoint.keep_last",
    "checkpoint.async_save",
    "data.path",
    "data.cache_dir",
    "data.prefetch",
    "data.allow_changed",
)


def _dirname_candidates(raw: DictConfig, overrides: list[str], config_name: str) -> list[str]:
    """The job's ``override_dirname`` (first), then the names earlier rules gave it:
    with group choices the config makes anyway, Hydra's exact matching of this config's
    exclude_keys, and of ftrain's earlier list."""
    conf = raw.hydra.job.config.override_dirname
    pairs = zip(overrides, OverridesParser.create().parse_overrides(list(overrides)), strict=True)
    pairs = [(text, o) for text, o in pairs if not o.is_hydra_override()]  # as Hydra's own
    parsed = [o for _, o in pairs]
    keys = [o.key_or_group for o in parsed]
    resume_safe = [k for k in keys if _under_any(k, conf.exclude_keys)]
    rules = [
        resume_safe + _chosen_anyway(raw, pairs, overrides, config_name),
        resume_safe,
        [k for k in keys if k in conf.exclude_keys],
        [k for k in keys if k in _EARLIER_EXCLUDE_KEYS],
    ]
    names = [get_overrides_dirname(parsed, ex, conf.item_sep, conf.kv_sep) for ex in rules]
    if not names[0]:  # only default choices (optim=glob(*)'s adamw job): named by them
        names.pop(0)
    return list(dict.fromkeys(names))  # each once, in order


def _chosen_anyway(raw: DictConfig, pairs, overrides: list[str], config_name: str) -> list[str]:
    """Groups whose override picks what the config picks without it (``model=gpt2_tiny``,
    the default): the job is the same run either way, so its name leaves them out. A
    re-run spelled without them started every job afresh in a new directory."""
    choices = raw.hydra.runtime.choices
    out = []
    for text, o in pairs:
        group, value = o.key_or_group, o.value()
        if o.is_add() or o.is_delete() or group not in choices or not isinstance(value, str):
            continue
        rest = [x for x in overrides if x is not text]
        try:
            without = compose_raw(rest, config_name=config_name).hydra.runtime.choices
        except ConfigError:  # the others need it (keys of a user's option): not a default
            continue
        if without.get(group) == value:
            out.append(group)
    return out


def _job_dir(raw: DictConfig, num: int) -> Path:
    return Path(_resolved(raw, "dir", num)) / _resolved(raw, "subdir", num)


def _resolved(raw: DictConfig, key: str, num: int) -> str:
    try:
        return str(raw.hydra.sweep[key])
    except Exception as err:  # an interpolation in hydra.sweep.* that does not resolve
        raise ConfigError(f"hydra.sweep.{key} does not resolve for job {num}: {err}") from None


def _under_any(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(f"{p}.") for p in prefixes)


def _check_distinct(jobs: list[Job]) -> None:
    """Refuse two jobs that would write the same place: run, checkpoint or fallback
    directory, or a logger's file or directory (a shared CSV mixes two jobs' rows under the
    same steps; a shared TensorBoard log_dir loses the first job's curve to the second's
    purge; a shared fallback lets a later job resume an earlier one's steps)."""
    seen: dict[str, tuple[Job, str]] = {}
    for job in jobs:
        for key, place in _places(job.cfg):
            other, other_key = seen.setdefault(_normalized(place), (job, key))
            if other is not job:
                raise ConfigError(
                    f"sweep jobs {other.num} ({' '.join(other.overrides)}) and {job.num} "
                    f"({' '.join(job.overrides)}) would share {place} (job {other.num}'s "
                    f"{other_key}, job {job.num}'s {key}): {_sharing_fix(key)}"
                )


def _sharing_fix(key: str) -> str:
    if key == "run.dir":
        return (
            "the keys that differ are left out of hydra.job.override_dirname (resume-safe "
            "settings such as trainer.max_steps, data.path); number the jobs instead "
            "(hydra.sweep.subdir=job${hydra.job.num})"
        )
    return (
        f"{key} names one place for every job; leave it at its default or put it under "
        f"the job's run.dir ({key}='${{run.dir}}/...')"
    )


def _places(cfg: DictConfig) -> list[tuple[str, str]]:
    """Where a job writes, as ``(key, path)``: each distinct path once."""
    places = {
        "run.dir": cfg.run.dir,
        "checkpoint.dir": cfg.checkpoint.dir,
        "checkpoint.fallback_dir": cfg.checkpoint.get("fallback_dir"),
    }
    places |= logger_places(cfg)
    out: dict[str, tuple[str, str]] = {}
    for key, place in places.items():
        if place:
            out.setdefault(_normalized(str(place)), (key, str(place)))
    return list(out.values())


def _normalized(place: str) -> str:
    """One spelling per place: an object URL as written, a local path absolute."""
    return place.rstrip("/") if "://" in place else os.path.abspath(place)


def run_sweep(
    jobs: list[Job],
    train: Callable[[DictConfig], int],
    carried: Carried | None = None,
) -> int:
    """Run ``train(job.cfg)`` for each job in order; return the sweep's exit status.

    ``carried``: this sweep's earlier process (:func:`carried_over`), whose jobs are
    reported, not run again; with its ``argv``, a job the hang watchdog ends
    (:func:`exit_process`) continues the sweep in a fresh process."""
    carried = carried or Carried()
    results: list[tuple[Job, int]] = []
    interrupted = False
    take_received()  # only signals during the jobs count
    # between two jobs no run's handlers are installed: a SIGTERM there killed the sweep
    # (143); SIGINT stays Python's (a KeyboardInterrupt), as a job's start-up expects it
    between = StopFlag("the sweep stops before its next job").install(STOP_SIGNALS)
    try:
        _run_jobs(jobs, train, carried, results)
    except KeyboardInterrupt:  # a Ctrl-C between two jobs
        print("[sweep] interrupted (SIGINT) between jobs: stopping the sweep")
        interrupted = True
    finally:
        between.uninstall()
    _summary(jobs, results)
    failed = [rc for _, rc in results if rc != EXIT_OK]
    cut_short = len(results) < len(jobs)
    if failed:
        return failed[0]
    return EXIT_FORCED if interrupted else (EXIT_PREEMPTED if cut_short else EXIT_OK)


def _run_jobs(jobs: list[Job], train, carried: Carried, results: list) -> None:
    """The jobs in order, each result appended to ``results``, until a stop."""
    earlier_stop = carried.stop  # came to the process before this one (a hung job's)
    for job in jobs:
        if job.num in carried.results:
            results.append((job, carried.results[job.num]))
            continue
        if (came := take_received() or earlier_stop) is not None:
            print(f"[sweep] {came} came between jobs: stopping before job {job.num}")
            return
        _CONTINUATION[:] = [(carried, results, job)]
        try:
            rc = _announce_and_train(train, job, len(jobs))
        finally:
            _CONTINUATION.clear()
        results.append((job, rc))
        # a signal that came as the job was ending (its last step, its final save) let it
        # finish (exit 0): the sweep stops all the same
        came = take_received()
        if rc in _STOP_SWEEP or came is not None:
            why = f"was stopped (exit {rc})" if rc in _STOP_SWEEP else f"ended as {came} came"
            print(f"[sweep] job {job.num} {why}: stopping the sweep")
            return


@dataclass
class Carried:
    """What an earlier process of this sweep passed on: the command's overrides, the
    planning's ``${now:...}`` and the exit status of each job it ran."""

    argv: list[str] | None = None
    now: datetime | None = None
    results: dict[int, int] = field(default_factory=dict)
    stop: str | None = None  # a stop signal the hung job's process had received


_CARRY_ENV = "FTRAIN_SWEEP_CARRIED"
# (carried, results so far, the job running) while a job runs: for exit_process
_CONTINUATION: list[tuple[Carried, list, Job]] = []


def carried_over(argv: list[str]) -> Carried:
    """This sweep's state from the process it continues (``argv``: this command's), taken
    out of the environment so no child inherits it; a fresh ``Carried`` otherwise."""
    raw = os.environ.pop(_CARRY_ENV, None)
    if raw is None:
        return Carried(argv=list(argv))
    try:
        data = json.loads(raw)
        if data["argv"] != list(argv):
            raise ValueError("another command's")
        now = datetime.fromisoformat(data["now"])
        results = {int(k): int(v) for k, v in data["results"].items()}
        stop = data.get("stop")
        if stop is not None and not isinstance(stop, str):
            raise TypeError(f"stop={stop!r}")
    except (ValueError, KeyError, TypeError) as err:
        print(f"[sweep] ignoring {_CARRY_ENV} ({err}): the sweep starts from its first job")
        return Carried(argv=list(argv))
    return Carried(list(argv), now, results, stop)


def exit_process(code: int) -> None:
    """End the process with ``code`` (``os._exit``: the hang watchdog's exit). In a sweep
    the remaining jobs go on in a fresh process (the same command, told which jobs ran):
    a hung job's thread cannot be stopped, and its exit ended the whole sweep."""
    try:
        if _CONTINUATION and _CONTINUATION[0][0].argv is not None:
            _exec_the_rest(code, *_CONTINUATION[0])
    finally:  # no exec (or it failed): the exit as before, whatever happened on the way
        os._exit(code)


def hang_exit_note() -> str:
    """What follows a hang watchdog's exit, for its line: a sweep goes on in a fresh
    process (:func:`exit_process`); a single run waits for its supervisor."""
    if _CONTINUATION and _CONTINUATION[0][0].argv is not None:
        return "and the sweep goes on with its next job in a fresh process"
    return "so a supervisor restarts the run"


def _exec_the_rest(code: int, carried: Carried, results: list, job: Job) -> None:
    """Become this sweep again, told which jobs ran (from the watchdog's thread: the hung
    main thread may hold stdout's lock, so nothing here waits on it for long)."""
    done = {j.num: rc for j, rc in results} | {job.num: code}
    os.environ[_CARRY_ENV] = json.dumps(
        {
            "argv": carried.argv,
            "now": carried.now.isoformat(),
            "results": done,
            "stop": received(),  # a preemption notice during the hang still stops the sweep
        }
    )
    flushing = threading.Thread(target=_flush_std, daemon=True)
    flushing.start()
    flushing.join(2.0)  # what the jobs printed and Python still buffers: kept if it can be
    line = f"[sweep] job {job.num} ended with exit {code}: going on in a fresh process\n"
    with contextlib.suppress(OSError):  # a console gone must not cost the rest of the sweep
        os.write(1, line.encode())
    # held until the new process's handlers exist (ftrain._early_signals unblocks them):
    # a SIGTERM in its first milliseconds killed it (143) with no summary
    signal.pthread_sigmask(signal.SIG_BLOCK, _early_signals.SIGNALS)
    with contextlib.suppress(OSError):
        os.execv(sys.executable, [sys.executable, "-m", "ftrain", *carried.argv])


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _announce_and_train(train: Callable[[DictConfig], int], job: Job, total: int) -> int:
    print(
        f"[sweep] job {job.num} ({job.num + 1} of {total}): "
        f"{' '.join(job.overrides) or '(no overrides)'}"
        f" -> run.dir={job.cfg.run.dir}",
        flush=True,
    )
    return _train_job(train, job)


def _train_job(train: Callable[[DictConfig], int], job: Job) -> int:
    """One job's exit status: an exception escaping it (after the run's emergency save: an
    out-of-memory error in the sweep's largest model, a bug in a custom loss) is that job's
    exit 1 with its traceback, not the end of the whole sweep."""
    try:
        return train(job.cfg)
    except KeyboardInterrupt:  # a Ctrl-C in a later job's start-up: the sweep's summary
        # still says what the earlier jobs did (it ended with the single run's message)
        print(
            f"[sweep] job {job.num} interrupted (SIGINT) outside its training loop; nothing "
            "was saved by it, its newest committed checkpoint is intact"
        )
        return EXIT_FORCED
    except SystemExit as stop:  # sys.exit() in a user's loss, logger or model code
        rc = stop.code if isinstance(stop.code, int) else (EXIT_OK if stop.code is None else 1)
        print(f"[sweep] job {job.num} called sys.exit({stop.code!r}) (exit {rc})")
        return rc
    except Exception:
        traceback.print_exc()
        print(f"[sweep] job {job.num} failed with the error above (exit {EXIT_ERROR})")
        return EXIT_ERROR


def _summary(jobs: list[Job], results: list[tuple[Job, int]]) -> None:
    done = {job.num: rc for job, rc in results}
    print(f"[sweep] {sum(rc == EXIT_OK for rc in done.values())}/{len(jobs)} jobs succeeded")
    for job in jobs:
        rc = done.get(job.num)
        status = "not started" if rc is None else ("ok" if rc == EXIT_OK else f"exit {rc}")
        print(f"[sweep]   job {job.num}: {status:<11} {job.cfg.run.dir}", flush=True)
