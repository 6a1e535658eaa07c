"""One run's side effects: metrics.jsonl, heartbeat, progress, saves and evaluation.

The loop only calls ``save(...)`` and ``record(...)``; this object decides what those
mean for the CLI (only the coordinator writes files; saves carry the run's metadata;
every save, resume and emergency is an event in ``metrics.jsonl``).

A save is two records, because an async save commits later (or never): ``save_started``
when the manager accepted it (with the seconds the call blocked), and ``committed`` once
the commit is known — its ``COMMITTED`` marker is seen at a step boundary, or a later
``manager.save``/``wait`` returned without error (the manager raises a failed background
save there). A save that failed is ``save_failed``. ``emergency_save`` says
``save_started`` and ``committed`` separately, after waiting for the commit (its ``saved``
is ``committed``).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from ftrain import _json
from ftrain.ckpt import CheckpointManager, CheckpointSaveError, hostrng
from ftrain.ckpt.commit import MARKER, step_dirname
from ftrain.cli.build import model_vocab
from ftrain.cli.restarts import elastic_job
from ftrain.data import val_batches
from ftrain.dist import World, agree_any, all_mean, broadcast_int, checkpoint_group, gather_json
from ftrain.loop import LoopResult
from ftrain.metrics import (
    Heartbeat,
    LoggerSet,
    MetricsWriter,
    Progress,
    format_field,
    memory_fields,
)
from ftrain.sharding import gather_state
from ftrain.signals import StopFlag
from ftrain.step import evaluate, make_eval_step

__all__ = ["Session"]

_LOCAL_REASONS = ("emergency", "hang")
_FAILED = 2  # the save verdict broadcast when the coordinator's background save failed
# per-rank throughput and counts: the run's are the sums over ranks
_THROUGHPUT = ("tokens_per_s", "samples_per_s")
_COUNTS = ("samples", "tokens")


def _run_wide(fields: dict, world: World, keys) -> dict:
    """``fields`` as the run sees them, not this rank's share: each of ``keys`` averaged
    over the ranks, counts and throughput summed. A collective: every rank calls it, with
    the same keys (the same step function made them)."""
    shared = all_mean({k: float(fields[k]) for k in keys if k in fields})
    out = dict(fields)
    for k, v in shared.items():
        out[k] = (
            round(v * world.size) if k in _COUNTS else v * world.size if k in _THROUGHPUT else v
        )
    return out


@dataclass(frozen=True)
class Asked:
    """``resume`` and ``run.overwrite`` as the command line gave them (a torchrun restart
    runs on with ``resume=latest``, but a relaunch of the command, a Slurm requeue, does
    what the command says)."""

    resume: object = "latest"
    overwrite: bool = False


def rerun_command(asked: Asked, committed: bool = True) -> tuple[str, str]:
    """What a stop message tells a person (or a supervisor) to run to resume, and why not
    simply the same command: with ``resume=none`` it refused the committed steps (exit 2:
    "never restart") or, with ``run.overwrite=true``, started over; with ``resume=N`` it
    went back to step N again. With nothing committed the same command starts afresh."""
    resume = str(asked.resume)
    if resume == "latest" or not committed:
        return "run the same command again", ""
    if resume == "none" and asked.overwrite:
        return (
            "run it again with resume=latest and without run.overwrite=true",
            " (this command would start over)",
        )
    why = "refuse the committed steps" if resume == "none" else f"go back to step {resume} again"
    return "run it again with resume=latest", f" (this command's resume={resume} would {why})"


class Session:
    """Context manager around one run; closing it waits for the last checkpoint commit."""

    def __init__(
        self,
        cfg: DictConfig,
        world: World,
        manager: CheckpointManager,
        loggers: LoggerSet | None = None,
    ) -> None:
        self.cfg, self.world, self.manager = cfg, world, manager
        self.loggers = loggers or LoggerSet()  # the logger= group's, on the coordinator only
        self.device = None
        self.run_dir = Path(cfg.run.dir)
        lead = world.is_coordinator
        self.writer = MetricsWriter(self.run_dir, enabled=lead)
        self.heartbeat = Heartbeat(
            self.run_dir, name="heartbeat.json" if lead else f"heartbeat.rank{world.rank}.json"
        )
        self.progress: Progress | None = None
        self.metadata: dict = {}
        # saves accepted by the manager whose commit is not yet known: {step: wall start}
        self._pending: dict[int, float] = {}
        self.sharded = False  # the state (optimizer, or params too) is sharded (dist.shard)
        self.asked = Asked(cfg.resume, bool(cfg.run.overwrite))  # _run sets the command's
        self._ckpt_group = None  # the async sharded saves' process group (made on first use)
        self._best_checked = False  # checkpoint.best_metric looked for in a step's metrics
        self.start_step: int | None = None  # the step this run started from (start_progress)

    # -- lifecycle --------------------------------------------------------------
    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._close_manager(propagating=exc[0] is not None)
        finally:
            if self.progress is not None:
                self.progress.close()
            self.loggers.close(timeout_s=_logger_close_s(self.cfg))
            self.writer.close()

    def _close_manager(self, *, propagating: bool) -> None:
        """Close the manager (waits for the save in flight). While another error is already
        ending the run (a peer died mid-collective), a failure of that save is one line
        beside it: raised, it replaced the error that explains the end, in a chain of three
        tracebacks."""
        try:
            self.manager.close()
        except CheckpointSaveError as err:
            if not propagating:
                raise
            said = bool(self._pending)  # a pending step's failure is said (and recorded)
            self._failed(err)
            if not said:
                print(f"ftrain: also: {err}", file=sys.stderr)

    def start_progress(self, start_step: int, device=None) -> None:
        self.device = device  # whose peak memory the step records show
        self.start_step = start_step
        self.progress = Progress(
            self.cfg.trainer.max_steps, start_step, rank=self.world.rank, world=self.world.size
        )
        self.started = time.time()

    def _say(self, step: int, message: str) -> None:
        if self.progress is not None:
            self.progress.log(step, message)
        else:
            prefix = f"[rank={self.world.rank}]" if self.world.active else ""
            print(f"{prefix}[step={step}] {message}", flush=True)

    # -- events -----------------------------------------------------------------
    def resumed(self, report) -> None:
        for line in report.lines():
            self._say(report.step, line)
        fields = {
            "from_step": report.step,
            "reason": report.reason,
            "resumed": report.resumed,
            "next_lr": report.next_lr,
            "epoch": report.epoch,
            "position": report.position,
            "redo": list(report.redo) if report.redo else None,
            "fingerprints": report.fingerprints,
            "changes": report.changes,
            "rank_positions": self._rank_positions(report),
            "rank_epochs": [e for e, _ in report.rank_starts] if report.rank_starts else None,
            "restore_s": report.restore_s,
            "host_rng": report.host_rng,
            "checkpoint_bytes": report.checkpoint_bytes,
            "skipped": {str(k): v for k, v in report.skipped.items()},
            "ignored": report.ignored,
            "world_sizes": list(report.world_sizes) if report.world_sizes else None,
            "rows_read": report.rows_read,  # the coordinator's: every rank prints its own
            "mapped_bytes": report.mapped,  # checkpoint.mmap_restore
            # init.from's "initialised params from DIR step N" (which base step), groups
            "notes": list(report.notes) or None,
            # which base step init.from read: a restart before the first commit reads it
            # again (ftrain.cli.basestep)
            "init_from": str(self.cfg.init["from"]) if report.init_step is not None else None,
            "init_step": report.init_step,
            "went_back": bool(report.left_behind),  # committed steps left (ftrain.cli.redo)
            "elastic_job": elastic_job(),  # a torchrun restart's (ftrain.cli.restarts)
            # where this start saves: a later start that finds no step names it
            "checkpoint_dirs": [
                d if "://" in str(d) else os.path.abspath(d)
                for d in (self.cfg.checkpoint.dir, self.cfg.checkpoint.fallback_dir)
                if d
            ],
        }
        self.writer.write("resume" if report.resumed else "start", step=report.step, **fields)

    def _rank_positions(self, report) -> list[int]:
        if report.rank_starts:  # a resume: as the sampler reads them (wrapping an epoch)
            return [p for _, p in report.rank_starts]
        # rank r reads the r-th contiguous slice of each global batch
        local = self.cfg.trainer.batch_size // self.world.size
        return [report.position + r * local for r in range(self.world.size)]

    def record(self, kind: str, **fields) -> None:
        step = fields.get("step", 0)
        if kind == "heartbeat":
            self.heartbeat.beat(step)
            return
        if kind == "step":
            fields = self._step_fields(fields)
            self.writer.write("step", **fields)
            self.loggers.log_metrics("step", step, fields)
            if self.progress is not None:
                self.progress.step(step, fields)
            return
        if kind == "emergency_save" and "saved" in fields:
            fields = self._emergency_fields(dict(fields))
        self.writer.write(kind, **fields)
        if kind == "eval":
            self.loggers.log_metrics("eval", step, fields)
        shown = " ".join(format_field(k, v) for k, v in fields.items() if k != "step")
        self._say(step, f"{kind} {shown}")

    def _step_fields(self, fields: dict) -> dict:
        """A step record as the run sees it: the global mean loss and the summed throughput
        in a data-parallel run (not this rank's share), plus this process's peak memory."""
        if self.world.active:
            fields = _run_wide(fields, self.world, ("loss", *_COUNTS, *_THROUGHPUT))
        return fields | {k: round(v, 1) for k, v in memory_fields(self.device).items()}

    # -- saving and evaluating ---------------------------------------------------
    def save(self, state, metrics: dict, *, force: bool, reason: str) -> bool:
        """Offer ``state`` to the manager. The coordinator writes (the state is replicated);
        in a data-parallel run every rank calls this, so each rank's host RNG states can be
        gathered into the checkpoint when the coordinator's manager wants the step."""
        host_rng = None
        if reason in _LOCAL_REASONS and int(state["step"]) == self.start_step:
            return self._skip_start_save(int(state["step"]), reason)
        self._check_best_metric(int(state["step"]), metrics)
        # emergency and hang saves happen on one rank alone: no collective may run there
        if self.sharded and reason in _LOCAL_REASONS:
            self._say(
                int(state["step"]),
                f"{reason} save skipped: the state is sharded over every rank (dist.shard) and "
                "one rank cannot gather it; the last committed step stands",
            )
            return False
        if self.world.active and reason not in _LOCAL_REASONS:
            verdict = broadcast_int(self._verdict(state, force))
            if verdict == _FAILED:
                self._stop_on_failed_save(int(state["step"]))
            if not verdict:
                return False
            force = True  # decided above for every rank: the save below must not re-decide
            # what the checkpoint records and keep_best ranks: the run's loss, not rank 0's
            # half of the batch (keep_best=loss kept the wrong steps on 2 ranks)
            metrics = _run_wide(metrics, self.world, ("loss", *_COUNTS))
            gathered = gather_json(hostrng.capture())
            host_rng = dict(enumerate(gathered)) if gathered is not None else None
            if self.sharded:  # every rank writes its own rows into one store
                return self._save_sharded(state, metrics, host_rng, reason)
        if not self.world.is_coordinator:
            return False
        self._seen_commits()
        t0, started = time.perf_counter(), time.time()
        try:
            extra = {"host_rng": host_rng} if host_rng is not None else {}
            saved = self.manager.save(
                state, metrics=metrics, metadata=self.metadata, force=force, **extra
            )
        except CheckpointSaveError as err:  # an earlier background save failed
            self._failed(err)
            raise
        if saved:
            # the manager waits for the save in flight before it starts another, so every
            # earlier pending save is now committed
            self._committed(list(self._pending))
            self._started(int(state["step"]), reason, t0, started, self.cfg.checkpoint.async_save)
        return saved

    def _skip_start_save(self, step: int, reason: str) -> bool:
        """No emergency or hang save of the state this run started from: it is committed
        already (a resume) or made again from the config (a fresh start, ``init.from``).
        Saving a fresh step 0 after a failure at step 1 (out of memory, a bad batch size,
        a bug in the loss) tied the run directory to the config that failed: the corrected
        run was refused as a changed model or optimizer."""
        self._say(
            step,
            f"{reason} save skipped: nothing was trained since this run started at step "
            f"{step} (committed already, or made again from the config on the next start)",
        )
        return False

    def _verdict(self, state, force: bool) -> int:
        """The coordinator's decision for every rank: save, skip, or stop because its
        background save failed (checked at every step, so no rank trains on for a whole
        save interval after a lost save, and all of them stop together)."""
        wants = not self.manager.failed and self.manager.wants(state, force=force)
        if wants:  # the save would wait for the one in flight: learn its outcome first
            self.manager.join()
        if self.manager.failed:
            return _FAILED
        return int(wants)

    def _stop_on_failed_save(self, step: int) -> None:
        self.manager.join()  # sharded: this rank's own part may be failing right now
        if self.manager.failed:  # the coordinator (and, sharded, every rank) holds the error
            self.wait_commits()  # records it and raises CheckpointSaveError
        self._stop_with_the_coordinator(step, "background")

    def _stop_with_the_coordinator(self, step: int, which: str) -> None:
        """A rank whose coordinator's save failed stops too, saying so (the error is in the
        coordinator's log)."""
        msg = f"the coordinator's {which} checkpoint save failed (its log says why)"
        self._say(step, f"stopping: {msg}")
        raise CheckpointSaveError(msg)

    def _started(self, step: int, reason: str, t0: float, started: float, async_save) -> None:
        """Record a save the manager accepted; a sync save is committed once it returns."""
        self.record(
            "save_started",
            step=step,
            reason=reason,
            blocking_s=round(time.perf_counter() - t0, 4),
            async_save=bool(async_save),
        )
        self._pending[step] = started
        if not async_save:
            self._committed([step])

    def _save_sharded(self, state, metrics: dict, host_rng, reason: str) -> bool:
        """All ranks: the multi-writer two-phase save, into a directory or an object store
        alike (each rank writes its own chunks). Async (``checkpoint.async_save``) in a
        background thread whose collectives run on a gloo group of their own. Every rank
        tracks the step, so each one says it if the step does not commit."""
        t0, started, step = time.perf_counter(), time.time(), int(state["step"])
        async_save = bool(self.cfg.checkpoint.async_save)
        if async_save and self._ckpt_group is None:  # collective: every rank, same point
            self._ckpt_group = checkpoint_group(self.cfg.dist.timeout_s)
        earlier = list(self._pending)  # the manager waits for them before it starts
        try:
            self.manager.save_sharded(
                state,
                metrics=metrics,
                metadata=self.metadata,
                host_rng=host_rng,
                group=self._ckpt_group,
            )
        except CheckpointSaveError as err:  # raised on every rank: each says so
            if not async_save:  # (async: the failed save is the pending one)
                self._pending.setdefault(step, started)
            self._failed(err)
            raise
        self._committed(earlier)
        self._started(step, reason, t0, started, async_save=async_save)
        return True

    def _marker(self, step: int, started: float):
        """``(mtime, path)`` of ``step``'s marker if one is in place written after
        ``started`` (an older directory of the same step number does not count), else
        ``None``."""
        dirs = [self.manager.directory, getattr(self.manager, "fallback_directory", None)]
        for d in filter(None, dirs):
            try:
                base = d if hasattr(d, "url") else Path(d)  # an ObjectRoot has stat() too
                path = base / step_dirname(step) / MARKER
                mtime = path.stat().st_mtime
            except OSError:
                continue
            if mtime >= started - 1.0:  # coarse file-system clocks
                return mtime, path
        return None

    def _seen_commits(self) -> None:
        """Record the pending saves the manager has committed (asked of it, not of the
        location: this runs at every step while a save is pending, and a store's outage
        held each step for minutes, in an asynchronous save)."""
        self._committed([s for s in self._pending if self.manager.committed_here(s)])

    def _committed(self, steps: list[int]) -> None:
        """A ``committed`` record per step: seconds from start to marker and, from the
        marker, the step's bytes and how many this save wrote and linked (incremental)."""
        for step in sorted(steps):
            started = self._pending.pop(step, None)
            if started is None:
                continue
            found = self._marker(step, started) if self.world.is_coordinator else None
            fields = {}
            if found is not None:
                fields = {"after_s": round(found[0] - started, 3)} | _save_bytes(found[1])
            self.writer.write("committed", step=step, **fields)

    def _check_best_metric(self, step: int, metrics: dict) -> None:
        """Once: warn when ``checkpoint.keep_best`` ranks by a metric the steps do not
        report (a typo keeps no step by it, silently). A ``val_*`` metric is checked at the
        first save that has an evaluation's metrics (``val_los`` passed unchecked, and
        keep_last deleted the best step)."""
        c = self.cfg.checkpoint
        if self._best_checked or not c.keep_best:
            return
        if not metrics or not self.world.is_coordinator:  # no step ran (a final save only)
            return
        evaluated = [k for k in metrics if k.startswith("val_")]
        if str(c.best_metric).startswith("val_") and not evaluated:
            return  # no evaluation at this step's save: the next one with one is checked
        self._best_checked = True
        if c.best_metric not in metrics:
            which = "evaluation" if evaluated and str(c.best_metric).startswith("val_") else "step"
            shown = evaluated if which == "evaluation" else sorted(metrics)
            self._say(
                step,
                f"warning: checkpoint.best_metric={c.best_metric!r} is not among this run's "
                f"{which} metrics ({', '.join(sorted(shown))}): checkpoint.keep_best keeps no "
                "step by it",
            )

    def _failed(self, err: BaseException) -> None:
        for step in sorted(self._pending):
            self.writer.write("save_failed", step=step, error=str(err))
            self._say(step, f"checkpoint of step {step} did not commit: {err}")
        self._pending.clear()

    def wait_commits(self) -> None:
        """Block until the save in flight commits; record the outcome, re-raise a failure."""
        try:
            self.manager.wait()
        except CheckpointSaveError as err:
            self._failed(err)
            raise
        self._committed(list(self._pending))

    def _emergency_fields(self, fields: dict) -> dict:
        """``saved`` from the loop means "started": wait, and make ``saved`` mean committed."""
        started = bool(fields.get("saved"))
        fields |= {"save_started": started, "committed": False, "saved": False}
        if started and self.world.is_coordinator:
            try:
                self.wait_commits()
                fields["committed"] = fields["saved"] = True
            except Exception as err:  # the original error is what the caller re-raises
                fields["commit_error"] = repr(err)
        return fields

    def evaluator(self, model, loss_fn, val_src, device, stop: StopFlag | None = None):
        """``evaluate(state) -> {"val_loss": ...}`` over fixed validation batches, averaged
        over ranks; ``None`` when ``stop`` is requested part-way (checked before each batch,
        agreed by all ranks: every rank evaluates the same number of batches)."""
        eval_step = make_eval_step(model, loss_fn, precision=self.cfg.trainer.precision)
        t = self.cfg.trainer

        def stopping() -> bool:
            local = stop is not None and stop.requested
            return agree_any(local) if self.world.active else local

        def run(state) -> dict[str, float] | None:
            batches = val_batches(
                val_src,
                t.eval_batches,
                t.batch_size,
                self.world.rank,
                self.world.size,
                device=device,
                vocab_size=model_vocab(self.cfg.model),
            )
            if self.sharded:  # shard=full: every rank gathers whole params (collective)
                state = gather_state(state, ("params",))
            try:
                out = evaluate(eval_step, state, _until_stopped(batches, stopping))
            except _EvalStopped:
                return None
            return all_mean({"val_loss": out["loss"]})

        return run

    def finish(self, result: LoopResult) -> None:
        step = int(result.state["step"])
        failure = None
        try:
            if self.world.is_coordinator or self.sharded:  # sharded: every rank wrote a part
                self.wait_commits()  # the final save counts only once committed
            else:
                self.manager.wait()
        except CheckpointSaveError as err:
            failure = err
            self._retry_last_save(result, err)
        # a barrier (no rank reports the end before the coordinator committed) that also
        # tells every rank whether the last save failed, so none waits here for the others
        if agree_any(failure is not None):
            if failure is not None:
                raise failure
            self._stop_with_the_coordinator(step, "last")
        kind = "stop" if result.status == "stopped" else "end"
        reason = result.reason or ("done" if kind == "end" else "stopped")
        committed = self.manager.latest_step()
        self.record(kind, step=step, reason=reason, committed=committed)
        if kind == "stop" and self.world.is_coordinator:  # the one line a person looks for
            by = f"by {reason}" if reason.startswith("SIG") else f"({reason})"
            command, why = rerun_command(self.asked)
            again = (
                f"{committed}. {command.capitalize()} to resume from it{why}"
                if committed is not None
                else "none (a re-run starts fresh)"
            )
            print(
                f"ftrain: stopped {by} at step {step}; newest committed step: {again}", flush=True
            )
        if self.cfg.run.plot and self.world.is_coordinator:
            self._plot(step)

    def _retry_last_save(self, result: LoopResult, err: CheckpointSaveError) -> None:
        """The final or stop save failed in the background: one emergency retry, as a
        failed synchronous save gets in the loop (a one-off full disk must not cost the
        run's last steps). The run still ends with the failure (exit 1). One rank's
        retry: not for a sharded state, which every rank writes."""
        if self.sharded or not self.world.is_coordinator:
            return
        step = int(result.state["step"])
        try:
            metrics = result.saved_metrics or result.last_metrics  # the step's own
            saved = self.save(result.state, metrics, force=True, reason="emergency")
            if saved:
                self.wait_commits()
            self.record("emergency_save", step=step, saved=bool(saved), error=repr(err))
        except Exception as save_err:  # the first failure is what the run reports
            self.record(
                "emergency_save", step=step, saved=False, error=repr(err), save_error=repr(save_err)
            )

    def _plot(self, step: int) -> None:
        from ftrain.plot import NothingToPlot, plot_run  # matplotlib: imported by plot_run

        try:
            path = plot_run(self.run_dir, title=f"{self.cfg.run.name} ({self.run_dir})")
            self._say(step, f"plot written to {path}")
        except NothingToPlot:
            self._say(step, "no step recorded yet: no plot")
        except ModuleNotFoundError as err:
            if (err.name or "").partition(".")[0] != "matplotlib":  # one of its own imports
                print(
                    f"ftrain: could not write the plot ({err!r}); training is done", file=sys.stderr
                )
                return
            print(
                "ftrain: matplotlib is not installed; skipping the plot (pip install matplotlib)",
                file=sys.stderr,
            )
        except Exception as err:  # the plot is a convenience: never fail a finished run
            print(f"ftrain: could not write the plot ({err!r}); training is done", file=sys.stderr)


def _save_bytes(marker_path) -> dict:
    """``bytes`` / ``written_bytes`` / ``linked_bytes`` from a marker (JSON; advisory: an
    unreadable marker gives none, the commit stands on its own checks)."""
    try:
        marker = _json.loads(marker_path.read_bytes())
    except (OSError, ValueError):
        return {}
    keys = ("bytes", "written_bytes", "linked_bytes")
    return {
        k: marker[k] for k in keys if isinstance(marker, dict) and isinstance(marker.get(k), int)
    }


LOGGER_CLOSE_S = 60.0  # a logger's close at the end of a run, without a hang watchdog


def _logger_close_s(cfg: DictConfig) -> float:
    """How long the end of a run waits for each logger to close: the hang watchdog's
    timeout where one is set (the run's own measure of "stuck"), else a minute."""
    hang = cfg.trainer.get("hang_timeout_s")
    return float(hang) if hang else LOGGER_CLOSE_S


class _EvalStopped(Exception):
    """A stop request came during an evaluation: its save goes first."""


def _until_stopped(batches, stopping):
    """``batches``, until ``stopping()`` says a stop was requested (asked before each)."""
    for batch in batches:
        if stopping():
            raise _EvalStopped
        yield batch
