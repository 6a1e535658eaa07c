"""The hang watchdog (ftrain.watchdog) with train_loop and a data source that blocks."""

import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import ftrain
from ftrain.config import ConfigError, load_config
from ftrain.loop import train_loop
from ftrain.signals import EXIT_HUNG
from ftrain.watchdog import Watchdog, dump_stacks
from tests.unit.test_loop import adamw_setup


def _setup():
    model = torch.nn.Linear(2, 1)
    tx = ftrain.optim.sgd(0.1)
    step = ftrain.make_step(model, lambda m, b: m(b["x"]).pow(2).mean(), tx)
    return ftrain.init_state(model, tx, seed=0), step


def block_until(release: threading.Event) -> None:
    """The frame a stack dump must name: a data source waiting on something that never comes."""
    release.wait()
    raise StopIteration  # released by the test after the watchdog fired


def _hanging_batches(n: int, release: threading.Event):
    for _ in range(n):
        yield {"x": torch.ones(4, 2)}
    block_until(release)


class Fired:
    """Stands in for os._exit: remembers the code, then lets the blocked loop go."""

    def __init__(self, release: threading.Event) -> None:
        self.release, self.codes = release, []

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.release.set()


def _run(tmp_path, n=2, *, donate=False, save=None, step=None, **wd_kwargs):
    state, default_step = _setup()
    step = step or default_step
    release = threading.Event()
    fired, saves, hangs = Fired(release), [], []
    wd = Watchdog(
        wd_kwargs.pop("timeout_s", 0.3),
        run_dir=tmp_path,
        save=save or (lambda s, m: saves.append((int(s["step"]), dict(m))) or True),
        on_hang=hangs.append,
        exit=fired,
        **wd_kwargs,
    )
    t0 = time.monotonic()
    with pytest.raises((RuntimeError, StopIteration)):  # the released generator ends
        train_loop(state, step, _hanging_batches(n, release), max_steps=100, watchdog=wd)
    return wd, fired, saves, hangs, time.monotonic() - t0


def test_a_hang_dumps_stacks_saves_the_last_step_and_exits_hung(tmp_path):
    wd, fired, saves, hangs, _ = _run(tmp_path, n=3)
    assert fired.codes == [EXIT_HUNG] and wd.fired
    dump = wd.dump_path.read_text()
    assert wd.dump_path.parent == tmp_path and wd.dump_path.name.startswith("hang-")
    assert "block_until" in dump and "release.wait()" in dump, "the blocking frame is named"
    assert "at step 3, phase 'data'" in dump
    assert [s for s, _ in saves] == [3], "the last completed state, once"
    assert "loss" in saves[0][1], "saved with the metrics of that step"
    assert hangs[0]["step"] == 3 and hangs[0]["saved"] is True and hangs[0]["phase"] == "data"


def test_a_save_that_says_why_it_saved_nothing_is_named_in_the_exit_line(tmp_path, capfd):
    """A sharded run's hang save is skipped (one rank cannot gather the state); the exit
    line said "nothing trained since the run began ... or another rank writes it", none of
    which was true. A save callback returning a string says why, and the line shows it."""
    why = "the state is sharded over every rank and one rank cannot gather it"
    _, fired, _, hangs, _ = _run(tmp_path, n=3, save=lambda s, m: why)
    err = capfd.readouterr().err
    assert fired.codes == [EXIT_HUNG] and hangs[0]["saved"] is False
    assert hangs[0]["save_error"] == why
    assert f"ftrain: no final save ({why}); exiting with code 4" in err, err


def test_the_first_step_gets_its_own_larger_allowance(tmp_path):
    _, fired, saves, hangs, took = _run(tmp_path, n=0, timeout_s=0.2, first_timeout_s=1.0)
    assert fired.codes == [EXIT_HUNG] and took >= 1.0, "not before first_timeout_s"
    assert saves == [(0, {})] and hangs[0]["timeout_s"] == 1.0


def test_a_compile_mid_run_gets_the_first_step_allowance_not_a_hang(tmp_path):
    """A new layout compiled mid-run (a new batch shape) took tens of seconds: a watchdog
    sized for steps fired, exit 4, and every restart compiled and "hung" again."""
    from ftrain.watchdog import compile_started

    _, inner = _setup()

    def compiling_step(s, b):
        if int(s["step"]) == 2:
            compile_started()
            time.sleep(0.8)
        return inner(s, b)

    wd, fired, saves, hangs, _ = _run(
        tmp_path, n=4, timeout_s=0.2, first_timeout_s=2.0, step=compiling_step
    )
    assert fired.codes == [EXIT_HUNG] and hangs[0]["phase"] == "data"  # the real hang, later
    assert [s for s, _ in saves] == [4] and hangs[0]["timeout_s"] == 0.2


