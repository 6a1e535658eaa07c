"""The logger= group: TensorBoard, CSV and wandb files parsed back; errors before training."""

import csv
import glob
import json
import logging
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftrain.config import load_config
from ftrain.metrics import LoggerError, LoggerSet, RunInfo, build_loggers, check_loggers
from ftrain.metrics import loggers as loggers_mod
from ftrain.signals import StopFlag

TB = {"_target_": "ftrain.metrics.loggers.TensorBoardLogger"}
CSV = {"_target_": "ftrain.metrics.loggers.CsvLogger"}
WANDB = {"_target_": "ftrain.metrics.loggers.WandbLogger", "project": "ftrain-test"}


def _log(loggers: LoggerSet, losses: dict[int, float], val: dict[int, float] = None) -> None:
    for step, loss in losses.items():
        loggers.log_metrics("step", step, {"step": step, "time": 1.0, "loss": loss, "lr": 1e-3})
        if val and step in val:
            loggers.log_metrics("eval", step, {"step": step, "val_loss": val[step]})


def _scalars(log_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    events = acc.Scalars(tag)
    assert len({e.step for e in events}) == len(events), f"a step of {tag} shows twice"
    return {e.step: e.value for e in events}


def test_group_composes_one_or_several_loggers_and_jsonl_is_the_default():
    assert dict(load_config([]).logger) == {"jsonl": {}}
    several = load_config(["logger=[jsonl,tensorboard,csv]", "run.dir=/r"]).logger
    assert list(several) == ["jsonl", "tensorboard", "csv"]
    assert several.tensorboard.log_dir == "/r/tensorboard" and several.csv.path == "/r/metrics.csv"
    assert load_config(["logger=wandb", "run.name=x"]).logger.wandb.name == "x"


def test_tensorboard_event_files_hold_the_logged_values_and_a_resume_purges_redone_steps(
    tmp_path,
):
    pytest.importorskip("tensorboard", reason="pip install 'ftrain[tensorboard]'")
    first = build_loggers({"tensorboard": TB}, RunInfo(tmp_path, "r"))
    _log(first, {1: 4.0, 2: 3.5, 3: 3.25, 4: 3.0, 5: 2.75}, val={4: 3.1})
    first.close()
    # a start that ended before its first record (it wrote no record of itself): no purge
    build_loggers({"tensorboard": TB}, RunInfo(tmp_path, "r", start_step=1, resumed=True)).close()
    assert _scalars(tmp_path / "tensorboard", "train/loss")[5] == pytest.approx(2.75)
    # a crash after step 5 with step 3 committed: steps 4..5 are redone with other values
    again = build_loggers({"tensorboard": TB}, RunInfo(tmp_path, "r", start_step=3, resumed=True))
    _log(again, {4: 2.9, 5: 2.8, 6: 2.7})
    again.close()
    log_dir = tmp_path / "tensorboard"
    # TensorBoard stores float32: compare at that precision
    assert _scalars(log_dir, "train/loss") == pytest.approx(
        {1: 4.0, 2: 3.5, 3: 3.25, 4: 2.9, 5: 2.8, 6: 2.7}, rel=1e-6
    )
    assert _scalars(log_dir, "train/lr")[6] == pytest.approx(1e-3)
    assert _scalars(log_dir, "val/loss") == {}, "val at step 4 was purged with the redo"


def test_csv_parses_back_widens_for_val_loss_and_drops_the_redone_rows_on_resume(tmp_path):
    first = build_loggers({"csv": CSV}, RunInfo(tmp_path, "r"))
    _log(first, {1: 4.0, 2: 3.5}, val={2: 3.6})
    first.close()
    resumed = RunInfo(tmp_path, "r", start_step=1, resumed=True)
    build_loggers({"csv": CSV}, resumed).close()  # a start that ended before its first record
    assert len(_csv_rows(tmp_path / "metrics.csv")) == 3, "it wrote no record: nothing dropped"
    again = build_loggers({"csv": CSV}, resumed)
    _log(again, {2: 3.4})
    again.close()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[:3] == ["step", "time", "kind"]
    assert [(r["step"], r["kind"], r["loss"], r["val_loss"]) for r in rows] == [
        ("1", "step", "4.0", ""),
        ("2", "step", "3.4", ""),  # the redone step: its first attempt's rows are gone
    ]


def _history(run_dir: Path, *parts: list[dict]) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        for part in parts:
            for record in part:
                f.write(json.dumps({"time": 1.0, **record}) + "\n")


def _steps(a: int, b: int, loss) -> list[dict]:
    return [{"kind": "step", "step": s, "loss": loss(s), "lr": 1e-3} for s in range(a, b + 1)]


def test_a_go_back_killed_before_its_first_save_leaves_tensorboard_and_csv_the_committed_history(
    tmp_path,
):
    """``resume=10`` killed at step 15 before it saved, then a plain re-run: it resumes
    step 30 (the go-back abandoned nothing), but the go-back's TensorBoard file had purged
    steps 11..30 and its steps 11..15 stood in for them (CSV: their rows counted)."""
    pytest.importorskip("tensorboard", reason="pip install 'ftrain[tensorboard]'")
    from ftrain.metrics.history import forget_history, replay_for

    both = {"tensorboard": TB, "csv": CSV}
    first = build_loggers(both, RunInfo(tmp_path, "r"))
    _log(first, {s: 100.0 + s for s in range(1, 31)})
    first.close()
    back = build_loggers(both, RunInfo(tmp_path, "r", start_step=10, resumed=True))
    _log(back, {s: 200.0 + s for s in range(11, 16)})  # killed here: no save began
    back.close()
    commits = [{"kind": "committed", "step": s} for s in (10, 20, 30)]
    _history(
        tmp_path,
        [{"kind": "start", "step": 0, "from_step": None}], _steps(1, 30, lambda s: 100.0 + s),
        commits, [{"kind": "resume", "step": 10, "from_step": 10, "reason": "resume=10"}],
        _steps(11, 15, lambda s: 200.0 + s),
    )  # fmt: skip
    forget_history()
    replay_from, replay = replay_for(tmp_path, 30)
    assert replay_from == 10 and [r["step"] for r in replay] == list(range(11, 31))
    again = RunInfo(tmp_path, "r", start_step=30, resumed=True, replay_from=10, replay=replay)
    resumed = build_loggers(both, again)
    _log(resumed, {31: 131.0})
    resumed.close()
    want = {s: 100.0 + s for s in range(1, 32)}
    assert _scalars(tmp_path / "tensorboard", "train/loss") == pytest.approx(want, rel=1e-6)
    rows = _csv_rows(tmp_path / "metrics.csv")
    assert [(int(r[0]), float(r[2])) for r in rows] == list(want.items()), "one row a step"
    _history(
        tmp_path,
        [{"kind": "resume", "step": 30, "from_step": 30, "reason": "resume=latest"}],
        _steps(31, 31, lambda s: 131.0),
    )
    forget_history()
    assert replay_for(tmp_path, 31) == (31, []), "made good by the start after it"


def test_an_abandoned_go_back_stays_owed_until_a_start_logs():
    """A start that logged nothing (stopped during start-up, a finished run re-run: no
    loggers) was taken to have written the history again, and the replay was never made."""
    from ftrain.metrics.history import _abandoned_from

    back = [
        {"kind": "start", "from_step": None}, *_steps(1, 30, float),
        {"kind": "resume", "from_step": 10, "reason": "resume=10"}, *_steps(11, 15, float),
    ]  # fmt: skip
    quiet = {"kind": "resume", "from_step": 30, "reason": "resume=latest"}
    assert _abandoned_from([*back, quiet]) == 10
    assert _abandoned_from([*back, quiet, {"kind": "end", "step": 30}, quiet]) == 10
    assert _abandoned_from([*back, quiet, *_steps(31, 31, float)]) is None


def test_a_replayed_non_finite_value_keeps_its_value():
    from ftrain.metrics.loggers import replayed_values

    values = replayed_values({"kind": "step", "step": 3, "time": 1.0, "loss": "nan", "lr": 1e-3})
    assert values.keys() == {"loss", "lr"} and values["loss"] != values["loss"]


def test_replay_follows_the_history_a_committed_go_back_began():
    """A go-back that saved began a new history: the old steps past it are not replayed;
    only the latest start's abandoned go-back span is, from the new history."""
    from ftrain.metrics.history import _abandoned_from, _line

    records = [
        {"kind": "start", "from_step": None}, *_steps(1, 30, float),
        {"kind": "resume", "from_step": 10, "reason": "resume=10"}, *_steps(11, 20, lambda s: -s),
        {"kind": "save_started", "step": 20},
        {"kind": "resume", "from_step": 15, "reason": "resume=15"}, *_steps(16, 17, lambda s: 0.5),
    ]  # fmt: skip
    assert _abandoned_from(records) == 15
    line = _line(records)
    assert [k[1] for k in line] == list(range(1, 21))
    assert [line[("step", s)]["loss"] for s in (10, 11, 20)] == [10.0, -11, -20]


def test_a_csv_removed_mid_run_begins_again_said_once(tmp_path, caplog):
    """rm metrics.csv during a run: every later row went into the unlinked file, with no
    word (metrics.jsonl begins a new file and says so)."""
    loggers = build_loggers({"csv": CSV}, RunInfo(tmp_path, "r"))
    _log(loggers, {1: 4.0, 2: 3.5})
    (tmp_path / "metrics.csv").unlink()
    with caplog.at_level(logging.WARNING, logger="ftrain.metrics.loggers"):
        _log(loggers, {3: 3.0, 4: 2.5})
    loggers.close()
    assert _csv_rows(tmp_path / "metrics.csv") == [
        ("3", "step", "3.0", None),
        ("4", "step", "2.5", None),
    ]
    assert (
        caplog.text.count("was removed or replaced during the run; a new one begins at step 3") == 1
    )


def _csv_rows(path: Path) -> list[tuple]:
    with open(path, newline="") as f:
        return [(r["step"], r["kind"], r["loss"], r.get("val_loss")) for r in csv.DictReader(f)]


def test_a_torn_csv_row_is_cut_not_glued_to_the_next_runs_first_row(tmp_path):
    """A kill (or full disk) mid-row: the resume appended after the torn row, gluing its
    first row onto it (21 cells under 11 columns; pandas refused the file), and the next
    header widening then failed and dropped the CSV logger for the rest of the run."""
    first = build_loggers({"csv": CSV}, RunInfo(tmp_path, "r"))
    _log(first, {1: 4.0, 2: 3.5})
    first.close()
    path = tmp_path / "metrics.csv"
    path.write_bytes(path.read_bytes() + b"3,1.0,step,3.2")  # torn: no newline
    again = build_loggers({"csv": CSV}, RunInfo(tmp_path, "r", start_step=2, resumed=True))
    _log(again, {3: 3.25}, val={3: 3.3})  # val_loss widens the header
    again.close()
    assert not path.with_suffix(".csv.tmp").exists()
    rows = _csv_rows(path)
    assert rows == [
        ("1", "step", "4.0", ""),
        ("2", "step", "3.5", ""),
        ("3", "step", "3.25", ""),
        ("3", "eval", "", "3.3"),
    ]


def test_an_empty_csv_left_by_a_start_that_logged_nothing_is_not_damaged(tmp_path, caplog):
    build_loggers({"csv": CSV}, RunInfo(tmp_path, "r")).close()  # ended before its first row
    with caplog.at_level(logging.WARNING):
        again = build_loggers({"csv": CSV}, RunInfo(tmp_path, "r"))
    _log(again, {1: 4.0})
    again.close()
    assert _csv_rows(tmp_path / "metrics.csv") == [("1", "step", "4.0", None)]
    assert not list(tmp_path.glob("metrics.csv.damaged-*")) and "CSV" not in caplog.text


_DAMAGE = {
    "not utf-8": b"step,ti\xff\xfe garbage\n1,2\n",
    "torn header": b"step,ti",
    # a bad byte in a row: the first new column's rewrite failed mid-run, the logger was
    # dropped with the whole file in a one-line warning
    "not utf-8 in a row": b"step,time,kind,loss\n1,2.0,step,\xff4.0\n",
    "a crash's NUL tail": b"step,time,kind,loss\n1,2.0,step,4.0\n\0\0\0\0\n",
}


@pytest.mark.parametrize("damage", list(_DAMAGE))
def test_a_damaged_csv_is_set_aside_and_never_blocks_a_restart(tmp_path, damage, caplog):
    """Bytes that are not UTF-8 in the header refused the restart, exit 2, with 8 KiB of
    the file in the message and no path: the CSV mirrors metrics.jsonl, so a damaged one
    is moved aside, said once, and a new one begins."""
    path = tmp_path / "metrics.csv"
    path.write_bytes(_DAMAGE[damage])
    with caplog.at_level(logging.WARNING):
        again = build_loggers({"csv": CSV}, RunInfo(tmp_path, "r", start_step=2, resumed=True))
    _log(again, {3: 3.25}, val={3: 3.3})  # val_loss widens the header: a rewrite
    again.close()
    assert _csv_rows(path) == [("3", "step", "3.25", ""), ("3", "eval", "", "3.3")]
    aside = list(tmp_path.glob("metrics.csv.damaged-*"))
    assert len(aside) == 1 and f"moved to {aside[0].name}" in caplog.text
    assert "dropped" not in caplog.text and max(map(len, caplog.messages)) < 400


@pytest.mark.parametrize(
    "place, expect",
    [
        ("a directory", "is a directory; point it at a file"),
        ("a data file", "not a metrics CSV of ftrain's"),
        ("binary bytes", "not a metrics CSV of ftrain's"),
    ],
)
def test_a_place_that_is_not_this_loggers_csv_is_refused_and_left_untouched(
    tmp_path, place, expect
):
    """A directory (run.dir, a data directory) or a user's own file at logger.csv.path was
    renamed ``*.damaged-*``: the run's directory stranded, a data file gone from its
    place. Only a CSV of this logger's is ever set aside; anything else is refused."""
    path = tmp_path / "target"
    if place == "a directory":
        path.mkdir()
        (path / "keep.txt").write_text("mine")
    else:
        path.write_bytes(b"\x00\x01\x02" if place == "binary bytes" else b"id,label\n1,cat\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    entry = {**CSV, "path": str(path)}
    with pytest.raises(LoggerError, match=re.escape(expect)) as err:
        build_loggers({"csv": entry}, RunInfo(tmp_path, "r"))
    assert f"logger.csv.path={path}" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing moved
    if place == "a data file":
        assert path.read_bytes() == b"id,label\n1,cat\n"


@pytest.mark.parametrize(
    "overrides, clash",
    [
        (["logger.csv.path=/r/metrics.jsonl"], "run.dir's metrics.jsonl"),
        (["logger.csv.path=/r/heartbeat.json"], "run.dir's heartbeat.json"),
        (["logger.csv.path=/r"], "run.dir=/r"),
        (["logger.csv.path=/"], "run.dir=/r"),
        (["logger.csv.path=/r/checkpoints/m.csv"], "checkpoint.dir=/r/checkpoints"),
        (["logger.csv.path=/r/checkpoints"], "checkpoint.dir=/r/checkpoints"),
        (["checkpoint.fallback_dir=/fb", "logger.csv.path=/fb"], "checkpoint.fallback_dir=/fb"),
        (["logger.tensorboard.log_dir=/r/checkpoints/tb"], "checkpoint.dir=/r/checkpoints"),
        (["logger.csv.path=/r/tensorboard"], "logger.tensorboard.log_dir=/r/tensorboard"),
    ],
)
def test_a_logger_place_that_is_one_of_the_runs_own_is_refused_at_start(overrides, clash):
    from ftrain.cli.places import check_logger_places
    from ftrain.config import ConfigError

    base = ["run.dir=/r", "checkpoint.dir=/r/checkpoints", "logger=[jsonl,tensorboard,csv]"]
    cfg = load_config(base + overrides)
    with pytest.raises(ConfigError, match=re.escape(f"would write into {clash}")):
        check_logger_places(cfg)


def test_logger_places_of_their_own_pass():
    from ftrain.cli.places import check_logger_places

    check_logger_places(load_config(["run.dir=/r", "logger=[jsonl,tensorboard,csv,wandb]"]))
    check_logger_places(load_config(["run.dir=/r", "logger=csv", "logger.csv.path=/data/m.csv"]))


def test_a_logger_that_cannot_start_is_named_with_its_key_and_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    entry = {**CSV, "path": str(blocker / "metrics.csv")}  # its parent is a file
    with pytest.raises(LoggerError) as err:
        build_loggers({"csv": entry}, RunInfo(tmp_path, "r"))
    assert str(err.value).startswith("logger.csv could not start: ")
    assert str(blocker) in str(err.value)


def _wandb_records(path: str):
    """The records of a ``.wandb`` transaction log (LevelDB log format, wandb's framing)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    i, parts = 7, b""
    while i + 7 <= len(data):
        left = 32768 - i % 32768
        if left < 7:
            i += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[i : i + 7])
        if kind == 0 and length == 0:
            i += left  # zero padding to the end of a block
            continue
        chunk, i = data[i + 7 : i + 7 + length], i + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk  # FULL/FIRST start a record
        if kind in (1, 4):  # FULL or LAST ends it
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def _run_order(path: str):
    """``offline-run-DATE_TIME-ID[-N]``: wandb adds ``-N`` to a second run in the same second."""
    name = Path(path).parent.name
    m = re.fullmatch(r"offline-run-(\d{8}_\d{6})-[a-z0-9]+(?:-(\d+))?", name)
    return m.group(1), int(m.group(2) or 0)


def _finished_log(path: str, timeout: float = 60.0) -> list:
    """The records of a run's log once its ``exit`` record is in (``finish()`` returns
    while wandb's service may still be writing the offline log)."""
    deadline = time.time() + timeout
    while True:
        records = list(_wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.time() > deadline:
            return records
        time.sleep(0.1)


def _wandb_history(root: Path) -> list[dict]:
    rows = []
    paths = glob.glob(str(root / "wandb" / "offline-run-*" / "run-*.wandb"))
    for path in sorted(paths, key=_run_order):
        for r in _finished_log(path):
            if r.WhichOneof("record_type") == "history":
                items = r.history.item
                rows.append(
                    {("/".join(i.nested_key) or i.key): json.loads(i.value_json) for i in items}
                )
    return rows


def test_wandb_offline_run_holds_the_values_and_a_resume_continues_the_same_run(
    tmp_path, monkeypatch
):
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'ftrain[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = build_loggers({"wandb": WANDB}, RunInfo(tmp_path, "r", config={"a": 1}))
    _log(first, {1: 4.0, 2: 3.5}, val={2: 3.6})
    first.close()
    again = build_loggers({"wandb": WANDB}, RunInfo(tmp_path, "r", start_step=1, resumed=True))
    _log(again, {2: 3.4})
    again.close()
    # Each run directory holds ``run-<id>.wandb``; the directory name may carry wandb's
    # ``-N`` suffix when both runs started in the same second, so it is not the id.
    logs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    run_id = (tmp_path / "wandb" / "ftrain-run-id").read_text().split()[0]
    ids = [Path(log).stem.removeprefix("run-") for log in logs]
    assert ids == [run_id, run_id], f"one run id, resumed: {logs}"
    rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in _wandb_history(tmp_path)]
    assert rows == [
        {"step": 1, "train/loss": 4.0, "train/lr": 1e-3},
        {"step": 2, "train/loss": 3.5, "train/lr": 1e-3},
        {"step": 2, "val/loss": 3.6},
        {"step": 2, "train/loss": 3.4, "train/lr": 1e-3},
    ]
    build_loggers({"wandb": WANDB}, RunInfo(tmp_path, "r")).close()  # a fresh start
    assert (tmp_path / "wandb" / "ftrain-run-id").read_text().split()[0] != run_id, "a new run"


def test_a_copied_run_directory_starts_its_own_wandb_run_and_a_moved_one_continues(
    tmp_path, monkeypatch, capsys
):
    """``cp -a runs/base runs/ext`` then resuming ext logged into base's W&B run: two
    histories interleaved in one run once both went on. A move keeps the directory's inode
    and its W&B run; an id file of an older ftrain (the id alone) is taken as before."""
    import shutil

    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'ftrain[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")

    def resume(run_dir):
        logger = build_loggers({"wandb": WANDB}, RunInfo(run_dir, "r", start_step=2, resumed=True))
        run_id = logger.loggers["wandb"].run.id
        logger.close()
        return run_id

    build_loggers({"wandb": WANDB}, RunInfo(tmp_path / "base", "r")).close()
    base_id = (tmp_path / "base" / "wandb" / "ftrain-run-id").read_text().split()[0]
    shutil.copytree(tmp_path / "base", tmp_path / "copy")
    capsys.readouterr()
    assert resume(tmp_path / "copy") != base_id
    said = capsys.readouterr().out
    assert f"is a copy of {(tmp_path / 'base').resolve()}" in said and base_id in said, said
    copy_id = (tmp_path / "copy" / "wandb" / "ftrain-run-id").read_text().split()[0]
    assert resume(tmp_path / "copy") == copy_id, "the copy's own run from then on"
    (tmp_path / "base").rename(tmp_path / "moved")
    assert resume(tmp_path / "moved") == base_id
    # the same path, another inode (restored onto another node, a FUSE mount): the same run
    shutil.copytree(tmp_path / "moved", tmp_path / "restore")
    shutil.rmtree(tmp_path / "moved")
    (tmp_path / "restore").rename(tmp_path / "moved")  # the copy's inode at the old path
    assert resume(tmp_path / "moved") == base_id
    (tmp_path / "moved" / "wandb" / "ftrain-run-id").write_text(f"{copy_id}\n")  # by hand
    assert resume(tmp_path / "moved") == copy_id
    assert "is a copy" not in capsys.readouterr().out


def test_two_runs_sharing_a_wandb_dir_each_resume_their_own_wandb_run(tmp_path, monkeypatch):
    """logger.wandb.dir=/shared for runs a and b: the id was kept in /shared, b's start
    replaced a's, and a's resume logged into b's W&B run. The id now lives in each run's
    own directory."""
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'ftrain[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    shared = {**WANDB, "dir": str(tmp_path / "shared")}
    ids = {}
    for name in ("a", "b"):
        build_loggers({"wandb": shared}, RunInfo(tmp_path / name, name)).close()
        ids[name] = (tmp_path / name / "wandb" / "ftrain-run-id").read_text().split()[0]
    assert ids["a"] != ids["b"]
    again = build_loggers(
        {"wandb": shared}, RunInfo(tmp_path / "a", "a", start_step=2, resumed=True)
    )
    assert again.loggers["wandb"].run.id == ids["a"]
    again.close()
    assert not (tmp_path / "shared" / "wandb" / "ftrain-run-id").exists()


def test_a_run_id_left_in_a_shared_wandb_dir_by_an_older_ftrain_is_named_not_taken(
    tmp_path, monkeypatch, capsys
):
    """Before the id moved into the run directory it lived under logger.wandb.dir, where
    another run may have replaced it: taking it could continue another run's W&B run. A
    resume says where it is and how to continue it, and starts a new W&B run."""
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'ftrain[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    shared = {**WANDB, "dir": str(tmp_path / "shared")}
    (tmp_path / "shared" / "wandb").mkdir(parents=True)
    (tmp_path / "shared" / "wandb" / "ftrain-run-id").write_text("0ld1d000\n")
    resumed = RunInfo(tmp_path / "a", "a", start_step=2, resumed=True)
    again = build_loggers({"wandb": shared}, resumed)
    assert again.loggers["wandb"].run.id != "0ld1d000"
    again.close()
    out = capsys.readouterr().out
    assert f"copy {tmp_path / 'shared' / 'wandb' / 'ftrain-run-id'} to " in out, out
    build_loggers({"wandb": shared}, resumed).close()  # its own id now: said no more
    assert "is not taken" not in capsys.readouterr().out


def test_wandb_unreachable_at_start_logs_offline_instead_of_refusing_the_run(
    tmp_path, monkeypatch, capsys
):
    """An outage of the W&B service at a (re)start was exit 2, "never restart" to a
    supervisor: a dashboard stopped a week-long run. Now the run logs offline and says how
    to upload it."""
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'ftrain[wandb]'")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # online is asked for ...
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # ... and nothing listens
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # wandb reads its environment once per process (at its first setup): an earlier test's
    # wandb run kept the default 90 s init timeout for this one (90 s of CI)
    import wandb

    wandb.teardown()
    loggers = build_loggers({"wandb": WANDB}, RunInfo(tmp_path, "r", start_step=1, resumed=True))
    _log(loggers, {2: 3.5})
    loggers.close()
    out = capsys.readouterr().out
    assert "wandb could not start online" in out and "wandb sync" in out
    rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in _wandb_history(tmp_path)]
    assert rows == [{"step": 2, "train/loss": 3.5, "train/lr": 1e-3}]


def test_wandb_without_an_api_key_goes_offline_instead_of_prompting(monkeypatch, tmp_path, capsys):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert loggers_mod._wandb_mode(None) == "offline"
    assert "logging offline" in capsys.readouterr().out
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert loggers_mod._wandb_mode(None) == "online"
    assert loggers_mod._wandb_mode("disabled") == "disabled"


def test_a_missing_extra_is_named_with_its_pip_command(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tensorboard", None)  # as if not installed
    with pytest.raises(LoggerError, match=r"pip install 'ftrain\[tensorboard\]'"):
        check_loggers(load_config(["logger=[jsonl,tensorboard]"]).logger)


def test_unknown_key_and_bad_target_are_refused_before_training():
    with pytest.raises(
        LoggerError, match=r"unknown key\(s\) logger.tensorboard.flush_sec: .*takes"
    ):
        check_loggers({"tensorboard": TB | {"flush_sec": 3}})
    with pytest.raises(LoggerError, match="logger.mine._target_='nope.Nope' cannot be imported"):
        check_loggers({"mine": {"_target_": "nope.Nope"}})
    with pytest.raises(LoggerError, match="logger.wandb.mode='sometimes'"):
        pytest.importorskip("wandb")
        build_loggers({"wandb": WANDB | {"mode": "sometimes"}}, RunInfo(Path("/tmp"), "r"))


_FAILURES = {
    "disk": lambda: OSError(28, "No space left on device"),
    "exit": lambda: SystemExit(7),  # a logger's own sys.exit() stopped training (exit 7)
    "interrupt": lambda: KeyboardInterrupt(),  # ... and its own KeyboardInterrupt (130)
}


class _Recorder:
    def __init__(self, *, run, fail_after=None, failure="disk", edits=False):
        self.run, self.fail_after, self.seen, self.closed = run, fail_after, [], False
        self.failure, self.edits = failure, edits

    def log_metrics(self, kind, step, values):
        if self.fail_after is not None and step > self.fail_after:
            raise _FAILURES[self.failure]()
        self.seen.append((kind, step, dict(values)))
        if self.edits:  # a logger that edits what it was given (renames, pops)
            values.clear()

    def close(self):
        self.closed = True


@pytest.mark.parametrize("failure", sorted(_FAILURES))
def test_a_users_own_target_gets_the_run_and_numbers_only_and_a_failing_one_is_dropped(
    tmp_path, caplog, failure
):
    target = f"{__name__}._Recorder"
    flaky = {"_target_": target, "fail_after": 1, "failure": failure, "edits": True}
    built = build_loggers(
        {"flaky": flaky, "mine": {"_target_": target}},
        RunInfo(tmp_path, "r", start_step=7, resumed=True),
    )
    mine, flaky = built.loggers["mine"], built.loggers["flaky"]
    assert mine.run.start_step == 7 and mine.run.resumed
    # as in the CLI's loop: SIGINT is a stop request, so a KeyboardInterrupt is the logger's
    with caplog.at_level(logging.WARNING, logger="ftrain.metrics.loggers"), StopFlag():
        for step in (1, 2, 3):
            built.log_metrics("step", step, {"step": step, "time": 0.5, "loss": 1.5, "ok": True})
    assert mine.seen[0] == ("step", 1, {"loss": 1.5}), "step/time/bools are not metrics"
    assert len(mine.seen) == 3 and built.names == ["mine"] and flaky.closed
    assert caplog.text.count("logger flaky failed") == 1 and "training goes on" in caplog.text


def test_a_ctrl_c_in_a_library_loops_logger_is_not_swallowed(tmp_path):
    """Without a StopFlag taking SIGINT (a loop of the user's own), a KeyboardInterrupt in
    a slow log call is the person's Ctrl-C: the logger was dropped and training went on."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)  # a plain process's (put back)
    built = build_loggers(
        {"slow": {"_target_": f"{__name__}._Recorder", "fail_after": 0, "failure": "interrupt"}},
        RunInfo(tmp_path, "r"),
    )
    with pytest.raises(KeyboardInterrupt):
        built.log_metrics("step", 1, {"loss": 1.0})
    assert built.names == ["slow"]


class _StuckClose:
    def __init__(self, release):
        self.release, self.closed = release, False

    def log_metrics(self, kind, step, values):
        pass

    def close(self):
        self.release.wait(30)  # wandb.finish() on a dead network
        self.closed = True


class _Closes(_StuckClose):
    def close(self):
        self.closed = True


def test_a_logger_whose_close_hangs_is_left_behind_after_the_timeout(caplog):
    """A close stuck flushing kept a finished run's process alive with no exit status,
    after its last commit; the hang watchdog does not cover the end."""
    import threading
    import time

    release = threading.Event()
    stuck, fine = _StuckClose(release), _Closes(release)
    loggers = LoggerSet({"stuck": stuck, "fine": fine})
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ftrain.metrics.loggers"):
        loggers.close(timeout_s=0.3)
    assert time.monotonic() - t0 < 5 and fine.closed and not stuck.closed
    assert "logger stuck did not close within 0.3s; left behind" in caplog.text
    assert loggers.names == []
    release.set()


@pytest.mark.parametrize("flush", ["abc", -1, 0, True])
def test_a_bad_tensorboard_flush_interval_is_one_clear_error(tmp_path, flush):
    """flush_secs=abc failed inside tensorboard's own thread (a traceback after ftrain's
    message); -1 was accepted."""
    pytest.importorskip("tensorboard")
    with pytest.raises(LoggerError, match=f"flush_secs={flush!r} is invalid"):
        build_loggers({"tensorboard": {**TB, "flush_secs": flush}}, RunInfo(tmp_path, "r"))


TB_FULL_DISK = """
import sys
from pathlib import Path
from ftrain.metrics import RunInfo, build_loggers

target = {"_target_": "ftrain.metrics.loggers.TensorBoardLogger", "flush_secs": 0.05}
loggers = build_loggers({"tensorboard": target}, RunInfo(Path(sys.argv[1]), "r"))
events = loggers.loggers["tensorboard"].writer._get_file_writer().event_writer._async_writer


def full(data):
    raise OSError(27, "File too large")


events._writer.write = full  # the record writer of the event file: the disk is full
loggers.log_metrics("step", 1, {"loss": 4.0})
events._worker.join(10)  # the writer thread failed and ended
loggers.log_metrics("step", 2, {"loss": 3.0})
print("left:", loggers.names)
"""


def test_a_tensorboard_writer_that_fails_is_dropped_in_one_line_not_a_traceback(tmp_path):
    """A full disk (or its log_dir removed) failed tensorboard's writer thread, which
    printed ~15 lines of thread traceback before ftrain's one-line warning."""
    pytest.importorskip("tensorboard")
    proc = subprocess.run(
        [sys.executable, "-c", TB_FULL_DISK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "left: []" in proc.stdout, proc.stdout + proc.stderr
    assert "logger tensorboard failed" in proc.stderr and "File too large" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_a_single_wandb_tag_is_one_tag_not_its_letters(tmp_path, monkeypatch):
    """logger.wandb.tags=foo ran with the tags f, o, o."""
    wandb = pytest.importorskip("wandb")
    seen = {}

    class _Run:
        def define_metric(self, *a, **k):
            pass

        def finish(self):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kw: seen.update(kw) or _Run())
    build_loggers({"wandb": {**WANDB, "tags": "foo"}}, RunInfo(tmp_path, "r")).close()
    assert seen["tags"] == ["foo"]
    # numbers were an 8-line pydantic dump ("2 validation errors for Settings ...")
    with pytest.raises(
        LoggerError, match=r"logger.wandb.tags=\[1, 2\] is invalid: tags are strings"
    ):
        build_loggers({"wandb": {**WANDB, "tags": [1, 2]}}, RunInfo(tmp_path, "r"))


def test_a_failing_logger_is_named_in_one_short_line(caplog):
    """A UnicodeDecodeError's repr holds every byte it decoded: the warning of a dropped
    logger was as long as the file (2,434 characters for a 2 KB CSV)."""

    class Failing:
        def log_metrics(self, kind, step, values):
            raise UnicodeDecodeError("utf-8", b"x" * 5000, 7, 8, "invalid start byte")

        def close(self):
            pass

    loggers = LoggerSet({"bad": Failing()})
    with caplog.at_level(logging.WARNING):
        loggers.log_metrics("step", 1, {"loss": 1.0})
    (line,) = caplog.messages
    assert "logger bad failed (UnicodeDecodeError: 'utf-8' codec can't decode" in line
    assert len(line) < 300 and loggers.names == []


def test_a_fresh_restart_drops_the_first_attempts_rows(tmp_path):
    """A run killed before its first commit restarts fresh: the CSV kept the first
    attempt's rows and appended again (steps 1, 1, 2, 3)."""
    first = build_loggers({"csv": CSV}, RunInfo(tmp_path, "r"))
    _log(first, {1: 4.0, 2: 3.5})
    first.close()
    again = build_loggers({"csv": CSV}, RunInfo(tmp_path, "r"))
    _log(again, {1: 4.5, 2: 4.0, 3: 3.0})
    again.close()
    assert [r[:3] for r in _csv_rows(tmp_path / "metrics.csv")] == [
        ("1", "step", "4.5"),
        ("2", "step", "4.0"),
        ("3", "step", "3.0"),
    ]
