"""``python -m ftrain [-m] [+recipe=NAME] [overrides]``: compose the config, start or resume, train.

Kept short on purpose (the logic lives in library functions): build the parts, restore
or init the state, run :func:`ftrain.loop.train_loop`, close the checkpoint manager
(waiting for the last commit), and exit with a code from :mod:`ftrain.signals`.
"""

from __future__ import annotations

import contextlib
import re
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig
from tensordict import TensorDictBase
from torch import nn

from ftrain import _early_signals
from ftrain._memory import out_of_memory, said_out_of_memory, threads_note
from ftrain._stdio import printable_streams
from ftrain.ckpt import (
    CheckpointFormatError,
    CheckpointLocationError,
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointSaveError,
    CheckpointStoreError,
)
from ftrain.cli.basestep import agreed_init_from
from ftrain.cli.build import (
    build_manager,
    build_model,
    build_sources,
    build_tx,
    check_batch,
    check_block_size,
    check_cache_home,
    check_checkpoint_paths,
    check_vocab,
    eval_repeat_note,
    evaluates,
    model_vocab,
    pick_device,
    schedule_horizon,
)
from ftrain.cli.console import tolerate_lost_console
from ftrain.cli.errors import ResumeReadError
from ftrain.cli.finetune import (
    check_labels,
    check_patterns,
    describe_labels,
    frozen_at_random,
    unused_lora_settings,
)
from ftrain.cli.places import check_logger_places
from ftrain.cli.pretrained import init_from_hf
from ftrain.cli.redo import eval_owed
from ftrain.cli.restarts import continue_restarted_job
from ftrain.cli.resume import (
    ResumeError,
    ResumeReport,
    checkpoint_metadata,
    eval_change_note,
    keep_saved_seed,
    move_run_aside,
    saved_horizon,
    schedule_line,
    start_state,
    val_change_note,
)
from ftrain.cli.session import Asked, Session, rerun_command
from ftrain.cli.startup import (
    same_config_on_every_rank,
    same_data_on_every_rank,
    warmup_past_the_end,
)
from ftrain.cli.sweep import exit_process, hang_exit_note
from ftrain.cli.targets import unused_option_settings
from ftrain.compiled import AUTO_MIN_STEPS, cxx_compiler_problem, should_compile
from ftrain.config import ConfigError, to_plain
from ftrain.data import (
    DataFingerprintError,
    DataFormatError,
    DataPathError,
    Loader,
    SampleShapeError,
    Source,
    TokenRangeError,
)
from ftrain.data.sampler import rank_starts
from ftrain.dist import (
    LaunchError,
    World,
    agree_any,
    broadcast_json,
    init_world,
    local_device,
    shutdown,
)
from ftrain.loop import NonFiniteError, train_loop
from ftrain.metrics import LoggerError, LoggerSet, RunInfo, build_loggers, check_loggers
from ftrain.metrics.history import forget_history, replay_for
from ftrain.optim import refresh_hyperparams
from ftrain.runlock import RunDirDiskError, RunDirError, claim_run_dir
from ftrain.sharding import Sharder, shard_state
from ftrain.signals import (
    EXIT_CONFIG,
    EXIT_ERROR,
    EXIT_FORCED,
    EXIT_OK,
    EXIT_PREEMPTED,
    STOP_SIGNALS,
    StopFlag,
)
from ftrain.state import init_state, place
from ftrain.state.tree import replace
from ftrain.step import learning_rate_metrics, make_step
from ftrain.watchdog import Watchdog

__all__ = ["console_main", "main"]

