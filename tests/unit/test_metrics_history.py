"""read_history: the start-up checks' records, parsed once per process and then only what
was appended (a long run's metrics.jsonl was read four times at every restart)."""

from __future__ import annotations

import json
import logging
import os

import pytest

from ftrain.metrics import history, read_records
from ftrain.metrics.history import STEP_RUN, read_history


def _line(kind: str, step: int | None, **extra) -> bytes:
    return json.dumps({"kind": kind, "step": step, "time": 1.0, **extra}).encode() + b"\n"


def _write(path, *lines: bytes, mode: str = "ab") -> None:
    with open(path / "metrics.jsonl", mode) as f:
        f.write(b"".join(lines))


def _flat(records: list[dict]) -> list[tuple]:
    """(kind, step) per original record: a step run expanded back into its steps."""
    out = []
    for r in records:
        if r["kind"] == STEP_RUN:
            out += [("step", s) for s in r["steps"]]
        else:
            out.append((r["kind"], r.get("step")))
    return out


@pytest.fixture
def parses(monkeypatch):
    """The number of lines parsed so far (each parse of a line counted once)."""
    count = [0]
    real = history.parse_line

    def counting(raw):
        count[0] += 1
        return real(raw)

    monkeypatch.setattr(history, "parse_line", counting)
    return count


def test_it_holds_what_read_records_yields_with_step_runs_compacted(tmp_path):
    _write(
        tmp_path,
        _line("start", 0, from_step=0),
        *(_line("step", s, loss=1.0) for s in range(1, 6)),
        _line("save_started", 5),
        _line("committed", 5),
        *(_line("step", s) for s in range(6, 9)),
        _line("step", None),  # no step number: names no step reached
        b"\xff\n",
    )
    records = read_history(tmp_path)
    kinds = [r["kind"] for r in records]
    assert kinds == ["start", STEP_RUN, "save_started", "committed", STEP_RUN]
    assert list(records[1]["steps"]) == [1, 2, 3, 4, 5]
    expected = [(r["kind"], r.get("step")) for r in read_records(tmp_path)]
    assert _flat(records) == [e for e in expected if e != ("step", None)]


def test_a_second_read_parses_only_what_was_appended(tmp_path, parses):
    _write(tmp_path, *(_line("step", s) for s in range(1, 101)))
    first = read_history(tmp_path)
    assert parses[0] == 100
    assert read_history(tmp_path) is first and parses[0] == 100  # unchanged: no parse
    _write(tmp_path, _line("committed", 100), _line("step", 101))
    again = read_history(tmp_path)
    assert parses[0] == 102
    assert _flat(again)[-3:] == [("step", 100), ("committed", 100), ("step", 101)]


@pytest.mark.parametrize("change", ["replaced", "truncated", "rewritten in place"])
def test_a_file_changed_other_than_by_appending_is_read_again_whole(tmp_path, parses, change):
    _write(tmp_path, _line("committed", 2), _line("committed", 4))
    assert [r["step"] for r in read_history(tmp_path)] == [2, 4]
    path = tmp_path / "metrics.jsonl"
    if change == "replaced":  # run.overwrite moves the old records aside
        os.replace(path, tmp_path / "old.jsonl")
        _write(tmp_path, _line("committed", 6), _line("committed", 8))
    elif change == "truncated":
        _write(tmp_path, _line("committed", 6), mode="wb")
    else:  # the same length, other bytes, same inode
        data = path.read_bytes()
        with open(path, "r+b") as f:
            f.write(data.replace(b'"step": 4', b'"step": 8'))
    expected = {"replaced": [6, 8], "truncated": [6], "rewritten in place": [2, 8]}[change]
    assert [r["step"] for r in read_history(tmp_path)] == expected


def test_an_unterminated_last_line_counts_once_and_is_read_again_when_finished(tmp_path):
    _write(tmp_path, _line("committed", 2), _line("committed", 4)[:-1])  # no newline yet
    assert [r["step"] for r in read_history(tmp_path)] == [2, 4]
    _write(tmp_path, b"\n", _line("committed", 6))
    assert [r["step"] for r in read_history(tmp_path)] == [2, 4, 6]
    _write(tmp_path, _line("committed", 8)[:20])  # a torn line of a killed writer
    assert [r["step"] for r in read_history(tmp_path)] == [2, 4, 6]


def test_forgotten_history_is_parsed_again(tmp_path, parses):
    from ftrain.metrics.history import forget_history

    _write(tmp_path, _line("committed", 2))
    read_history(tmp_path)
    forget_history()
    assert [r["step"] for r in read_history(tmp_path)] == [2] and parses[0] == 2


def test_bad_lines_are_warned_about_once_per_parse(tmp_path, caplog):
    _write(tmp_path, _line("committed", 2), b"not json\n", b"[1]\n", _line("committed", 4))
    with caplog.at_level(logging.WARNING):
        read_history(tmp_path)
        read_history(tmp_path)
    assert caplog.text.count("skipped 2 unreadable or malformed lines (first: line 2)") == 1


def test_a_missing_or_unreadable_file_gives_no_records(tmp_path, caplog):
    assert read_history(tmp_path) == []
    _write(tmp_path, _line("committed", 2))
    assert len(read_history(tmp_path)) == 1
    (tmp_path / "metrics.jsonl").unlink()
    assert read_history(tmp_path) == []
    (tmp_path / "metrics.jsonl").mkdir()
    with caplog.at_level(logging.WARNING):
        assert read_history(tmp_path) == []
    assert "cannot read" in caplog.text


def test_the_start_up_questions_parse_each_line_once(tmp_path, parses):
    """The resume check, the redo report, the last-run and owed-eval checks and the torchrun
    restart checks all read the records: a long run's file is parsed once, not once each."""
    from ftrain.cli.basestep import earlier_init_step
    from ftrain.cli.redo import eval_owed, last_run_ended, recorded_commits, redo_range
    from ftrain.cli.restarts import committed_since_going_back, started_fresh

    lines = [_line("start", 0, from_step=0), *(_line("step", s) for s in range(1, 201))]
    _write(tmp_path, *lines, _line("committed", 200), _line("end", 200))
    assert recorded_commits(tmp_path) == [200]
    assert redo_range(tmp_path, 100) == (101, 200)
    assert last_run_ended(tmp_path) and not eval_owed(tmp_path, 200)
    assert committed_since_going_back(tmp_path, 100, "job") == []
    assert not started_fresh(tmp_path, "job") and earlier_init_step(tmp_path, "x") is None
    assert parses[0] == len(lines) + 2


def test_a_step_past_int64_is_a_malformed_line_not_a_failed_start(tmp_path, caplog):
    """JSON integers have no bound: a 20-digit step raised OverflowError from the array of
    step numbers, and every start of that run stopped with a traceback."""
    from ftrain.cli.redo import redo_range

    huge = 99999999999999999999
    _write(tmp_path, _line("step", 1), _line("step", huge), _line("committed", huge))
    (tmp_path / "heartbeat.json").write_text(json.dumps({"step": huge, "time": 2.0}))
    with caplog.at_level(logging.WARNING):
        assert _flat(read_history(tmp_path)) == [("step", 1)]
        assert redo_range(tmp_path, 0) == (1, 1)
    assert "skipped 2 unreadable or malformed lines" in caplog.text
