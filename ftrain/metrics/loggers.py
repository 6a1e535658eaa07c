"""Metric loggers beside ``metrics.jsonl``: TensorBoard, Weights & Biases, CSV (``logger=``).

``metrics.jsonl`` is the run's own record and is always written (resume reports, redo
ranges, :mod:`ftrain.plot` and ``ftrain.ckpt advise`` read it). The ``logger`` config group
adds other sinks: each entry of ``cfg.logger`` with a ``_target_`` is built by Hydra's
``instantiate`` from the *composed* config of this start (never from checkpoint metadata)
and called with one more keyword, ``run`` (a :class:`RunInfo`). A logger is any object with

- ``log_metrics(kind, step, values)``: ``kind`` is ``"step"`` (a training step record) or
  ``"eval"``; ``values`` maps the record's names (``loss``, ``lr``, ``tokens_per_s``,
  ``val_loss``, ...) to floats;
- ``close()``.

Loggers run on the coordinator only. Like ``metrics.jsonl`` they are advisory: one that
raises while training is warned about once and dropped; training goes on.

On resume a logger continues where the restored step left off. Steps after it that ran
before a crash are redone and logged again: :class:`TensorBoardLogger` opens its writer
with ``purge_step=start + 1`` so TensorBoard discards the orphaned events of the first
attempt, :class:`WandbLogger` logs them again on the same run (its charts use ftrain's
``step`` as the x axis, so a redone step is a second point at the same x) and
:class:`CsvLogger` drops its rows past the start step before appending (one row per step
and kind). After an abandoned go-back (:attr:`RunInfo.replay`) TensorBoard and the CSV
purge from the go-back's step and write the committed history's records again.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import inspect
import logging
import math
import netrc
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ftrain.signals import StopFlag

__all__ = [
    "CsvLogger",
    "LoggerError",
    "LoggerSet",
    "RunInfo",
    "TensorBoardLogger",
    "WandbLogger",
    "build_loggers",
    "check_loggers",
]

log = logging.getLogger(__name__)


class LoggerError(ValueError):
    """A ``logger=`` entry cannot be used: a missing extra, an unknown key, a bad target."""


@dataclass(frozen=True)
class RunInfo:
    """What a logger is told about the run it logs.

    Attributes:
        run_dir: ``run.dir``.
        name: ``run.name``.
        start_step: the step training starts from (0 fresh, N after a resume from step N).
        resumed: whether this start restored a checkpoint.
        config: the resolved config, plain data (for wandb's run config).
        replay_from, replay: where an earlier start was abandoned (a go-back killed before
            its first save wrote records for a history no checkpoint kept), the step it
            went back to, and the ``metrics.jsonl`` records of the committed history after
            it up to ``start_step`` (:func:`ftrain.metrics.history.replay_for`); a logger
            that shows one record per step writes them again. ``None`` and ``[]``
            otherwise.
    """

    run_dir: Path
    name: str
    start_step: int = 0
    resumed: bool = False
    config: dict = field(default_factory=dict)
    replay_from: int | None = None
    replay: list[dict] = field(default_factory=list)

    @property
    def kept_until(self) -> int:
        """The last step whose earlier records still stand: records past it are redone
        by this start or written again from :attr:`replay`."""
        return self.replay_from if self.replay_from is not None else self.start_step


class Logger(Protocol):
    def log_metrics(self, kind: str, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def tag(kind: str, name: str) -> str:
    """A chart name grouped by kind: ``train/loss``, ``train/lr``, ``val/loss``."""
    if kind == "eval":
        return f"val/{name[4:]}" if name.startswith("val_") else f"val/{name}"
    return f"train/{name}"


# -- TensorBoard -----------------------------------------------------------------------------


class TensorBoardLogger:
    """Event files under ``log_dir`` via ``torch.utils.tensorboard.SummaryWriter``.

    Scalars are tagged ``train/NAME`` and ``val/NAME`` at ftrain's step. On every start the
    writer gets ``purge_step=start_step + 1``: TensorBoard then drops events of earlier files
    in ``log_dir`` at or after that step — the redone steps' first attempt after a resume,
    an old run's curves after ``resume=none``. After an abandoned go-back the purge starts
    at the go-back's step instead, and the committed history's records up to the start step
    are written again (:attr:`RunInfo.replay`): the go-back's purge had hidden them.

    Example:
        >>> # logger=tensorboard; then: tensorboard --logdir runs/NAME/tensorboard
    """

    requires = ("tensorboard", "tensorboard")  # (module, ftrain extra)

    def __init__(self, *, run: RunInfo, log_dir: str | None = None, flush_secs: float = 30) -> None:
        if (
            isinstance(flush_secs, bool)
            or not isinstance(flush_secs, int | float)
            or not (0 < flush_secs < math.inf)
        ):  # "abc" failed in tensorboard's own thread, with a traceback; -1 was accepted
            raise LoggerError(
                f"logger.tensorboard.flush_secs={flush_secs!r} is invalid: seconds > 0, e.g. 30"
            )
        self.log_dir = Path(log_dir) if log_dir else run.run_dir / "tensorboard"
        self.log_dir.mkdir(parents=True, exist_ok=True)  # a place that cannot be: said at start
        _quiet_tensorboard_writer_threads()
        self._run, self._flush_secs, self._writer = run, flush_secs, None

    @property
    def writer(self):
        """The event file's writer, opened at the first record: its purge is part of the
        file, and a start that ends before it logs anything (a failure or a signal during
        start-up, which writes no record of the start) must purge nothing: the next start
        could not tell that history needs writing again."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            run = self._run
            self._writer = SummaryWriter(
                str(self.log_dir), purge_step=run.kept_until + 1, flush_secs=self._flush_secs
            )
            for r in run.replay:  # the committed history an abandoned go-back's events hid
                self._add(r["kind"], r["step"], replayed_values(r))
            if run.replay:  # on disk now: the next start replays only if this one is abandoned
                self._writer.flush()
        return self._writer

    def log_metrics(self, kind: str, step: int, values: Mapping[str, float]) -> None:
        self.writer  # noqa: B018 - opened (and the history replayed) before this record
        self._add(kind, step, values)

    def _add(self, kind: str, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(tag(kind, name), value, global_step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _quiet_tensorboard_writer_threads() -> None:
    """tensorboard's writer thread re-raises its error (a full disk, its directory removed)
    into ``threading.excepthook``: ~15 lines of traceback on stderr, although it keeps the
    error and the logger's next write raises it to :class:`LoggerSet`, which says it once
    and drops the logger. Hooked once per process; other threads' errors go on as before."""
    try:
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    except ImportError:  # another tensorboard layout: its tracebacks stay
        return
    previous = threading.excepthook
    if getattr(previous, "ftrain_tensorboard", False):
        return

    def hook(args) -> None:
        if isinstance(args.thread, _AsyncWriterThread) and isinstance(args.exc_value, Exception):
            return  # raised again by the logger's next write, and said there
        previous(args)

    hook.ftrain_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


# -- Weights & Biases --------------------------------------------------------------------------

_RUN_ID_FILE = "ftrain-run-id"


class WandbLogger:
    """A Weights & Biases run, one per run directory, continued on every resume.

    The run id is kept in ``RUN_DIR/wandb/ftrain-run-id``, in the run directory whatever
    ``dir`` says (``dir``, default the run directory, holds wandb's own files): every resume
    opens the same run (``resume="allow"``); a fresh start (step 0, no checkpoint restored)
    makes a new one. Two runs sharing one ``dir`` each keep their own id (under ``dir`` the
    second run's id replaced the first's, and the first's resume logged into the second's
    W&B run). ftrain's step is
    logged as the metric ``step`` and every chart uses it as x axis (``define_metric``);
    wandb's own ``_step`` keeps counting, so steps redone after a crash are logged again and
    show as a second point at the same ``step``.

    ``mode``: ``online``, ``offline`` or ``disabled``; ``None`` takes ``WANDB_MODE``, else
    ``online`` when an API key is configured (``WANDB_API_KEY`` or ``wandb login``), else
    ``offline`` (with one line saying so) — there is never a login prompt. An online run
    whose service cannot be reached at start (an outage, a proxy, a wrong entity) logs
    offline instead, with one line saying why: training is never held up by a dashboard.
    An offline run is uploaded later with ``wandb sync DIR/wandb/offline-run-*``.
    """

    requires = ("wandb", "wandb")

    def __init__(
        self,
        *,
        run: RunInfo,
        project: str = "ftrain",
        name: str | None = None,
        entity: str | None = None,
        group: str | None = None,
        tags: list[str] | tuple[str, ...] = (),
        mode: str | None = None,
        dir: str | None = None,  # noqa: A002 - wandb's own name for it
    ) -> None:
        import wandb

        if mode not in (None, "online", "offline", "disabled"):
            raise LoggerError(
                f"logger.wandb.mode={mode!r} is invalid: use online, offline, disabled or null"
            )
        tags = [tags] if isinstance(tags, str) else list(tags)
        if not all(isinstance(t, str) for t in tags):  # an 8-line pydantic dump from wandb
            raise LoggerError(
                f"logger.wandb.tags={tags!r} is invalid: tags are strings; quote numbers "
                '(logger.wandb.tags=\'["1","2"]\')'
            )
        root = Path(dir) if dir else run.run_dir
        (root / "wandb").mkdir(parents=True, exist_ok=True)
        (Path(run.run_dir) / "wandb").mkdir(parents=True, exist_ok=True)
        if run.resumed:
            _say_id_left_behind(root, Path(run.run_dir))
        settings = {
            "project": project,
            "name": name or run.name,
            "entity": entity,
            "group": group,
            "tags": tags or None,  # a lone "foo" is one tag, not f, o, o
            "dir": str(root),
            "id": _run_id(Path(run.run_dir) / "wandb" / _RUN_ID_FILE, fresh=not run.resumed),
            "resume": "allow",
            "config": run.config,
            "settings": wandb.Settings(console="off", silent=True),
        }
        resolved = _wandb_mode(mode)
        try:
            self.run = wandb.init(mode=resolved, **settings)
        except Exception as err:
            if resolved != "online":
                raise
            # the service unreachable (an outage, a proxy, a wrong entity): exit 2 said
            # "never restart" to a supervisor, for a dashboard; the records stay local
            print(
                f"ftrain: wandb could not start online ({str(err).splitlines()[0][:200]}); "
                f"logging offline instead: upload later with `wandb sync {root}/wandb/"
                "offline-run-*` (logger.wandb.mode=offline skips the attempt)",
                flush=True,
            )
            with contextlib.suppress(Exception):  # the failed init holds the run id in its service
                wandb.teardown()
            self.run = wandb.init(mode="offline", **settings)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log_metrics(self, kind: str, step: int, values: Mapping[str, float]) -> None:
        self.run.log({"step": step, **{tag(kind, k): v for k, v in values.items()}})

    def close(self) -> None:
        self.run.finish()


def _say_id_left_behind(root: Path, run_dir: Path) -> None:
    """A run from before 2026-12-07 with ``logger.wandb.dir`` elsewhere kept its W&B run
    id under that directory, where another run sharing it may have replaced it: it is not
    taken (it could continue another run's W&B run); one line says how to continue it."""
    legacy, own = root / "wandb" / _RUN_ID_FILE, run_dir / "wandb" / _RUN_ID_FILE
    if own.exists() or not legacy.exists() or legacy.resolve() == own.resolve():
        return
    print(
        f"ftrain: wandb: this run's W&B id is kept in {own} (since 2026-12-07); the one in "
        f"{legacy} may be another run's sharing that directory and is not taken: a new W&B "
        f"run starts. To continue that one, copy {legacy} to {own} before resuming",
        flush=True,
    )


def _run_id(path: Path, *, fresh: bool) -> str:
    """This run directory's wandb run id: read from ``path`` on a resume, else made and
    written there (a fresh start is a new wandb run, also in a reused directory).

    The file also holds where the run directory was (its resolved path and inode): a copy
    of it elsewhere (``cp -r runs/a runs/b``: another path *and* another inode) is its own
    history, and continuing the original's W&B run from it interleaved two histories in one
    run. A copy gets a new id, said in one line. The same path with another inode (a
    restore onto another node, a FUSE mount whose inodes change per mount) and a move or
    rename on one file system (the same inode) keep the id; so does an id file without
    them (ftrain before 2026-12-07, or written by hand). A move across file systems reads
    as a copy: the line says how to continue the old W&B run."""
    run_dir = path.parent.parent  # RUN_DIR/wandb/ftrain-run-id
    here = (str(run_dir.resolve()), os.stat(run_dir).st_ino)
    if not fresh:
        existing, made_at = _read_run_id(path)
        copied = made_at is not None and made_at[0] != here[0] and made_at[1] != here[1]
        if existing and not copied:
            _write_run_id(path, existing, here)
            return existing
        if existing:
            print(
                f"ftrain: wandb: {run_dir} is a copy of {made_at[0]} (or was moved here from "
                f"another file system), whose W&B run is {existing}: a new W&B run starts, so "
                f"two histories cannot share one; to continue {existing} from here instead, "
                f"write {existing} alone into {path} before resuming",
                flush=True,
            )
    new = secrets.token_hex(4)
    _write_run_id(path, new, here)
    return new


_PATH_KEY, _INODE_KEY = "dir_path=", "dir_inode="


def _read_run_id(path: Path) -> tuple[str, tuple[str, int] | None]:
    """``(id, (path, inode) of the run directory that last used it))``; ``("", None)``
    without a file; ``None`` for the place of an id file that does not record one."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return "", None
    run_id = lines[0].strip() if lines else ""
    fields = {k: line.removeprefix(k) for line in lines[1:] for k in (_PATH_KEY, _INODE_KEY)
              if line.startswith(k)}  # fmt: skip
    inode = fields.get(_INODE_KEY, "")
    if _PATH_KEY not in fields or not inode.isdigit():
        return run_id, None
    return run_id, (fields[_PATH_KEY], int(inode))


def _write_run_id(path: Path, run_id: str, here: tuple[str, int]) -> None:
    if _read_run_id(path) != (run_id, here):
        path.write_text(f"{run_id}\n{_PATH_KEY}{here[0]}\n{_INODE_KEY}{here[1]}\n")


def _wandb_mode(mode: str | None) -> str:
    if mode is not None:
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if _has_wandb_key():
        return "online"
    print(
        "ftrain: wandb has no API key (WANDB_API_KEY or `wandb login`): logging offline; "
        "upload later with `wandb sync RUN_DIR/wandb/offline-run-*`",
        flush=True,
    )
    return "offline"


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1]
    try:
        return netrc.netrc().authenticators(host.rstrip("/")) is not None
    except (OSError, netrc.NetrcParseError):
        return False


# -- CSV ---------------------------------------------------------------------------------------


class CsvLogger:
    """``metrics.csv``: one row per step record and per eval, columns ``step, time, kind`` and
    the metric names of ``metrics.jsonl`` (``loss``, ``lr``, ..., ``val_loss``).

    A metric that appears later (the first ``val_loss``) widens the header: the file is
    rewritten once with the new column. On resume the rows past the step it resumes from
    are dropped first (those steps are redone; after a go-back they are another history's),
    and after an abandoned go-back the committed history's rows are written again
    (:attr:`RunInfo.replay`): each step has one ``step`` row (and one ``eval`` row where it
    was evaluated). Until 2026-12-07 rows were only appended, and a redone step appeared
    twice, a go-back's abandoned future steps stayed.
    """

    requires = None

    def __init__(self, *, run: RunInfo, path: str | None = None) -> None:
        self.path = Path(path) if path else run.run_dir / "metrics.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns = self._existing_header()
        self._file = open(self.path, "a", newline="")  # noqa: SIM115 - held open for the run
        # done at the first row: a start that ends before it logs anything (a failure or a
        # signal during start-up, which writes no record of the start) changes nothing
        self._pending: RunInfo | None = run  # a fresh start: the killed first attempt's rows

    def _settle(self) -> None:
        """Drop the rows past the step this start continues from (0 on a fresh start) and
        write the replayed history (once)."""
        run, self._pending = self._pending, None
        if self.columns:
            self._drop_rows_after(run.kept_until)
        for r in run.replay:
            self._write_row(r["kind"], r["step"], replayed_values(r), r.get("time"))

    def _existing_header(self) -> list[str]:
        """The header of the file this run appends to, its torn last row (a kill, a full
        disk mid-write) cut off: appending after it glued the next row onto it. A CSV of
        this logger's that cannot be read (not UTF-8, a torn header) is moved aside with a
        warning and a new one begun: the CSV mirrors ``metrics.jsonl``, never a reason to
        refuse a restart. A directory or a file that is not this logger's is refused, never
        moved: it is someone else's (a data file, the run's records)."""
        if self.path.is_dir():
            raise LoggerError(
                f"logger.csv.path={self.path} is a directory; point it at a file "
                "(default ${run.dir}/metrics.csv)"
            )
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        if not raw:  # a start that ended before its first row
            return []
        if not _starts_like_ours(raw):
            raise LoggerError(
                f"logger.csv.path={self.path} holds a file that is not a metrics CSV of "
                f"ftrain's (its first line does not begin with 'step,'); it is left as it is. "
                "Point logger.csv.path at a new file or move that file away"
            )
        try:
            if b"\n" not in raw:
                raise ValueError("no complete header line")
            # the whole file, not its header only: a bad byte in a row failed the first
            # rewrite (a new column) mid-run, and the logger was dropped
            raw.decode("utf-8")
            if b"\0" in raw:  # a crash's NUL-filled tail, kept as a row
                raise ValueError("NUL bytes in the file (a crash's garbage)")
            header = raw.split(b"\n", 1)[0].decode("utf-8").rstrip("\r")
        except ValueError as err:
            return self._set_aside(err)
        if not raw.endswith(b"\n"):
            with open(self.path, "r+b") as f:
                f.truncate(raw.rindex(b"\n") + 1)
        return next(csv.reader([header]))

    def _set_aside(self, err: Exception) -> list[str]:
        aside = self.path.with_name(f"{self.path.name}.damaged-{int(time.time())}-{os.getpid()}")
        try:
            if aside.exists():
                raise FileExistsError(f"{aside} exists")
            os.rename(self.path, aside)
        except OSError as e:
            raise LoggerError(
                f"{self.path} cannot be read as a CSV ({err}) nor moved aside ({e}); move or "
                "delete it, or drop csv from logger="
            ) from None
        log.warning(
            "ftrain: %s cannot be read as a CSV (%s); moved to %s, a new one begins "
            "(metrics.jsonl holds every record)",
            self.path,
            err,
            aside.name,
        )
        return []

    def log_metrics(self, kind: str, step: int, values: Mapping[str, float]) -> None:
        if self._pending is not None:
            self._settle()
        self._write_row(kind, step, values, time.time())

    def _write_row(self, kind: str, step: int, values: Mapping[str, float], when) -> None:
        when = round(when, 3) if isinstance(when, int | float) else ""
        row = {"step": step, "time": when, "kind": kind, **values}
        self._begin_again_if_gone(step)
        new = [k for k in row if k not in self.columns]
        if new or not self.columns:
            self._widen(self.columns + new)
        csv.DictWriter(self._file, self.columns, restval="").writerow(
            {k: _cell(v) for k, v in row.items()}
        )
        self._file.flush()

    def _begin_again_if_gone(self, step: int) -> None:
        """The file deleted or replaced mid-run (a cleanup, a log rotation): every later
        row went into the unlinked file, silently. A new one begins, said once, as
        metrics.jsonl does."""
        try:
            same = os.path.samestat(os.fstat(self._file.fileno()), os.stat(self.path))
        except FileNotFoundError:
            same = False
        if same:
            return
        log.warning(
            "ftrain: %s was removed or replaced during the run; a new one begins at step %d "
            "(metrics.jsonl holds every record)",
            self.path,
            step,
        )
        self._file.close()
        self.columns = []  # the next write widens an empty header: a new file, header first
        self._file = open(self.path, "a", newline="")  # noqa: SIM115

    def _drop_rows_after(self, step: int) -> None:
        """Rewrite the file without its rows of steps past ``step`` (if it has any)."""
        with open(self.path, newline="") as f:
            if all(_row_step(row) <= step for row in csv.DictReader(f)):
                return
        self._rewrite(self.columns, keep=lambda row: _row_step(row) <= step)

    def _widen(self, columns: list[str]) -> None:
        """Rewrite the file with ``columns`` as its header (old rows keep their values)."""
        self._rewrite(columns)

    def _rewrite(self, columns: list[str], keep=lambda row: True) -> None:
        """The file again with ``columns`` as its header, its rows that ``keep`` takes
        (row by row: a long run's CSV is never held in memory)."""
        self._file.close()
        tmp = self.path.with_suffix(".csv.tmp")
        try:
            with open(self.path, newline="") as src, open(tmp, "w", newline="") as f:
                w = csv.DictWriter(f, columns, restval="", extrasaction="ignore")
                w.writeheader()
                if self.columns:  # cells past the header (a bad row): dropped
                    w.writerows(r for r in csv.DictReader(src, restkey=_EXTRA) if keep(r))
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.columns = columns
        self._file = open(self.path, "a", newline="")  # noqa: SIM115

    def close(self) -> None:
        self._file.close()


_EXTRA = "\0extra"  # DictReader's key for a row's cells past the header


def _row_step(row: dict) -> int:
    """A row's step; a row without a readable one (hand-edited) sorts before every step."""
    try:
        return int(row.get("step") or -1)
    except ValueError:
        return -1


def _starts_like_ours(raw: bytes) -> bool:
    """Whether ``raw`` begins as this logger's header does (``step,``), or is a torn
    prefix of it (a kill while the header was written)."""
    return raw.startswith(b"step,") or b"step,".startswith(raw)


def _cell(value: Any) -> Any:
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


# -- building them from the config ---------------------------------------------------------------


def _entries(node) -> dict[str, Any]:
    """The ``logger`` node's entries that name a ``_target_`` (``jsonl`` is built in)."""
    from omegaconf import DictConfig, OmegaConf

    if node is None:
        return {}
    if not isinstance(node, DictConfig | Mapping):
        raise LoggerError(
            f"logger={node!r} is invalid: pick options of the logger group, e.g. "
            "logger=tensorboard or 'logger=[jsonl,tensorboard,csv]'"
        )
    out = {}
    for name, entry in node.items():
        if isinstance(entry, DictConfig):
            entry = OmegaConf.to_container(entry, resolve=True)
        if not isinstance(entry, Mapping):
            raise LoggerError(f"logger.{name}={entry!r} is invalid: a logger entry is a mapping")
        if "_target_" in entry:
            out[str(name)] = dict(entry)
    return out


def _resolve(name: str, entry: dict):
    """The class (or factory) of ``logger.NAME._target_``, its extra installed, keys known."""
    from hydra._internal.utils import _locate  # get_method printed Hydra's own 3 lines too

    target = entry["_target_"]
    try:
        factory = _locate(str(target))
    except Exception as err:
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise LoggerError(
            f"logger.{name}._target_={target!r} cannot be imported ({cause}); fix the dotted path"
        ) from None
    module, extra = getattr(factory, "requires", None) or (None, None)
    if module is not None and not _installed(module):
        raise LoggerError(
            f"logger={name} needs the {module} package, which is not installed: "
            f"pip install 'ftrain[{extra}]' (or drop {name} from logger=)"
        )
    _check_keys(name, factory, entry)
    return factory


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (tensorboard, wandb are slow)."""
    if module in sys.modules:
        return sys.modules[module] is not None  # None: import blocked
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _check_keys(name: str, factory, entry: dict) -> None:
    """Refuse keys the logger's constructor does not take (a typo must not pass silently)."""
    kwargs = {k: v for k, v in entry.items() if not k.startswith("_")}
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable: let the call tell
        return
    takes = [p for p in signature.parameters if p != "run"]
    try:
        signature.bind(run=None, **kwargs)
    except TypeError as err:
        unknown = [k for k in kwargs if k not in signature.parameters]
        what = (
            f"unknown key(s) {', '.join(f'logger.{name}.{k}' for k in unknown)}"
            if unknown
            else str(err)
        )
        raise LoggerError(
            f"{what}: {getattr(factory, '__name__', factory)} takes {takes} (and run=, passed "
            "by ftrain); fix the spelling"
        ) from None


def check_loggers(node) -> None:
    """Refuse, before anything is built, a ``logger`` entry that cannot start.

    Run on every rank (only the coordinator builds loggers, but all ranks must agree to
    exit before training starts).

    Raises:
        LoggerError: a missing extra (naming ``pip install 'ftrain[EXTRA]'``), a target that
            does not import, or a key its class does not take.
    """
    for name, entry in _entries(node).items():
        _resolve(name, entry)


def build_loggers(node, run: RunInfo) -> LoggerSet:
    """Instantiate every ``_target_`` entry of the ``logger`` node with ``run=run``.

    Raises:
        LoggerError: as :func:`check_loggers`, or a logger's constructor failed.

    Example:
        >>> loggers = build_loggers({"csv": {"_target_": "ftrain.metrics.loggers.CsvLogger",
        ...     "path": "/tmp/ftrain-doctest.csv"}}, RunInfo(Path("/tmp"), "doc"))
        >>> loggers.names
        ['csv']
        >>> loggers.close()
    """
    from hydra.utils import instantiate

    built: dict[str, Logger] = {}
    try:
        for name, entry in _entries(node).items():
            _resolve(name, entry)
            factory = instantiate(entry, _partial_=True, _convert_="all")
            try:
                built[name] = factory(run=run)
            except LoggerError:
                raise
            except Exception as err:
                raise LoggerError(f"logger.{name} could not start: {err}") from None
    except BaseException:
        LoggerSet(built).close()
        raise
    return LoggerSet(built)


# a logger's sys.exit() is its failure, not the end of training; so is a KeyboardInterrupt
# while a StopFlag takes SIGINT (a person's Ctrl-C then never reaches a logger as one)
_LOGGER_FAILURES = (Exception, SystemExit, KeyboardInterrupt)


def _own_failure(err: BaseException) -> bool:
    if not isinstance(err, KeyboardInterrupt):
        return True
    handler = signal.getsignal(signal.SIGINT)
    return isinstance(getattr(handler, "__self__", None), StopFlag)


class LoggerSet:
    """Fans records out to the built loggers; one that fails is warned about and dropped."""

    def __init__(self, loggers: Mapping[str, Logger] | None = None) -> None:
        self.loggers = dict(loggers or {})

    @property
    def names(self) -> list[str]:
        return list(self.loggers)

    def log_metrics(self, kind: str, step: int, fields: Mapping[str, Any]) -> None:
        values = _numeric(fields)
        if not values:
            return
        for name, logger in list(self.loggers.items()):
            try:  # a copy each: a logger that edits its values cannot change the next one's
                logger.log_metrics(kind, step, dict(values))
            except _LOGGER_FAILURES as err:  # advisory, like metrics.jsonl: training goes on
                if not _own_failure(err):
                    raise  # a library loop's Ctrl-C: the person wants to stop
                log.warning(
                    "ftrain: logger %s failed (%s); it is dropped, training goes on",
                    name,
                    _short(err),
                )
                self.loggers.pop(name)
                with contextlib.suppress(Exception):
                    logger.close()

    def close(self, timeout_s: float | None = None) -> None:
        """Close every logger; with ``timeout_s``, each close runs on a daemon thread and
        one that has not returned by then is left behind with a warning: a close stuck
        flushing (``wandb.finish()`` on a dead network) kept a finished run's process
        alive for good, after its last commit, with no exit status for a supervisor."""
        for name, logger in self.loggers.items():
            if timeout_s is None:
                _close_one(name, logger)
                continue
            closing = threading.Thread(
                target=_close_one, args=(name, logger), name=f"ftrain-close-{name}", daemon=True
            )
            closing.start()
            closing.join(timeout_s)
            if closing.is_alive():
                log.warning(
                    "ftrain: logger %s did not close within %gs; left behind (its last "
                    "records may be missing there; metrics.jsonl has them all)",
                    name,
                    timeout_s,
                )
        self.loggers = {}


def _close_one(name: str, logger: Logger) -> None:
    try:
        logger.close()
    except _LOGGER_FAILURES as err:
        log.warning("ftrain: logger %s did not close cleanly (%r)", name, err)


_NOT_METRICS = ("step", "time", "kind")


def replayed_values(record: Mapping[str, Any]) -> dict[str, float]:
    """The values a logger was given for a ``metrics.jsonl`` record: its numbers, with the
    text the file holds for a non-finite one (``"nan"``) read back as that number."""
    from ftrain.metrics.jsonl import nonfinite_value

    back = {k: nonfinite_value(v) for k, v in record.items() if nonfinite_value(v) is not None}
    return _numeric({**record, **back})


def _numeric(fields: Mapping[str, Any]) -> dict[str, float]:
    """The record's numbers (ints stay ints: ``samples``, ``tokens``), not step/time/kind."""
    return {
        k: v
        for k, v in fields.items()
        if k not in _NOT_METRICS and isinstance(v, int | float) and not isinstance(v, bool)
    }


def _short(err: BaseException) -> str:
    """An error in one short line: a ``UnicodeDecodeError``'s repr holds the whole file it
    decoded (a 2,400-character warning for a 2 KB CSV)."""
    text = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {text[:200]}{'...' if len(text) > 200 else ''}"