# Errors that mean "this run cannot start as configured": reported in one paragraph, exit 2.
# Anything else during setup is a bug and keeps its traceback.
_STARTUP_ERRORS = (
    ConfigError,
    ResumeError,
    DataFingerprintError,
    DataPathError,
    DataFormatError,
    CheckpointNotFoundError,
    RunDirError,
    CheckpointFormatError,
    CheckpointLocationError,  # checkpoint.dir=s3:bucket, ftp://...: names the fix
    CheckpointStoreError,  # no such bucket, bad credentials, access denied
    LoggerError,  # logger=tensorboard without its extra, an unknown logger key
)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code.

    A SIGINT outside the training loop (while composing, building, restoring; the loop's
    own handler covers the rest) is one line and :data:`EXIT_FORCED`, not a traceback:
    nothing was saved by this process, the newest committed checkpoint is intact.
    """
    # ftrain.ckpt logs each "[step=N] ..." warning and also warns it (for library users):
    # on the command line the log line is enough (the warning repeated it with a source
    # line of ftrain's, at every fallback save)
    warnings.filterwarnings("ignore", message=r"\[step=\d+\] ", category=RuntimeWarning)
    try:
        if _early_signals.take((signal.SIGINT,)):  # a Ctrl-C while torch was importing
            raise KeyboardInterrupt
        with tolerate_lost_console():  # a dead `| tee` never stops training
            return _main(argv)
    except Exception as err:
        if not said_out_of_memory("ftrain", err, _MEMORY_FIX):
            raise
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(
            "ftrain: interrupted (SIGINT) outside the training loop; nothing was saved by this "
            "run, the newest committed checkpoint is intact",
            file=sys.stderr,
        )
        return EXIT_FORCED


_MEMORY_FIX = (
    "The newest committed checkpoint is intact, and a restart resumes from it once the "
    "process has more memory (a higher memory or address-space limit, fewer other "
    "processes) or needs less (a smaller trainer.batch_size or model)"
)


def _main(argv: list[str] | None) -> int:
    from ftrain.cli.app import run_app  # Hydra's flags, --help, -m sweeps

    return run_app(list(sys.argv[1:] if argv is None else argv), train_from_config)


def console_main() -> None:
    """The ``ftrain`` console script and ``python -m ftrain`` (``ftrain -sc install=bash``
    completes ``ftrain ...``): :func:`main`, then the process ends."""
    printable_streams()  # a run directory named `ü` under PYTHONIOENCODING=ascii
    code = main()
    # the process ends now (threads joined, atexit, the interpreter's teardown: most of a
    # second): a signal there is noted, never a kill (143) of a finished run. Here, not in
    # main(): a caller of main() in its own process keeps its handlers.
    StopFlag(_LATE_MEANING).install()
    sys.exit(code)


def train_from_config(cfg: DictConfig) -> int:
    """Run (or resume) the training job described by ``cfg``."""
    # a stop request (SIGTERM, SIGUSR1, SIGHUP, SIGQUIT) during start-up and restore is kept,
    # and the run stops at its first step boundary with exit 3 (it killed the process with
    # 143 or 138 before, possibly mid-way through a run.overwrite move); SIGINT there stays
    # an immediate exit 130 (a person at the keyboard)
    early = StopFlag(_EARLY_MEANING).install(STOP_SIGNALS)
    try:
        return _train_from_config(cfg, early)
    finally:
        early.uninstall()


_EARLY_MEANING = "stopping before the first step (nothing new is trained or saved)"
_LATE_MEANING = "the run is already ending"


def _train_from_config(cfg: DictConfig, early: StopFlag) -> int:
    try:
        device = local_device(pick_device(cfg.trainer.device))
        with _stop_signals_end_the_wait():
            world = init_world(cfg.dist.backend, cfg.dist.timeout_s, device)
    except (ConfigError, LaunchError) as err:
        print(f"ftrain: {err}", file=sys.stderr)
        return EXIT_CONFIG
    lock = None
    try:
        try:
            same_config_on_every_rank(cfg, world)  # before any rank acts on its own config
            lock = claim_run_dir(cfg, world)  # before anything is built or moved
            parts = _setup(cfg, device, world, lock.earlier_runs())
        except _STARTUP_ERRORS as err:
            print(f"ftrain: cannot start: {err}", file=sys.stderr)
            return EXIT_ERROR if isinstance(err, RunDirDiskError) else EXIT_CONFIG
        except (CheckpointReadError, ResumeReadError) as err:  # of the moment: a restart may do
            print(f"ftrain: cannot start: {err}", file=sys.stderr)
            return EXIT_CONFIG if isinstance(err, PermissionError) else EXIT_ERROR
        except RuntimeError as err:  # a rank died in a start-up collective (the resume's)
            if not (world.active and _peer_gone(err)):
                raise
            print(
                f"ftrain: cannot start: {_lost_rank(err, world)}; {_START_AGAIN}", file=sys.stderr
            )
            return EXIT_ERROR
        return _run(cfg, device, world, parts, early)
    finally:
        # the run has ended: a signal now (SIGINT too) is noted, not a kill (143) or a
        # KeyboardInterrupt claiming that nothing was saved right after the final commit
        with StopFlag(_LATE_MEANING):
            if lock is not None:
                lock.release()  # after the last commit: the next start finds it free
            shutdown()


@contextlib.contextmanager
def _stop_signals_end_the_wait():
    """While joining the other ranks (nothing read or written yet), SIGTERM and SIGUSR1 end
    the process at once: held for the first step boundary, they kept a rank whose peer had
    already failed its config waiting in the rendezvous until torchrun's SIGKILL 30 s
    later, on every restart attempt."""
    main = threading.current_thread() is threading.main_thread()
    held = {s: signal.signal(s, signal.SIG_DFL) for s in _WAIT_SIGNALS} if main else {}
    try:
        yield
    finally:
        for sig, handler in held.items():
            if handler is not None:  # None: set outside Python; SIG_DFL stays
                signal.signal(sig, handler)


_WAIT_SIGNALS = STOP_SIGNALS


def _next_batch_starts(cfg, report, state, num_samples: int, world_size: int) -> None:
    starts = rank_starts(
        state["data"],
        world=world_size,
        global_batch=cfg.trainer.batch_size,
        num_samples=num_samples,
        drop_last=cfg.data.drop_last,
    )
    (report.epoch, report.position), report.rank_starts = starts[0], starts


@dataclass
class _Parts:
    """What setup built for the run: the model as a function, optimizer, data, checkpoints."""

    model: nn.Module
    loss_fn: Callable
    tx: object
    train: Source
    val: Source | None  # None: data.val_fraction=0 holds nothing out
    manager: CheckpointManager
    state: TensorDictBase
    report: ResumeReport
    horizon: int
    loggers: LoggerSet
    shard: str  # dist.shard as it applies to this world (see _shard_mode)
    asked: Asked  # resume and run.overwrite as the command gave them


def _setup(cfg: DictConfig, device, world: World, earlier_runs: list[Path]) -> _Parts:
    """Everything that can refuse to start: config-derived parts, data, resume decision
    (``earlier_runs``: run directories whose checkpoints this start took over)."""
    check_loggers(cfg.logger)  # every rank, first: a missing extra stops all before anything
    check_logger_places(cfg)  # a logger file at metrics.jsonl would set the run's records aside
    check_block_size(cfg)
    check_cache_home(cfg)
    model_notes: list[str] = []  # a LoRA target matching nothing: said with the others
    model, loss_fn = build_model(cfg, model_notes)
    train_src, val_src = same_data_on_every_rank(lambda: build_sources(cfg), world)
    if cfg.trainer.eval_every and not evaluates(cfg, val_src) and world.is_coordinator:
        print("no evaluation: data.val_fraction=0 holds out no data (trainer.eval_every unused)")
    check_vocab(cfg.model, train_src)
    check_batch(cfg.trainer, train_src, world.size)
    _check_compiler(cfg.trainer, device, world)
    check_patterns(cfg, sorted(name for name, _ in model.named_parameters()))
    asked = Asked(cfg.resume, bool(cfg.run.overwrite))  # the command's, for the stop message
    # resume=N / resume=none (run.overwrite): a torchrun restart continues the first attempt
    given, (cfg, restart_note) = cfg, continue_restarted_job(cfg, world)
    early = None  # resume=none: the fresh start's checks (init.from, groups) before the move
    if cfg.resume == "none":
        tx = build_tx(cfg, schedule_horizon(cfg, None))
        early = _initialised(cfg, _fresh(cfg, model, tx), world)
        check_checkpoint_paths(cfg, early[0])
    _overwrite(cfg, world)  # once every check that needs no checkpoint has passed
    manager = build_manager(cfg)
    saved = saved_horizon(cfg, manager)
    horizon = schedule_horizon(cfg, saved)
    tx = build_tx(cfg, horizon)
    fresh = early[0] if early else _fresh(cfg, model, tx)
    if not early:
        check_checkpoint_paths(cfg, fresh)
    shard = _shard_mode(cfg, world)
    # a sharded resume reads only this rank's rows, into DTensors on the sharder's mesh
    sharder = Sharder(full=shard == "full") if shard != "none" else None
    try:
        state, report, meta = start_state(
            cfg, manager, fresh, world, tx, train_src.fingerprint, sharder, earlier_runs
        )
        if cfg is not given:  # the run records the config it was given: the same seed
            keep_saved_seed(given, meta)
        report.notes += val_change_note(meta, _val_fp(val_src))
        report.notes += eval_change_note(meta, cfg) if evaluates(cfg, val_src) else []
        report.notes += filter(None, [eval_repeat_note(cfg, val_src)])
        report.notes[:0] = [restart_note] if restart_note else []
        if _horizon_differs(cfg, report, horizon):  # read from a step the restore skipped
            horizon = saved = report.horizon
            tx = build_tx(cfg, horizon)
            state = replace(state, opt=refresh_hyperparams(tx, state["opt"]))
            report.next_lr = float(learning_rate_metrics(state["opt"])["lr"])
        if not report.resumed:  # a resume continues its own params
            state, notes, report.init_step = early or _initialised(cfg, state, world)
            report.notes += notes
        else:  # where the next batch really begins (past a shrunk dataset's end: next epoch)
            _next_batch_starts(cfg, report, state, len(train_src), world.size)
        loggers = _loggers(cfg, world, report)
    except BaseException:
        manager.close()
        raise
    report.schedule = schedule_line(cfg, horizon, saved if report.resumed else None)
    groups = describe_labels(cfg, state["params"])
    report.notes += model_notes + list(
        filter(None, [unused_lora_settings(cfg), warmup_past_the_end(cfg)])
    )
    report.notes += unused_option_settings(cfg)
    report.notes += [groups] if groups else []
    return _Parts(
        model, loss_fn, tx, train_src, val_src, manager, state, report, horizon, loggers, shard,
        asked,
    )  # fmt: skip


def _fresh(cfg: DictConfig, model: nn.Module, tx) -> TensorDictBase:
    return init_state(model, tx, seed=cfg.trainer.seed, precision=cfg.trainer.precision)


def _initialised(
    cfg: DictConfig, fresh: TensorDictBase, world: World
) -> tuple[TensorDictBase, list[str], int | None]:
    """A fresh start's state, notes and the base step ``init.from`` read (agreed by every
    rank, :mod:`ftrain.cli.basestep`): params from ``init.from``/``init.from_hf``, then the
    label checks (something trains, every group takes parameters)."""
    notes, base_step = [], None
    if cfg.init["from"]:
        fresh, line, base_step = agreed_init_from(cfg, fresh, world)
        notes.append(line)
    elif cfg.init["from_hf"]:
        fresh, line = init_from_hf(cfg, fresh)
        notes.append(line)
    check_labels(cfg, fresh["params"])
    notes += filter(None, [frozen_at_random(cfg, fresh["params"])])
    return fresh, notes, base_step


def _val_fp(val: Source | None) -> str | None:
    return val.fingerprint if val is not None else None


def _overwrite(cfg: DictConfig, world: World) -> None:
    """``resume=none run.overwrite=true``: the old run's records and checkpoints moved aside.
    After the start checks: a start refused for a typo elsewhere (exit 2, "nothing
    trained") had moved the old run aside all the same, and a re-run without the
    override then started fresh."""
    if cfg.resume == "none" and cfg.run.overwrite and world.is_coordinator:
        moved = move_run_aside(cfg)
        if moved:
            print(f"run.overwrite=true: moved the old run's records and checkpoints to {moved}")
    agree_any(False)  # a barrier: every rank waits until old checkpoints are out of the way


def _check_compiler(t: DictConfig, device, world: World) -> None:
    """``trainer.compile=true`` on several ranks (a data-parallel step is not one graph) or
    on a CPU without a C++ compiler: refused at start, naming the fixes (each failed at the
    first step with a traceback)."""
    if t.compile is True and world.size > 1:
        raise ConfigError(
            f"trainer.compile=true compiles a one-rank step; this run has {world.size} ranks "
            "(a data-parallel step is not one graph): use trainer.compile=false, or "
            "trainer.compile=auto (eager on several ranks)"
        )
    problem = cxx_compiler_problem() if t.compile is True and device.type == "cpu" else None
    if problem:
        raise ConfigError(
            f"trainer.compile=true needs a C++ compiler on the CPU: {problem}; install one "
            "(g++) or point CXX at it, or run eager with trainer.compile=false"
        )


def _horizon_differs(cfg: DictConfig, report: ResumeReport, horizon: int) -> bool:
    """The restored step recorded another LR-schedule horizon than the one the optimizer
    was built with: that one came from the newest step's metadata, but the restore fell
    back past it (corrupt), or its metadata could not be read (then ``trainer.max_steps``
    was taken). The restored step's horizon is the run's; the other one changed the LR
    curve silently, and was recorded into every later checkpoint."""
    fixed = cfg.schedule.get("decay_steps") is not None
    recorded = report.horizon if report.resumed else None
    return not fixed and isinstance(recorded, int) and recorded != horizon


def _compile(t: DictConfig, p: _Parts, world: World, device) -> bool:
    """``trainer.compile`` for this start; ``auto`` says what it chose and why. It decides on
    the run's length, not on the steps left, and a resume keeps the choice its checkpoint
    recorded, so the numbers (compiled and eager differ by ~1e-6) depend neither on where
    the run stopped nor on a ``max_steps`` raised at a resume."""
    chosen, why = should_compile(t.compile, t.max_steps, world.size, p.shard, device.type)
    recorded = p.report.compiled if p.report.resumed else None
    if t.compile == "auto" and recorded is not None and recorded != chosen:
        # the run's earlier start chose: a resume that raised trainer.max_steps past the
        # threshold switched to compiled mid-run (numbers ~1e-6 off an unbroken run)
        can, _ = should_compile("auto", AUTO_MIN_STEPS, world.size, p.shard, device.type)
        if can or not recorded:
            chosen = recorded
            why = (
                f"{'compiling the step' if chosen else 'eager'}, as this run's first start "
                "chose (recorded with its checkpoints; trainer.compile=true or false changes it)"
            )
    if t.compile == "auto" and world.is_coordinator:
        print(f"ftrain: trainer.compile=auto: {why}", file=sys.stderr, flush=True)
    return chosen


def _loggers(cfg: DictConfig, world: World, report: ResumeReport) -> LoggerSet:
    """The ``logger=`` group's loggers, on the coordinator only (built from this start's
    composed config, never from checkpoint metadata). Every rank learns whether they
    started: one the coordinator could not build (a directory that cannot be made) left
    the other ranks in the loop, to fail there with a collective's traceback."""
    failed, loggers = None, LoggerSet()
    if world.is_coordinator and not _nothing_to_log(cfg, report):
        start = int(report.step) if report.resumed else 0
        replay_from, replay = replay_for(cfg.run.dir, start) if report.resumed else (None, [])
        info = RunInfo(
            run_dir=Path(cfg.run.dir),
            name=str(cfg.run.name),
            start_step=start,
            resumed=report.resumed,
            config=to_plain(cfg),
            replay_from=replay_from if replay else None,
            replay=replay,
        )
        try:
            loggers = build_loggers(cfg.logger, info)
        except Exception as err:  # any kind: the other ranks must not wait in agree_any
            failed = (
                err
                if isinstance(err, LoggerError)
                else LoggerError(f"the loggers could not start: {err!r}")
            )
    if agree_any(failed is not None):
        raise failed or LoggerError("the loggers could not start on rank 0 (its message says why)")
    return loggers


