"""``trainer.compile=auto`` through the real CLI: a short run says it stays eager, and why."""


def test_a_short_run_with_compile_auto_stays_eager_and_says_why(cli, tmp_path):
    proc = cli(tmp_path / "run", "trainer.compile=auto", "trainer.max_steps=3", check=0)
    assert (
        "ftrain: trainer.compile=auto: eager: a 3-step run, shorter than the 5,000 steps "
        "that repay a compile" in proc.stderr
    ), proc.stderr
    assert "compiled the step" not in proc.stderr
