"""The real CLI with logger=[jsonl,tensorboard,csv]: files parsed back, redone steps, the
progress lines and last lines, samples/s for a loss without tokens, refusals before training."""

import csv
import os
import re
import subprocess
import sys

import pytest

from .conftest import TINY, records

STEP_LINE = re.compile(
    r"\[step=(\d+)\] loss=\d+\.\d{4} lr=\S+ grad_norm=\d[\d.e+-]* tokens/s=[\d.]+[kM]? "
    r"steps/s=[\d.]+[kM]? max_rss=\d+M elapsed=\d+s eta=(\d+[hms]\S*|\?)"
)


def _scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    events = acc.Scalars(tag)
    assert len({e.step for e in events}) == len(events), f"a step of {tag} shows twice"
    return {e.step: e.value for e in events}


def _csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_tensorboard_and_csv_from_the_cli_and_a_resume_that_redoes_steps(cli, tmp_path):
    pytest.importorskip("tensorboard", reason="pip install 'ftrain[tensorboard]'")
    run = tmp_path / "run"
    args = ("trainer.max_steps=6", "checkpoint.every_steps=3", "logger=[jsonl,tensorboard,csv]")
    out = cli(run, *args, "run.plot=true", check=0).stdout
    lines = out.splitlines()
    steps = [int(m.group(1)) for line in lines if (m := STEP_LINE.fullmatch(line))]
    assert steps == [1, 2, 3, 4, 5, 6], out
    assert "lr schedule decays over 12 steps (schedule.decay_steps)" in out
    assert re.search(r"^\[step=4\] eval val_loss=\d+\.\d{4}$", out, re.M), out
    assert lines[-2:] == [
        "[step=6] end reason=done committed=6",
        f"[step=6] plot written to {run / 'training.png'}",
    ]
    losses = {r["step"]: r["loss"] for r in records(run, "step")}
    assert _scalars(run / "tensorboard", "train/loss") == pytest.approx(losses, rel=1e-6)
    val = records(run, "eval")[0]
    assert _scalars(run / "tensorboard", "val/loss") == pytest.approx({4: val["val_loss"]})
    rows = [r for r in _csv_rows(run / "metrics.csv") if r["kind"] == "step"]
    assert {int(r["step"]): float(r["loss"]) for r in rows} == losses

    # steps 4..6 ran before; resuming at 3 redoes them (the same values: the run is deterministic)
    out = cli(run, *args, "resume=3", check=0).stdout
    assert "steps 4..6 ran before" in out
    assert _scalars(run / "tensorboard", "train/loss") == pytest.approx(losses, rel=1e-6)
    steps_in_csv = [int(r["step"]) for r in _csv_rows(run / "metrics.csv") if r["kind"] == "step"]
    assert steps_in_csv == [1, 2, 3, 4, 5, 6], "the redone steps' first rows were dropped"
    # a re-run of the finished run starts no logger (it began an empty TensorBoard file)
    events = sorted(p.name for p in (run / "tensorboard").iterdir())
    csv_bytes = (run / "metrics.csv").read_bytes()
    assert "end reason=done committed=6" in cli(run, *args, check=0).stdout
    assert sorted(p.name for p in (run / "tensorboard").iterdir()) == events
    assert (run / "metrics.csv").read_bytes() == csv_bytes
    # checkpoints record no logger (no _target_ in their metadata): ftrain.eval reads them
    from ftrain.cli.evaluate import evaluate_run

    assert evaluate_run(run, 6)["val_loss"] > 0


BLOCKED = """
import sys
sys.modules["tensorboard"] = None  # as if 'ftrain[tensorboard]' were not installed
from ftrain.cli.run import main
sys.exit(main(sys.argv[1:]))
"""


def _script(cache_dir, script, *args):
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=240
    )


def test_a_missing_extra_or_an_unknown_logger_key_exits_2_before_training(cli, cache_dir, tmp_path):
    run = tmp_path / "run"
    proc = _script(cache_dir, BLOCKED, f"run.dir={run}", *TINY, "logger=[jsonl,tensorboard]")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "pip install 'ftrain[tensorboard]'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run / "metrics.jsonl").exists() or not records(run, "step")
    bad = cli(run, "logger=csv", "+logger.csv.delimiter=x", check=2)
    assert "unknown key(s) logger.csv.delimiter: CsvLogger takes ['path']" in bad.stderr
    assert "Traceback" not in bad.stderr
    # a CSV at the run's own metrics.jsonl set the run's records aside: refused, untouched
    records_before = b'{"kind": "step", "step": 1, "loss": 4.0}\n'
    (run / "metrics.jsonl").write_bytes(records_before)
    clash = cli(run, "logger=csv", "logger.csv.path=${run.dir}/metrics.jsonl", check=2)
    assert f"logger.csv.path={run}/metrics.jsonl would write into run.dir's metrics.jsonl" in (
        clash.stderr
    )
    assert (run / "metrics.jsonl").read_bytes() == records_before
    assert not list(run.glob("*.damaged-*")) and "Traceback" not in clash.stderr


NO_TOKENS = """
import sys
from ftrain.cli.build import _gpt2, register_model
from ftrain.cli.run import main

@register_model("gpt2_no_tokens")
def build(cfg, generator):
    model, loss = _gpt2(cfg, generator)
    return model, lambda m, batch: loss(m, batch)[0]  # the loss alone: no token count

sys.exit(main(sys.argv[1:]))
"""


def test_a_custom_loss_without_tokens_reports_samples_per_s(cache_dir, tmp_path):
    run = tmp_path / "run"
    args = [f"run.dir={run}", *TINY, "model.name=gpt2_no_tokens", "trainer.max_steps=3"]
    proc = _script(cache_dir, NO_TOKENS, *args, "trainer.eval_every=null")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    step_lines = [line for line in proc.stdout.splitlines() if " loss=" in line]
    assert len(step_lines) == 3 and all(" samples/s=" in line for line in step_lines)
    assert "tokens" not in proc.stdout
    rec = records(run, "step")[-1]
    assert "samples_per_s" in rec and "tokens_per_s" not in rec and "tokens" not in rec


@pytest.mark.slow
def test_under_torchrun_only_the_coordinator_logs_and_throughput_is_the_runs(cache_dir, tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    cmd += ["-m", "ftrain", f"run.dir={run}", *TINY, "trainer.eval_every=null"]
    cmd += ["trainer.max_steps=3", "logger=[jsonl,csv]"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _csv_rows(run / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3], "one row per step: the coordinator's"
    recs = records(run, "step")
    # each rank counts its half of the global batch; the record has the run's counts and
    # throughput, the sums (the ranks' clocks differ: steps_per_s is their mean, so on a
    # busy host the ratio is off by a third or more; one rank's share would be half of it)
    for rec in recs[1:]:  # step 1's clock starts at each rank's own loop start
        assert rec["samples"] == 4 and rec["tokens"] == 4 * 32, "the global batch's counts"
        per_step = rec["tokens_per_s"] / rec["steps_per_s"]
        assert 0.75 * rec["tokens"] < per_step < 1.5 * rec["tokens"], "not one rank's share"
    assert "[rank=1][step=3] end reason=done" in proc.stdout