def _nothing_to_log(cfg: DictConfig, report: ResumeReport) -> bool:
    """A re-run of a finished run (no step left, no evaluation owed) logs nothing: its
    loggers are not started (each re-run opened an empty W&B run and a TensorBoard file)."""
    done = report.resumed and report.step >= int(cfg.trainer.max_steps)
    return done and not eval_owed(Path(cfg.run.dir), report.step)


def _run(cfg: DictConfig, device, world: World, p: _Parts, early: StopFlag) -> int:
    t = cfg.trainer
    # The stop flag is outermost: a signal while the final save commits is still honoured
    # (the save completes, then the process exits) instead of killing the commit.
    with StopFlag() as stop, Session(cfg, world, p.manager, p.loggers) as session:
        session.asked = p.asked
        if early.requested:  # received during start-up: stop at the first step boundary
            stop.request(early.reason)
        session.resumed(p.report)
        compiled = _compile(t, p, world, device)
        session.metadata = checkpoint_metadata(
            cfg, p.train.fingerprint, p.train.describe(), world, p.horizon, _val_fp(p.val)
        ) | {"step_compiled": compiled}
        state = place(p.state, device)
        step = make_step(
            p.model,
            p.loss_fn,
            p.tx,
            grad_accum=t.grad_accum,
            precision=t.precision,
            donate=t.donate,
            compile=compiled,
            shard=p.shard,
        )
        if step.sharder is not None:  # a fresh state's rows (a resumed one holds them already)
            state = shard_state(state, step.sharder)
            session.sharded = True
        loader = Loader(
            p.train,
            global_batch=t.batch_size,
            key=state["rng"].cpu(),
            rank=world.rank,
            world=world.size,
            shuffle=cfg.data.shuffle,
            drop_last=cfg.data.drop_last,
            prefetch=cfg.data.prefetch,
            device=device,
            vocab_size=model_vocab(cfg.model),
        )
        evaluating = t.eval_every and p.val is not None
        evaluate = (
            session.evaluator(p.model, p.loss_fn, p.val, device, stop) if evaluating else None
        )
        session.start_progress(int(state["step"]), device)
        watchdog = _watchdog(cfg, session)
        try:  # (the owed evaluation is a collective: a rank gone there is said as below)
            owed = bool(evaluating) and _eval_owed(cfg, world, p.report)
            forget_history()  # the start's questions are answered: not held through the run
            with loader, loader.iter_from(state["data"].cpu()) as batches:
                result = train_loop(
                    state,
                    step,
                    batches,
                    max_steps=t.max_steps,
                    save=session.save,
                    evaluate=evaluate,
                    eval_every=t.eval_every,
                    record=session.record,
                    log_every=t.log_every,
                    stop=stop,
                    agree=agree_any if world.active else None,
                    donate=t.donate,
                    on_nonfinite=t.on_nonfinite,
                    watchdog=watchdog,
                    evaluate_first=owed,
                )
            if result.status != "stopped":  # a signal from here on saves nothing, exits 0
                stop.meaning = _LATE_MEANING
            with _watching(watchdog, result):  # the final or stop save's commit may hang too
                session.finish(result)
        except NonFiniteError as err:
            return _diverged(err, session)
        except CheckpointSaveError as err:  # each rank said which step did not commit
            if world.active and _peer_gone(err):  # a rank died in the sharded save's exchange
                return _peer_lost(err, session, world)
            return _save_failed(err, p.manager, p.asked)
        except DataFormatError as err:
            return _bad_batch(err, session)
        except RuntimeError as err:
            if not (world.active and _peer_gone(err)):
                raise
            return _peer_lost(err, session, world)
    return EXIT_PREEMPTED if result.status == "stopped" else EXIT_OK


