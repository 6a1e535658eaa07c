"""``trainer.compile=auto`` through the real CLI: a short run says it stays eager, and why."""


def test_a_short_run_with_compile_auto_stays_eager_and_says_why(cli, tmp_path):
    proc = cli(tmp_path / "run", "trainer.compile=auto", "trainer.max_steps=3", check=0)
    assert (
        "ftrain: trainer.compile=auto: eager: a 3-step run, shorter than the 5,000 steps "
        "that repay a compile" in proc.stderr
    ), proc.stderr
    assert "compiled the step" not in proc.stderr


def test_no_cpp_compiler_refuses_compile_true_at_start_and_auto_stays_eager(cache_dir, tmp_path):
    """Without a working C++ compiler a compiled CPU step failed at the first step with a
    100-line Inductor traceback, exit 1; with ``auto`` (not asked for) on every restart of
    a long run. ``true`` is refused at start naming the fixes; ``auto`` runs eager, saying why."""
    import os
    import subprocess
    import sys

    from .conftest import TINY

    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, CXX="/nonexistent/g++")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")  # nothing cached to reuse

    cmd = [sys.executable, "-m", "ftrain", f"run.dir={tmp_path / 'run'}", *TINY]
    refused = subprocess.run(
        [*cmd, "trainer.compile=true", "trainer.max_steps=2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "trainer.compile=true needs a C++ compiler on the CPU" in refused.stderr
    assert "/nonexistent/g++" in refused.stderr and "trainer.compile=false" in refused.stderr
    auto = subprocess.Popen(  # a run long enough for auto to compile: stopped once it chose
        [*cmd, "trainer.compile=auto", "trainer.max_steps=6000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    chose = auto.stderr.readline()
    auto.terminate()  # SIGTERM: the step finishes, is saved, exit 3
    rest = auto.communicate(timeout=120)[1]
    assert "trainer.compile=auto: eager: No working C++ compiler" in chose, chose + rest
    assert auto.returncode == 3 and "Traceback" not in rest and "compiled the step" not in rest


def test_a_resume_keeps_what_auto_chose_at_the_first_start(cli, popen_cli, tmp_path):
    """A resume that raises ``trainer.max_steps`` past the threshold switched a run that
    started eager to compiled mid-run (numbers ~1e-6 off the unbroken run): the choice is
    recorded with the checkpoints and kept."""
    from ftrain.ckpt import CheckpointManager

    run = tmp_path / "run"
    cli(run, "trainer.compile=auto", "trainer.max_steps=3", check=0)
    with CheckpointManager(run / "checkpoints") as m:
        assert m.metadata(3)["step_compiled"] is False
    longer = popen_cli(run, "trainer.compile=auto", "trainer.max_steps=6000")
    chose = next(line for line in longer.stdout if "trainer.compile=auto" in line)
    longer.terminate()  # SIGTERM: the step finishes, is saved, exit 3
    rest = longer.communicate(timeout=120)[0]
    assert "eager, as this run's first start chose" in chose, chose + rest
    assert longer.returncode == 3 and "compiled the step" not in rest, rest