def test_no_save_while_a_donated_step_may_be_rewriting_the_state(tmp_path):
    state, step = _setup()
    release, saves = threading.Event(), []
    fired = Fired(release)
    wd = Watchdog(0.3, run_dir=tmp_path, save=lambda s, m: saves.append(s), exit=fired)

    def stuck_step(s, b):
        if int(s["step"]) == 2:
            block_until(release)
        return step(s, b)

    with pytest.raises(StopIteration):
        batches = _hanging_batches(10, threading.Event())
        train_loop(state, stuck_step, batches, max_steps=10, donate=True, watchdog=wd)
    assert fired.codes == [EXIT_HUNG] and saves == []
    assert "phase 'step'" in wd.dump_path.read_text()


def test_a_hung_save_is_not_joined_by_another_and_a_slow_final_save_is_bounded(tmp_path):
    release = threading.Event()
    fired = Fired(release)
    calls = []
    wd = Watchdog(0.2, run_dir=tmp_path, save=lambda s, m: calls.append(1), exit=fired)
    with wd:
        wd.phase("save", {"step": torch.tensor(5)}, {}, safe=True)
        wd.beat()
        assert release.wait(5)
    assert calls == [] and fired.codes == [EXIT_HUNG], "the main thread is inside a save"

    release.clear()
    wd = Watchdog(
        0.2,
        run_dir=tmp_path,
        save=lambda s, m: time.sleep(30),
        save_timeout_s=0.3,
        on_hang=calls.append,
        exit=Fired(release),
    )
    t0 = time.monotonic()
    with wd:
        wd.phase("data", {"step": torch.tensor(5)}, {}, safe=True)
        wd.beat()
        assert release.wait(5)
    assert time.monotonic() - t0 < 3
    assert calls[0]["saved"] is False and "did not finish within 0.3 s" in calls[0]["save_error"]


def test_a_loop_that_keeps_stepping_is_never_fired(tmp_path):
    state, step = _setup()
    fired = Fired(threading.Event())
    slow = (dict(x=torch.ones(4, 2)) for _ in iter(lambda: time.sleep(0.05) or True, False))
    # beats 0.05 s apart against a 1 s timeout (room for a busy machine's pauses), for
    # ~2 s in all: longer than the timeout, so only the beats keep it from firing
    wd = Watchdog(1.0, run_dir=tmp_path, exit=fired, first_timeout_s=10)
    result = train_loop(state, step, slow, max_steps=40, watchdog=wd)
    assert result.status == "finished" and fired.codes == [] and not wd.fired
    assert wd._thread is None, "stopped with the loop"


HANGING_SCRIPT = """
import sys, threading, torch, ftrain
from ftrain.loop import train_loop
from ftrain.watchdog import Watchdog

def block_forever():
    threading.Event().wait()

def batches():
    for _ in range(2):
        yield {"x": torch.ones(4, 2)}
    block_forever()

model = torch.nn.Linear(2, 1)
tx = ftrain.optim.sgd(0.1)
step = ftrain.make_step(model, lambda m, b: m(b["x"]).pow(2).mean(), tx)

def save(state, metrics):
    print("saved", int(state["step"]), flush=True)
    return True

wd = Watchdog(2.0, run_dir=sys.argv[1], save=save)  # no early fire on a busy machine
train_loop(ftrain.init_state(model, tx, seed=0), step, batches(), max_steps=10, watchdog=wd)
print("not reached", flush=True)
"""