def _eval_owed(cfg: DictConfig, world: World, report: ResumeReport) -> bool:
    """A resume from a stop save whose evaluation the stop skipped (the coordinator reads
    the records; every rank evaluates together): that step is evaluated first."""
    owed = None
    if world.is_coordinator:
        owed = report.resumed and eval_owed(Path(cfg.run.dir), report.step)
    owed = bool(broadcast_json(owed))
    if owed and world.is_coordinator:
        print(
            f"[step={report.step}] evaluating step {report.step} first: the stop that saved it skipped its evaluation"
        )
    return owed


# what gloo (and NCCL) say when the rank at the other end of a collective died or left
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
# a collective that waited dist.timeout_s for a rank that stopped answering (SIGSTOP, a
# hung thread, a swapped-out node): gloo's "Timed out waiting 8000ms for recv operation"
_PEER_HUNG = re.compile(r"Timed out waiting \d+ ?ms for (recv|send)|collective operation timeout")


def _peer_gone(err: BaseException) -> bool:
    """Whether ``err``, or an error it was raised from (a sharded save failing because a
    rank died in its collective), is a collective's peer gone, or one that stopped
    answering until dist.timeout_s ran out (a traceback of the collective before)."""
    import torch.distributed

    dist_error = getattr(torch.distributed, "DistNetworkError", ())
    while err is not None:
        if isinstance(err, dist_error) or any(s in str(err) for s in _PEER_GONE):
            return True
        if _PEER_HUNG.search(str(err)):
            return True
        err = err.__cause__
    return False


