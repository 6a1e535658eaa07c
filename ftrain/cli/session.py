"""One run's side effects: metrics.jsonl, heartbeat, progress, saves and evaluation.

The loop only calls ``save(...)`` and ``record(...)``; this object decides what those
mean for the CLI (only the coordinator writes files; saves carry the run's metadata;
every save, resume and emergency is an event in ``metrics.jsonl``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from ftrain.ckpt import CheckpointManager
from ftrain.data import val_batches
from ftrain.dist import World, agree_any, all_mean
from ftrain.loop import LoopResult
from ftrain.metrics import Heartbeat, MetricsWriter, Progress
from ftrain.step import evaluate, make_eval_step

__all__ = ["Session"]

_SHOWN = ("loss", "lr", "grad_norm", "tokens_per_s")


class Session:
    """Context manager around one run; closing it waits for the last checkpoint commit."""

    def __init__(self, cfg: DictConfig, world: World, manager: CheckpointManager) -> None:
        self.cfg, self.world, self.manager = cfg, world, manager
        self.run_dir = Path(cfg.run.dir)
        lead = world.is_coordinator
        self.writer = MetricsWriter(self.run_dir, enabled=lead)
        self.heartbeat = Heartbeat(
            self.run_dir, name="heartbeat.json" if lead else f"heartbeat.rank{world.rank}.json"
        )
        self.progress: Progress | None = None
        self.metadata: dict = {}

    # -- lifecycle --------------------------------------------------------------
    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.manager.close()
        finally:
            if self.progress is not None:
                self.progress.close()
            self.writer.close()

    def start_progress(self, start_step: int) -> None:
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
            "rank_positions": self._rank_positions(report.position),
            "restore_s": report.restore_s,
            "checkpoint_bytes": report.checkpoint_bytes,
        }
        self.writer.write("resume" if report.resumed else "start", step=report.step, **fields)

    def _rank_positions(self, position: int) -> list[int]:
        # rank r reads the r-th contiguous slice of each global batch
        local = self.cfg.trainer.batch_size // self.world.size
        return [position + r * local for r in range(self.world.size)]

    def record(self, kind: str, **fields) -> None:
        step = fields.get("step", 0)
        if kind == "heartbeat":
            self.heartbeat.beat(step)
            return
        if kind == "step":
            if self.world.active:  # log the global mean loss, not this rank's share
                fields |= all_mean({"loss": fields["loss"]})
            self.writer.write("step", **fields)
            if self.progress is not None:
                self.progress.step(step, {k: fields[k] for k in _SHOWN if k in fields})
            return
        self.writer.write(kind, **fields)
        shown = " ".join(f"{k}={v}" for k, v in fields.items() if k != "step")
        self._say(step, f"{kind} {shown}")

    # -- saving and evaluating ---------------------------------------------------
    def save(self, state, metrics: dict, *, force: bool, reason: str) -> bool:
        """Offer ``state`` to the manager (coordinator only; the state is replicated)."""
        if not self.world.is_coordinator:
            return False
        t0 = time.perf_counter()
        saved = self.manager.save(state, metrics=metrics, metadata=self.metadata, force=force)
        if saved:
            blocking = time.perf_counter() - t0
            self.record(
                "save",
                step=int(state["step"]),
                reason=reason,
                blocking_s=round(blocking, 4),
                async_save=bool(self.cfg.checkpoint.async_save),
            )
        return saved

    def evaluator(self, model, loss_fn, val_src, device):
        """``evaluate(state) -> {"val_loss": ...}`` over fixed validation batches, averaged over ranks."""
        eval_step = make_eval_step(model, loss_fn, precision=self.cfg.trainer.precision)
        t = self.cfg.trainer

        def run(state) -> dict[str, float]:
            batches = val_batches(
                val_src,
                t.eval_batches,
                t.batch_size,
                self.world.rank,
                self.world.size,
                device=device,
            )
            out = evaluate(eval_step, state, batches)
            return all_mean({"val_loss": out["loss"]})

        return run

    def finish(self, result: LoopResult) -> None:
        step = int(result.state["step"])
        self.manager.wait()  # the final save counts only once committed
        agree_any(False)  # a barrier: no rank reports the end before the coordinator committed
        kind = "stop" if result.status == "stopped" else "end"
        self.record(kind, step=step, reason=result.reason, committed=self.manager.latest_step())
        if self.cfg.run.plot and self.world.is_coordinator:
            self._plot()

    def _plot(self) -> None:
        try:
            from ftrain.plot import plot_run

            path = plot_run(self.run_dir)
            self._say(0, f"plot written to {path}")
        except ImportError:
            print(
                "ftrain: matplotlib is not installed; skipping the plot (pip install matplotlib)",
                file=sys.stderr,
            )