def test_a_hung_process_exits_with_exit_hung_via_os_exit(tmp_path):
    script = tmp_path / "hanging.py"  # a file, so the dump can show its source lines
    script.write_text(HANGING_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == EXIT_HUNG == 4, proc.stdout + proc.stderr
    assert "saved 2" in proc.stdout and "not reached" not in proc.stdout
    assert "no progress for" in proc.stderr and "exiting with code 4" in proc.stderr
    (dump,) = tmp_path.glob("hang-*.txt")
    text = dump.read_text()
    assert "block_forever" in text and "threading.Event().wait()" in text
    assert "ftrain-watchdog" in text, "every thread is in the dump"


PAUSED_SCRIPT = """
import sys, time, torch, ftrain
from ftrain.loop import train_loop
from ftrain.watchdog import Watchdog

def batches():
    while True:
        time.sleep(0.05)
        print("step", flush=True)
        yield {"x": torch.ones(4, 2)}

model = torch.nn.Linear(2, 1)
tx = ftrain.optim.sgd(0.1)
step = ftrain.make_step(model, lambda m, b: m(b["x"]).pow(2).mean(), tx)
wd = Watchdog(1.0, run_dir=sys.argv[1], first_timeout_s=60.0)
train_loop(ftrain.init_state(model, tx, seed=0), step, batches(), max_steps=60, watchdog=wd)
print("finished", flush=True)
"""


def test_a_stopped_and_continued_process_is_not_a_hang(tmp_path):
    """SIGSTOP for 4x the timeout, then SIGCONT (Ctrl-Z then fg, scontrol suspend/resume):
    the watchdog's clock ran on while the process was stopped, and the run was called hung
    (exit 4) the moment it continued."""
    script = tmp_path / "paused.py"
    script.write_text(PAUSED_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    for _ in range(5):  # stepping, past the first step's allowance
        assert proc.stdout.readline() == "step\n"
    proc.send_signal(signal.SIGSTOP)
    time.sleep(4.0)
    proc.send_signal(signal.SIGCONT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "finished" in out and not list(tmp_path.glob("hang-*.txt"))


def test_dump_stacks_names_every_thread(tmp_path):
    gate = threading.Event()
    t = threading.Thread(target=gate.wait, name="parked-thread", daemon=True)
    t.start()
    try:
        text = dump_stacks(tmp_path / "d.txt", "header line").read_text()
    finally:
        gate.set()
    assert text.startswith("header line") and "parked-thread" in text and "MainThread" in text


def test_watchdog_rejects_a_non_positive_timeout(tmp_path):
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Watchdog(0, run_dir=tmp_path)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("trainer.hang_timeout_s=0", "trainer.hang_timeout_s must be > 0"),
        ("trainer.hang_timeout_s=-5", "trainer.hang_timeout_s must be > 0"),
        ("trainer.hang_timeout_s=0.001", "0.001 is shorter than a step can be timed"),
        ("trainer.on_nonfinite=ignore", "trainer.on_nonfinite must be stop, skip or continue"),
    ],
)
def test_config_rejects_bad_fault_settings(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config([override])


def test_config_rejects_skip_with_donate_and_takes_good_values():
    with pytest.raises(ConfigError, match="on_nonfinite=skip"):
        load_config(["trainer.on_nonfinite=skip", "trainer.donate=true"])
    cfg = load_config(["trainer.on_nonfinite=skip", "trainer.hang_timeout_s=30"])
    assert cfg.trainer.on_nonfinite == "skip" and cfg.trainer.hang_timeout_s == 30
    assert load_config([]).trainer.hang_timeout_s is None, "off by default"


def test_a_failing_dump_still_exits_hung(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # run_dir is a file: the dump cannot be written
    release = threading.Event()
    fired = Fired(release)
    with Watchdog(0.2, run_dir=blocker, exit=fired) as wd:
        wd.beat()
        assert release.wait(5)
    assert fired.codes == [EXIT_HUNG]


def test_a_loop_waking_up_during_the_hang_save_never_writes_the_saved_state(tmp_path):
    """The data source hangs, the watchdog saves (a slow synchronous save); the data comes
    back meanwhile and the loop runs a donated step: it must step out of place, the saved
    state's values unchanged from the first byte of the save to the last."""
    state, step = adamw_setup(donate=True)
    hung, stepped, release, seen = threading.Event(), threading.Event(), threading.Event(), {}

    def batches():
        for _ in range(3):
            yield {"x": torch.ones(4, 2)}
        hung.wait(timeout=60)  # until the watchdog's save has begun
        yield {"x": torch.ones(4, 2)}
        stepped.set()  # the loop asks for the next batch: a donated step ran
        release.wait(timeout=60)

    def save(state, metrics):
        seen["before"] = state.clone()
        hung.set()
        assert stepped.wait(timeout=60), "the loop did not step during the save"
        seen["after"] = state.clone()
        return True

    wd = Watchdog(0.5, run_dir=tmp_path, save=save, exit=lambda code: release.set())
    result = train_loop(state, step, batches(), max_steps=100, donate=True, watchdog=wd)
    assert result.status == "exhausted"  # the batches end after the one that woke it up
    assert int(seen["before"]["step"]) == 3
    assert ftrain.state.tree_equal(seen["before"], seen["after"]), "the saved state was written"


@pytest.mark.parametrize("kind", ["step", "heartbeat"])
def test_a_logger_hanging_after_a_donated_step_saves_that_step(tmp_path, kind):
    """The step returned and was checked; a logger's write then hangs (the step record, or
    the heartbeat after the policy save): the state is whole, so the watchdog saves it,
    even donated (it said phase 'step' or 'save' there before and saved nothing)."""
    model = torch.nn.Linear(2, 1)
    tx = ftrain.optim.sgd(0.1)
    step = ftrain.make_step(model, lambda m, b: m(b["x"]).pow(2).mean(), tx, donate=True)
    release, saves = threading.Event(), []
    fired = Fired(release)
    wd = Watchdog(0.3, run_dir=tmp_path, exit=fired, save=lambda s, m: saves.append(int(s["step"])) or True)  # fmt: skip

    def record(what, **fields):
        if what == kind and fields["step"] == 2:
            release.wait()
            raise RuntimeError("released")

    batches = iter(lambda: {"x": torch.ones(4, 2)}, None)
    state = ftrain.init_state(model, tx, seed=0)
    with pytest.raises(RuntimeError):
        train_loop(state, step, batches, max_steps=5, donate=True, record=record, watchdog=wd)
    assert fired.codes == [EXIT_HUNG] and saves == [2]


def test_an_allowance_until_the_next_beat_replaces_the_timeout(tmp_path):
    """The wait for the last commit gets the first step's allowance, not one blocking
    call's: no fire within it, a fire after it, and a beat returns to the timeout."""
    fired = Fired(threading.Event())
    wd = Watchdog(0.2, run_dir=tmp_path, exit=fired, first_timeout_s=1.0)
    wd.beat()
    wd.start(allowance_s=1.0)
    time.sleep(0.6)
    assert not wd.fired, "0.6 s is past the timeout, inside the allowance"
    wd.beat()  # back to the 0.2 s timeout
    time.sleep(0.9)
    assert wd.fired and fired.codes == [EXIT_HUNG]
    wd.stop()


def test_any_dynamo_compile_counts_as_a_compile_for_the_allowance():
    """Only the first compile of a layout told the watchdog; a recompile after a failed
    guard mid-run (tens of seconds on a large model) could be called a hang. Registering
    twice must not count a compile twice."""
    from ftrain import watchdog

    torch._dynamo.reset()
    watchdog.watch_dynamo_compiles()
    watchdog.watch_dynamo_compiles()
    before = watchdog._compiles[0]
    torch.compile(lambda x: x * 3, backend="eager")(torch.ones(2))
    assert watchdog._compiles[0] == before + 1


def test_a_dynamo_reset_does_not_lose_the_compile_allowance(tmp_path):
    """``torch._dynamo.reset()`` clears every compile callback (so does
    ``torch._dynamo.explain``: in CI a graph-break check ran first, and the compiles that
    followed went uncounted); a watchdog that starts registers the callback again."""
    from ftrain import watchdog

    torch._dynamo.reset()
    dog = watchdog.Watchdog(60, run_dir=tmp_path, save=None, drain=None).start()
    try:
        before = watchdog._compiles[0]
        torch.compile(lambda x: x * 5, backend="eager")(torch.ones(2))
        assert watchdog._compiles[0] > before
    finally:
        dog.stop()


@pytest.mark.parametrize("cpu_used,discounted", [(0.0, True), (9.0, False)])
def test_only_time_the_process_stood_still_is_not_counted(
    tmp_path, monkeypatch, cpu_used, discounted
):
    """A late poll with the CPU clock standing still: the process was stopped (SIGSTOP). A
    late poll while it burned CPU (a C call holding the GIL for seconds) is still time
    without progress: discounting it too would hide a hang for good."""
    import types

    from ftrain import watchdog as wd_mod

    wd = Watchdog(1.0, run_dir=tmp_path)
    wd._last = 100.0
    clock = types.SimpleNamespace(monotonic=lambda: 110.0, process_time=lambda: 5.0 + cpu_used)
    monkeypatch.setattr(wd_mod, "time", clock)
    assert wd._discount_unobserved((100.25, 5.0), 0.25) == (110.0, 5.0 + cpu_used)
    assert wd._last == (109.5 if discounted else 100.0)