def _peer_lost(err: RuntimeError, session: Session, world: World) -> int:
    """Another rank died mid-collective (SIGKILL, OOM, a lost node): this one cannot go on
    alone. One line, where a restart resumes, exit 1 (it was a 30-line traceback of
    torch's collective internals after the emergency save's lines)."""
    _settle(session)
    return _stopped(
        RuntimeError(_lost_rank(err, world)),
        session.manager,
        "the lost rank's cause (its own log: killed, out of memory, its node)",
        session.asked,
    )


# a rank lost during start-up: nothing was trained or saved by this start
_START_AGAIN = (
    "nothing was trained or saved by this start, the newest committed checkpoint is intact; "
    "fix the lost rank's cause (its own log: killed, out of memory, its node) and start again"
)


def _lost_rank(err: BaseException, world: World) -> str:
    """``rank R: another rank is gone (the collective's first line)``, or that it stopped
    answering for ``dist.timeout_s``."""
    while err.__cause__ is not None:  # the collective's own error, not the save's wrapper
        err = err.__cause__
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    what = (
        "another rank stopped answering for dist.timeout_s (hung or stopped: its log says "
        "which; trainer.hang_timeout_s has a hung rank dump its stacks and exit 4)"
        if _PEER_HUNG.search(str(err))
        else "another rank is gone"
    )
    return f"rank {world.rank}: {what} ({first})"


