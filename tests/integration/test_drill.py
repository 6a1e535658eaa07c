"""``python -m ftrain.drill``: the fault drill end to end under real torchrun (2 ranks)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest


def _drill(*args, timeout=1500, env=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    cmd = [sys.executable, "-m", "ftrain.drill", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow
@pytest.mark.long  # ~80 s; CI runs the machine-death scenario below
def test_the_drill_passes_every_scenario_bit_exact(tmp_path):
    proc = _drill(f"drill.dir={tmp_path / 'drill'}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for name in (
        "reference",
        "machine",
        "kill",
        "kill_during_save",
        "corrupt_newest",
        "world_size",
    ):
        assert f"PASS {name}" in out, out
    # the kill lands at the first step >= 6 the poller sees (7 on a busy machine): the
    # count must be the kill step's distance from the commit, whatever it was
    m = re.search(
        r"SIGKILLed at step (\d+), restarted, resumed from 4 on every rank, step 5 same "
        r"batch and lr, (\d+) step\(s\) redone",
        out,
    )
    assert m and int(m.group(1)) >= 6 and int(m.group(2)) == int(m.group(1)) - 4, out
    assert out.strip().endswith("verdict: PASS")


@pytest.mark.slow
def test_the_drill_can_run_one_scenario(tmp_path):
    """``drill.only=machine``: the reference and the machine-death scenario, nothing else."""
    proc = _drill(f"drill.dir={tmp_path / 'drill'}", "drill.only=machine")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = re.findall(r"PASS (\w+)", proc.stdout)
    assert ran == ["reference", "machine"], proc.stdout
    assert "only=reference,machine" in proc.stdout
    assert "resumed from 4 on every rank" in proc.stdout and "bit-identical" in proc.stdout


@pytest.mark.slow
@pytest.mark.long
def test_the_drill_passes_with_a_sharded_state(tmp_path):
    proc = _drill(f"drill.dir={tmp_path / 'drill'}", "dist.shard=optimizer")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from 4 (the last commit)" in proc.stdout  # no one-rank emergency save


def test_bad_drill_settings_and_overrides_are_clear_errors(tmp_path):
    """Exit 2, as ftrain's own bad settings (they were exit 1, a failed drill's code), and
    no temporary directory left behind; `--help` prints the usage (it went to Hydra)."""
    env_tmp = tmp_path / "tmp"
    env_tmp.mkdir()

    def drill(*args):
        return _drill(*args, timeout=120, env={"TMPDIR": str(env_tmp)})

    bad = drill("drill.steps=6", "drill.commit_every=4", "drill.kill_at=6")
    assert bad.returncode == 2 and "drill.commit_every < drill.kill_at" in bad.stderr
    typo = drill("trainer.max_step=3")
    assert typo.returncode == 2 and "trainer.max_step" in typo.stderr
    one = drill("dist.nproc=1")
    assert one.returncode == 2 and "use >= 2" in one.stderr
    typo = drill("drill.only=machin,kill")
    assert typo.returncode == 2 and "drill.only='machin,kill': machin; choose from" in typo.stderr
    empty = drill("drill.only=,")
    assert empty.returncode == 2 and "no scenario named" in empty.stderr
    assert list(env_tmp.glob("ftrain-drill-*")) == []  # the refused drills made none
    usage = drill("--help")
    assert usage.returncode == 0 and "Scenarios" in usage.stdout and "drill.kill_at" in usage.stdout


@pytest.mark.slow
@pytest.mark.long  # ~80 s
def test_the_drill_fails_a_world_size_resume_whose_params_differ_past_rounding(tmp_path):
    """With model.dropout=0.1 (per-rank dropout streams: other results on another world
    size by design) the params differed by 4e-1 and the drill said "PASS ... within 4.4e-01
    (reduction rounding)": it printed the difference and never compared it."""
    proc = _drill(f"drill.dir={tmp_path / 'drill'}", "drill.only=world_size", "model.dropout=0.1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL world_size" in proc.stdout and "more than reduction rounding" in proc.stdout
    assert "model.dropout=0" in proc.stdout and "verdict: FAIL" in proc.stdout


@pytest.mark.slow
@pytest.mark.long  # ~90 s
def test_the_drill_passes_off_multiple_steps_and_sparse_logging(tmp_path):
    """drill.steps=10 with commits every 4: corrupt_newest expected a resume from 10 - 4 =
    6, though the commit before the final save is 8 (a false FAIL); trainer.log_every=4
    left step 5 without a record and `machine` failed with the bare message "5"."""
    proc = _drill(
        f"drill.dir={tmp_path / 'drill'}",
        "drill.only=corrupt_newest",
        "drill.steps=10",
        "trainer.log_every=4",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from 8, bit-identical" in proc.stdout, proc.stdout
    assert "PASS machine" in proc.stdout and proc.stdout.strip().endswith("verdict: PASS")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_drill_stopped_by_a_signal_stops_its_torchrun_and_ranks(tmp_path, sig):
    """SIGTERM or SIGHUP (a closed terminal) to the drill killed only the drill: torchrun
    and its ranks, in a session of their own, trained on as orphans."""
    root = tmp_path / "drill"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "ftrain.drill", f"drill.dir={root}", "drill.steps=100000"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    metrics = root / "reference" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and '"kind": "step"' in metrics.read_text()):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
        time.sleep(0.5)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, out
    assert f"drill interrupted ({signal.Signals(sig).name})" in out and str(root) in out, out
    deadline = time.time() + 30
    while _still_running(root) and time.time() < deadline:
        time.sleep(0.5)
    assert not _still_running(root)


def _still_running(root) -> list[str]:
    """Processes whose command line names ``root`` (the scenario's torchrun and ranks)."""
    found = subprocess.run(["pgrep", "-f", str(root)], capture_output=True, text=True)
    return found.stdout.split()
