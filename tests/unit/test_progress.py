"""The progress line: rounded numbers, throughput named for what was counted, ETA, memory."""

import io
import re

import pytest
import torch

import ftrain
from ftrain.loop import train_loop
from ftrain.metrics import Progress, format_field, memory_fields
from ftrain.metrics.progress import format_step


def test_numbers_are_rounded_for_humans():
    assert format_field("val_loss", 5.251816987991333) == "val_loss=5.2518"
    assert format_field("loss", 5.30971) == "loss=5.3097"
    assert format_field("tokens_per_s", 118.1812) == "tokens/s=118"
    assert format_field("tokens_per_s", 6907.588) == "tokens/s=6.91k"
    assert format_field("samples_per_s", 1_250_000.0) == "samples/s=1.25M"
    assert format_field("steps_per_s", 2.34567) == "steps/s=2.35"
    assert format_field("lr", 5.9999999999999995e-05) == "lr=6e-05"
    assert format_field("lr", 0.0) == "lr=0"
    assert format_field("grad_norm", 3.29752) == "grad_norm=3.298"
    assert format_field("max_rss_mb", 412.34) == "max_rss=412M"
    assert format_field("cuda_max_alloc_mb", 1536.0) == "cuda_max_alloc=1.5G"
    assert format_field("blocking_s", 0.00251234) == "blocking_s=0.002512"
    assert format_field("restore_s", 125.0) == "restore_s=2m05s"
    assert format_field("loss", float("nan")) == "loss=nan"
    assert format_field("reason", "done") == "reason=done" and format_field("x", 7) == "x=7"


def test_step_line_order_and_that_unknown_metrics_stay_out():
    values = {
        "compile_s": 3.0,
        "samples_per_s": 54.21,
        "loss": 2.5,
        "lr": 3e-4,
        "lr_head": 1e-3,
        "steps_per_s": 13.55,
        "max_rss_mb": 400.0,
        "samples": 4,
    }
    line = format_step(values, elapsed=75, eta=3725)
    assert line == (
        "loss=2.5000 lr=0.0003 samples/s=54.2 steps/s=13.6 max_rss=400M lr_head=0.001 "
        "elapsed=1m15s eta=1h02m"
    )


def test_eta_comes_from_the_speed_since_the_first_logged_step():
    clock = iter([0.0, 100.0, 110.0])  # start, step 10, step 20
    out = io.StringIO()
    p = Progress(1010, start=0, stream=out, clock=lambda: next(clock))
    p.step(10, {"loss": 1.0, "steps_per_s": 0.1})  # the first step carries the start-up
    p.step(20, {"loss": 1.0, "steps_per_s": 1.0})
    first, second = out.getvalue().splitlines()
    assert first.endswith("elapsed=1m40s eta=2h46m"), "before a second step: its own speed"
    assert second.endswith("elapsed=1m50s eta=16m30s"), "990 steps at 1 step/s"


def test_peak_memory_is_read_for_the_cpu():
    mem = memory_fields(torch.device("cpu"))
    assert set(mem) == {"max_rss_mb"} and 10 < mem["max_rss_mb"] < 1e6


def _run_loop(loss_fn, steps=4):
    model = torch.nn.Linear(3, 1)
    tx = ftrain.optim.sgd(0.1)
    step = ftrain.make_step(model, loss_fn, tx)
    records = []
    batches = iter(lambda: {"x": torch.ones(5, 3)}, None)
    result = train_loop(
        ftrain.init_state(model, tx, seed=0),
        step,
        batches,
        max_steps=steps,
        record=lambda kind, **f: records.append((kind, f)),
    )
    return result, [f for kind, f in records if kind == "step"]


def test_a_loss_without_tokens_reports_samples_per_s_labelled_so():
    result, steps = _run_loop(lambda m, b: m(b["x"]).pow(2).mean())
    assert result.reason == "done"
    assert all("samples_per_s" in s and "tokens_per_s" not in s for s in steps)
    assert "tokens" not in steps[0], "no token count is made up from the sample count"
    out = io.StringIO()
    Progress(4, stream=out).step(1, steps[0])
    assert re.search(r"samples/s=[\d.]+k? steps/s=", out.getvalue())
    assert "tokens" not in out.getvalue()


def test_a_loss_that_counts_tokens_reports_tokens_per_s_from_that_count():
    def loss(m, b):
        return m(b["x"]).pow(2).mean(), {"tokens": torch.tensor(100)}

    _, steps = _run_loop(loss)
    s = steps[-1]
    assert s["tokens"] == 100 and "samples_per_s" not in s
    assert s["tokens_per_s"] / s["steps_per_s"] == pytest.approx(100, rel=1e-6)