def _shard_mode(cfg: DictConfig, world: World) -> str:
    """``dist.shard``, except on one rank, where there is nothing to shard."""
    if cfg.dist.shard != "none" and world.size < 2:
        print(f"dist.shard={cfg.dist.shard} on one rank: nothing to shard, the state stays whole")
        return "none"
    return cfg.dist.shard


@contextlib.contextmanager
def _watching(watchdog: Watchdog | None, result):
    """The hang watchdog again while the run waits for its last save to commit (the loop
    stopped it when it returned): an async final or stop save whose write hangs ends the
    run with exit 4 like any other hang, instead of never. The allowance is the first
    step's (5 x ``hang_timeout_s`` by default): a whole background write, maybe with one
    emergency retry, not one blocking call."""
    if watchdog is None:
        yield
        return
    watchdog.phase("save", result.state, {}, safe=True)  # inside a save: no second one
    watchdog.start(allowance_s=watchdog.first_timeout_s)
    try:
        yield
    finally:
        watchdog.stop()


def _watchdog(cfg: DictConfig, session: Session) -> Watchdog | None:
    """The hang watchdog of ``trainer.hang_timeout_s`` (``None``: off); see ftrain.watchdog."""
    if cfg.trainer.hang_timeout_s is None:
        return None

    def save(state, metrics) -> bool | str:
        saved = session.save(state, metrics, force=True, reason="hang")
        if not saved and session.sharded:  # why, for the exit line (it blamed "nothing trained")
            return "the state is sharded over every rank and one rank cannot gather it"
        return saved

    watchdog = Watchdog(
        cfg.trainer.hang_timeout_s,
        run_dir=cfg.run.dir,
        save=save,
        drain=session.wait_commits,  # the final save counts (and is recorded) once committed
        on_hang=lambda info: session.record("hang", **info),
        exit=exit_process,  # in a sweep, the next jobs go on in a fresh process
        exit_note=hang_exit_note() + _rerun_hint(session.asked),
    )
    # said once at start, so a log shows the watchdog was on (and with which allowances)
    print(
        f"hang watchdog: exit 4 after {watchdog.timeout_s:g} s without progress "
        f"({watchdog.first_timeout_s:g} s for the first step)",
        flush=True,
    )
    return watchdog


def _save_failed(err: CheckpointSaveError, manager: CheckpointManager, asked: Asked) -> int:
    """A checkpoint that did not commit stops the run (a week of training must not go on
    unsaved): one message, where a re-run resumes, exit 1 (no traceback)."""
    short = out_of_memory(err)
    fix = (
        "the memory shortage (a higher memory or address-space limit, fewer other processes)"
        + threads_note(short)
        if short
        else "the cause (disk, permissions, the object store)"
    )
    return _stopped(err, manager, fix, asked)


def _bad_batch(err: DataFormatError, session: Session) -> int:
    """Data that cannot be trained on, found in a batch: the message names the data and
    the fix, after the loop's emergency save; exit 2 for a token id the model has no row
    for or a source's window of the wrong shape (the same command reads the same batch: a supervisor must not retry it), else 1
    (a file truncated under the run: a retry after it is regenerated may go on). A policy
    save still in flight is waited for first: it said "none (a re-run starts fresh)" while
    that step was committing."""
    _settle(session)
    code = _stopped(
        err,
        session.manager,
        "the data or the config as the message says (fixed data has a new fingerprint: "
        "resume it with data.allow_changed=true)",
        session.asked,
    )
    return EXIT_CONFIG if isinstance(err, (TokenRangeError, SampleShapeError)) else code


def _newest_committed(manager: CheckpointManager) -> str:
    """Where a re-run resumes, for the stop message: the location that just failed a
    save (an object store gone) may not list either, which raised past the message."""
    try:
        latest = manager.latest_step()
    except OSError as err:
        return f"unknown (the checkpoint location cannot be listed: {err})"
    said = f"step {latest}" if latest is not None else "none (a re-run starts fresh)"
    return said + _as_this_rank_saw_it()


def _as_this_rank_saw_it() -> str:
    """On a rank other than the coordinator, what it listed may be out of date by the
    time it is read: rank 0 may still commit an emergency save. torchrun names the first
    rank to fail as the root cause, so its line was the one read, and it said "none" or
    an older step while rank 0 committed a newer one."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        return ""
    return f" as rank {dist.get_rank()} saw it (rank 0 may commit a newer one: its log says)"


def _rerun_hint(asked: Asked) -> str:
    """For the hang exit's line: how to resume when the command itself would not."""
    command, why = rerun_command(asked)
    return f"; {command} to resume{why}" if why else ""


def _stopped(
    err: Exception, manager: CheckpointManager, fix: str, asked: Asked | None = None
) -> int:
    where = _newest_committed(manager)
    command, why = rerun_command(asked or Asked(), committed=where.startswith("step"))
    print(
        f"ftrain: {err}\nftrain: newest committed checkpoint: {where}; fix {fix} and {command} "
        f"to resume{why}",
        file=sys.stderr,
    )
    return EXIT_ERROR


def _settle(session: Session) -> None:
    """Before saying where a re-run resumes: an earlier step may still be committing; its
    outcome is recorded (committed, or save_failed) as at any other end."""
    try:
        session.wait_commits()
    except CheckpointSaveError as failed:  # it did not commit: say so beside the stop
        print(f"ftrain: {failed}", file=sys.stderr)


def _diverged(err: NonFiniteError, session: Session) -> int:
    """One message for a stopped divergence: what went wrong and where a resume starts."""
    _settle(session)
    where = _newest_committed(session.manager)
    print(f"ftrain: {err}\nftrain: newest committed checkpoint: {where}", file=sys.stderr)
    return EXIT_ERROR
