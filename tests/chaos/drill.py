"""Random-SIGKILL drills of the real CLI (``python -m ftrain``, alone or under ``torchrun``).

A drill runs the tiny recipe to ``max_steps`` while killing it (SIGKILL) over and over,
restarting after each kill (1 rank: the drill itself is the supervisor; 2 ranks:
``torchrun --max-restarts``), then checks the end state against an uninterrupted run.

Kills come in three kinds, drawn from a seeded plan (``random.Random(seed)``):

- ``startup``: a random delay after the process (or the worker group) appeared, so it may
  land in the interpreter start, config, restore, the stale-staging sweep or early steps;
- ``step``: a random moment after the heartbeat shows training running (in a step, or
  while an async save writes in the background);
- a commit-protocol or retention-delete phase (``ftrain/faults/sitecustomize.py``): the process
  SIGKILLs itself at that exact point, e.g. after ``COMMITTED`` was written but before the
  rename, or after a retention delete renamed a step to ``*.del-*``.

Timing depends on the machine's load, so a seed reproduces the plan (kinds, phases,
ranks, delays, async settings), not the exact instant of every external kill.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ftrain.ckpt.writerlock import LOCK_NAME as WRITER_LOCK
from ftrain.faults import inject_dir
from tests.integration.conftest import TINY

INJECT_DIR = inject_dir()  # the shipped injector: ftrain/faults/sitecustomize.py
REPO = Path(__file__).resolve().parents[2]

COMMIT_PHASES = ("begun", "data_written", "manifest_written", "marker_written", "renamed")
DELETE_PHASES = ("delete_renamed", "delete_partial")
PHASES = (*COMMIT_PHASES, *DELETE_PHASES, "index_written")
EXTERNAL = ("startup", "step")

# Left behind by a dead writer or a half-done delete: none may survive a clean exit.
# (``.checkpoints.json.*``: the index's temporary file, see test_kill_points.py.)
LEFTOVER = re.compile(r"\.tmp|\.del-|\.lock$|replaced|superseded|^\.checkpoints\.json\.")

WAIT_S = 300.0  # generous: the machine may be loaded; no assertion is about time


class DrillError(AssertionError):
    pass


# -- processes ---------------------------------------------------------------------


def base_env(cache_dir: str, arm: Path | None = None, log: Path | None = None) -> dict:
    env = dict(os.environ, FTRAIN_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("FTRAIN_CHAOS_ARM", None)
    if arm is not None:
        path = [str(INJECT_DIR), str(REPO), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        env["FTRAIN_CHAOS_ARM"] = str(arm)
        env["FTRAIN_CHAOS_LOG"] = str(log)
    return env


def cli_cmd(run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "ftrain", f"run.dir={run_dir}", *TINY, *overrides]


def torchrun_cmd(run_dir: Path, overrides: list[str], nproc: int, max_restarts: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--standalone",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.2",
        "-m",
        "ftrain",
        f"run.dir={run_dir}",
        *TINY,
        *overrides,
    ]


_SPAWNED: list[subprocess.Popen] = []  # everything a drill started, for reap()
# torchrun workers a drill saw (they run in their own sessions): pid -> start time, so that
# a pid the kernel has since given to another process is never killed
_WORKERS: dict[int, int | None] = {}


def spawn(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    out = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 - closed by the child's exit
    out.write(f"\n$ {' '.join(cmd)}\n")
    out.flush()
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    finally:
        out.close()
    _SPAWNED.append(proc)
    return proc


def reap() -> None:
    """Kill (by pid) whatever a failed drill left running: its processes and their workers."""
    for proc in _SPAWNED:
        if proc.poll() is None:
            workers = {pid: started(pid) for pid in children(proc.pid)}
            proc.kill()
            for pid, start in workers.items():
                kill_same(pid, start)
            proc.wait(timeout=60)
    for pid, start in _WORKERS.items():
        kill_same(pid, start)
    _SPAWNED.clear()
    _WORKERS.clear()


def tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no output)"


def finish(proc: subprocess.Popen, timeout: float = WAIT_S) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise DrillError(f"process {proc.pid} did not finish within {timeout:.0f}s") from None


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (psutil-free: /proc/*/stat)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            out.append(int(entry))
    return sorted(out)


def rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat fields after the command name: [state, ppid, ..., starttime (19), ...]."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def started(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): with the pid, its identity."""
    fields = _stat(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def kill(pid: int) -> bool:
    """SIGKILL ``pid``: only for an unreaped child of ours (its pid cannot be reused)."""
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def kill_same(pid: int, start: int | None) -> bool:
    """SIGKILL ``pid`` only if it is still the process that started at ``start``."""
    if start is None or not alive(pid) or started(pid) != start:
        return False
    return kill(pid)


def heartbeat(run_dir: Path, rank: int = 0) -> dict | None:
    name = "heartbeat.json" if rank == 0 else f"heartbeat.rank{rank}.json"
    try:
        beat = json.loads((run_dir / name).read_text())
        return beat if isinstance(beat, dict) and "pid" in beat and "step" in beat else None
    except (OSError, ValueError):
        return None


# -- records and checkpoints ---------------------------------------------------------


def read_records(run_dir: Path) -> tuple[list[dict], int]:
    """Records of metrics.jsonl and the number of lines that did not parse (torn by a kill)."""
    good, bad = [], 0
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return good, bad
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            bad += 1
            continue
        if isinstance(rec, dict):
            good.append(rec)
        else:
            bad += 1
    return good, bad


def manager(run_dir: Path):
    from ftrain.ckpt import CheckpointManager

    return CheckpointManager(run_dir / "checkpoints", async_save=False)


def committed(run_dir: Path) -> list[int]:
    return manager(run_dir).all_steps()


def restore_every_step(run_dir: Path) -> list[int]:
    """Restore (and so verify every chunk of) each committed step; the steps."""
    mgr = manager(run_dir)
    steps = mgr.all_steps()
    for s in steps:
        try:
            mgr.restore(s)
        except Exception as e:  # noqa: BLE001 - any failure is the finding
            raise DrillError(f"committed step {s} does not restore: {type(e).__name__}: {e}") from e
    return steps


def leftovers(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    if not root.exists():
        return []
    left = [name for name in os.listdir(root) if LEFTOVER.search(name)]
    # the writer lock file stays (a lock file is never deleted), emptied by a clean close
    if WRITER_LOCK in left and not (root / WRITER_LOCK).read_bytes():
        left.remove(WRITER_LOCK)
    return sorted(left)


def cli_verify(run_dir: Path) -> tuple[int, str]:
    """``python -m ftrain.ckpt verify DIR``, run in this process (the same ``main``, without
    another interpreter start): its exit status and output."""
    import contextlib
    import io

    from ftrain.ckpt.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = main(["verify", str(run_dir / "checkpoints")])
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 2
    return rc, out.getvalue()


# -- the plan and the report ------------------------------------------------------------


@dataclass
class Kill:
    kind: str  # "startup", "step" or a phase name
    rank: int = 0
    delay: float = 0.0  # startup: seconds after appearing; step: seconds after the target
    ahead: int = 0  # step: steps past the first heartbeat seen; phase: occurrence - 1
    async_save: bool = True
    cap: int | None = None  # startup: kill at the latest once a heartbeat shows this step


def guard(k: Kill, progress: int, max_steps: int, remaining: int) -> Kill:
    """Keep the planned kills from finishing the run early: when the steps left get short,
    turn a kill into a startup kill made by the first step past ``progress`` at the latest
    (one that moves the run on by at most a step or two). Otherwise startup kills stop at
    ``progress + 3``."""
    if max_steps - progress < 6 + 2 * (remaining - 1):
        return Kill("startup-guarded", k.rank, min(k.delay, 1.0), 0, k.async_save, progress + 1)
    if k.kind == "startup":
        return Kill(k.kind, k.rank, k.delay, k.ahead, k.async_save, progress + 3)
    return k


def plan(rng: random.Random, n: int, *, ranks: int) -> list[Kill]:
    """``n`` kills: first one of every kind (1 rank: both external kinds and every phase;
    more ranks: a step kill of every rank, a startup kill, a commit phase and a delete
    phase), as far as ``n`` allows, then random ones; shuffled. Async settings alternate."""

    def make(kind: str, rank: int | None = None) -> Kill:
        return Kill(
            kind=kind,
            rank=(0 if kind in PHASES else rng.randrange(ranks)) if rank is None else rank,
            delay=round(rng.uniform(0.0, 4.0 if kind == "startup" else 0.3), 3),
            # a phase occurs once per save: on 2 ranks (every_steps=2) count at most 2 of them
            ahead=0
            if kind == "startup"
            else rng.randrange(2 if kind in PHASES and ranks > 1 else 3),
        )

    if ranks == 1:
        first = [make(kind) for kind in (*EXTERNAL, *PHASES)]
    else:
        commit_phase = rng.choice(COMMIT_PHASES)
        delete_phase = rng.choice(DELETE_PHASES)
        first = [make("step", r) for r in range(ranks)]
        first += [make("startup"), make(commit_phase), make(delete_phase)]
    rng.shuffle(first)
    weights = {"startup": 2, "step": 4, **{p: 1 for p in PHASES}}
    kills = first[:n]
    while len(kills) < n:
        kills.append(make(rng.choices(list(weights), weights=list(weights.values()))[0]))
    rng.shuffle(kills)
    first_async = rng.random() < 0.5
    for i, k in enumerate(kills):
        k.async_save = (i % 2 == 0) == first_async
    return kills


@dataclass
class Report:
    drill: str
    seed: int
    planned: int
    kills: list[dict] = field(default_factory=list)
    launches: int = 0
    worker_generations: int = 0
    resume_records: int = 0
    redone_steps: int = 0
    torn_lines: int = 0
    final_step: int | None = None
    committed_at_end: list[int] = field(default_factory=list)
    duration_s: float = 0.0
    outcome: str = "incomplete"

    def summary(self) -> str:
        by_kind: dict[str, int] = {}
        for k in self.kills:
            by_kind[k["kind"]] = by_kind.get(k["kind"], 0) + 1
        if self.worker_generations:  # torchrun restarted a group, or the drill relaunched
            by_torchrun = self.worker_generations - self.launches
            restarts = f"{by_torchrun + self.launches - 1} (torchrun {by_torchrun}, relaunches {self.launches - 1})"
        else:
            restarts = str(max(self.launches - 1, 0))
        return (
            f"{self.drill}: seed={self.seed} kills={len(self.kills)} ({by_kind}) "
            f"restarts={restarts} "
            f"launches={self.launches} worker_generations={self.worker_generations} "
            f"resumes={self.resume_records} redone_steps={self.redone_steps} "
            f"torn_metric_lines={self.torn_lines} final_step={self.final_step} "
            f"committed_at_end={self.committed_at_end} "
            f"duration={self.duration_s:.1f}s outcome={self.outcome}"
        )


def fired(log: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def arm(arm_path: Path, kill_: Kill, ident: str) -> None:
    tmp = arm_path.with_name(arm_path.name + ".new")
    body = {"id": ident, "phase": kill_.kind, "count": kill_.ahead + 1, "rank": kill_.rank}
    tmp.write_text(json.dumps(body))
    os.replace(tmp, arm_path)


def disarm(arm_path: Path) -> bool:
    """True if the arm was still unfired (and is now removed)."""
    try:
        os.rename(arm_path, arm_path.with_name(arm_path.name + ".disarmed"))
        return True
    except FileNotFoundError:
        return False


def summarize_records(run_dir: Path, report: Report) -> list[dict]:
    records, report.torn_lines = read_records(run_dir)
    resumes = [r for r in records if r.get("kind") == "resume"]
    report.resume_records = len(resumes)
    report.redone_steps = sum(len(r.get("redo") or []) for r in resumes)
    return records


def losses(records: list[dict]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in records:
        if r.get("kind") == "step" and "loss" in r:
            out.setdefault(int(r["step"]), []).append(r["loss"])
    return out


def check_end_state(run_dir: Path, ref_dir: Path, max_steps: int, report: Report) -> None:
    """(a) bit-identical to the reference, (b) every step restores and verifies, (c) no
    leftovers, and every logged loss equals the reference's at that step."""
    from ftrain.state import first_difference

    records = summarize_records(run_dir, report)
    steps = restore_every_step(run_dir)
    report.committed_at_end = steps
    report.final_step = steps[-1] if steps else None
    if report.final_step != max_steps:
        raise DrillError(f"the run ended at committed step {report.final_step}, not {max_steps}")
    ref, got = manager(ref_dir).restore(max_steps), manager(run_dir).restore(max_steps)
    diff = first_difference(ref, got)
    if diff is not None:
        diff = diff if len(diff) < 2000 else diff[:2000] + " ..."
        raise DrillError(f"final state differs from the uninterrupted run: {diff}")
    left = leftovers(run_dir)
    if left:
        raise DrillError(f"left behind in {run_dir / 'checkpoints'} after a clean exit: {left}")
    rc, out = cli_verify(run_dir)
    if rc != 0:
        raise DrillError(f"python -m ftrain.ckpt verify exit {rc}:\n{out}")
    ref_losses = {s: v[-1] for s, v in losses(read_records(ref_dir)[0]).items()}
    for s, values in losses(records).items():
        if any(v != ref_losses.get(s) for v in values):
            raise DrillError(
                f"step {s} logged loss {values} across (re)runs; uninterrupted: {ref_losses.get(s)}"
            )


# -- 1 rank: the drill is the supervisor --------------------------------------------------


def wait_first_beat(run_dir: Path, proc: subprocess.Popen, deadline: float) -> dict | None:
    while time.time() < deadline and proc.poll() is None:
        beat = heartbeat(run_dir)
        if beat is not None and beat["pid"] == proc.pid:
            return beat
        time.sleep(0.01)
    return None


def one_rank_drill(
    *,
    seed: int,
    n_kills: int,
    work: Path,
    cache_dir: str,
    overrides: list[str],
    max_steps: int,
    report: Report,
) -> None:
    rng = random.Random(seed)
    kills = plan(rng, n_kills, ranks=1)
    run_dir, ref_dir = work / "chaos", work / "reference"
    arm_path, log = work / "arm.json", work / "fired.jsonl"
    out_log, ref_log = work / "chaos.log", work / "reference.log"
    t0 = time.time()
    common = [f"trainer.max_steps={max_steps}", *overrides]
    ref = spawn(
        cli_cmd(ref_dir, [*common, "checkpoint.async_save=true"]), base_env(cache_dir), ref_log
    )
    # the first run builds the tokenizer cache; let it finish that before two processes race
    wait_first_beat(ref_dir, ref, time.time() + WAIT_S)

    last_latest = progress = 0
    for i, k in enumerate(kills):
        k = guard(k, progress, max_steps, len(kills) - i)
        env = base_env(cache_dir, arm_path, log)
        if k.kind in PHASES:
            arm(arm_path, k, f"{seed}-{i}")
        else:
            disarm(arm_path)
        proc = spawn(
            cli_cmd(run_dir, [*common, f"checkpoint.async_save={str(k.async_save).lower()}"]),
            env,
            out_log,
        )
        report.launches += 1
        start = time.time()
        deadline = start + WAIT_S
        how = k.kind
        if k.kind.startswith("startup"):
            while time.time() < start + k.delay and proc.poll() is None:
                beat = heartbeat(run_dir)
                if beat and beat["pid"] == proc.pid and beat["step"] >= k.cap:
                    break
                time.sleep(0.005)
            kill(proc.pid)
        elif k.kind == "step":
            beat = wait_first_beat(run_dir, proc, deadline)
            if beat is not None:
                target = beat["step"] + k.ahead
                while time.time() < deadline and proc.poll() is None:
                    beat = heartbeat(run_dir)
                    if beat and beat["pid"] == proc.pid and beat["step"] >= target:
                        break
                    time.sleep(0.005)
                time.sleep(k.delay)
            kill(proc.pid)
        else:  # a phase: the process kills itself; if it never gets there, kill it
            beat = wait_first_beat(run_dir, proc, deadline)
            if beat is not None:
                limit = beat["step"] + k.ahead + 6
                while time.time() < deadline and proc.poll() is None:
                    beat = heartbeat(run_dir)
                    if beat and beat["pid"] == proc.pid and beat["step"] >= limit:
                        break
                    time.sleep(0.02)
            if proc.poll() is None and disarm(arm_path):
                how = f"{k.kind}-unreached"
                kill(proc.pid)
        rc = finish(proc)
        if rc == 0:
            raise DrillError(
                f"the run finished after {len(report.kills)} kills (planned {n_kills}); raise "
                f"max_steps\n{tail(out_log)}"
            )
        if rc != -signal.SIGKILL:
            raise DrillError(f"run {i} exited {rc} (not killed):\n{tail(out_log)}")
        if k.kind in PHASES and how == k.kind and not any(f["pid"] == proc.pid for f in fired(log)):
            raise DrillError(f"run {i}: SIGKILL, but the {k.kind} arm did not record firing")
        steps = restore_every_step(run_dir)  # no committed step is ever unreadable
        latest = steps[-1] if steps else 0
        if latest < last_latest:
            raise DrillError(
                f"kill {i} ({how}): latest committed went back {last_latest} -> {latest}"
            )
        beat = heartbeat(run_dir)
        if beat and beat["pid"] == proc.pid:
            progress = max(progress, beat["step"])
        progress = max(progress, latest)
        report.kills.append(
            {
                "kind": how,
                "async_save": k.async_save,
                "heartbeat_step": beat["step"] if beat and beat["pid"] == proc.pid else None,
                "committed": steps,
                "after_s": round(time.time() - start, 2),
            }
        )
        last_latest = latest

    disarm(arm_path)
    proc = spawn(
        cli_cmd(run_dir, [*common, "checkpoint.async_save=true"]), base_env(cache_dir), out_log
    )
    report.launches += 1
    rc = finish(proc)
    if rc != 0:
        raise DrillError(f"the final run exited {rc}:\n{tail(out_log)}")
    rc = finish(ref)
    if rc != 0:
        raise DrillError(f"the uninterrupted run exited {rc}:\n{tail(ref_log)}")
    check_end_state(run_dir, ref_dir, max_steps, report)
    report.duration_s = time.time() - t0
    report.outcome = "pass"


# -- N ranks under torchrun --max-restarts -------------------------------------------------


def _generation(agent: subprocess.Popen, nproc: int, seen: set[int], deadline: float) -> list[int]:
    """Wait for a fresh worker group (all pids new); [] if the agent exits first."""
    while time.time() < deadline:
        if agent.poll() is not None:
            return []
        kids = [p for p in children(agent.pid) if p not in seen]
        if len(kids) == nproc:
            return kids
        time.sleep(0.02)
    raise DrillError(f"no new worker group of {nproc} under torchrun {agent.pid} in time")


def _rank_pid(gen: list[int], rank: int) -> int | None:
    for pid in gen:
        if rank_of(pid) == rank:
            return pid
    return None


def _wait_beat(run_dir: Path, rank: int, gen: list[int], agent, deadline: float, at_least=None):
    while time.time() < deadline and agent.poll() is None and any(alive(p) for p in gen):
        beat = heartbeat(run_dir, rank)
        if beat and beat["pid"] in gen and (at_least is None or beat["step"] >= at_least):
            return beat
        time.sleep(0.005)
    return None


def torchrun_drill(
    *,
    seed: int,
    n_kills: int,
    work: Path,
    cache_dir: str,
    overrides: list[str],
    max_steps: int,
    nproc: int,
    report: Report,
    per_launch: int = 3,
) -> None:
    """Kills split over torchrun launches of ``per_launch`` kills: every launch but the last
    has ``--max-restarts=per_launch-1`` (its last kill exhausts it: torchrun gives up and the
    drill relaunches, as a job scheduler would); the last has enough restarts to finish.
    Launches alternate async_save true/false."""
    rng = random.Random(seed)
    kills = plan(rng, n_kills, ranks=nproc)
    launches = [kills[i : i + per_launch] for i in range(0, len(kills), per_launch)]
    first_async = rng.random() < 0.5
    run_dir, ref_dir = work / "chaos", work / "reference"
    arm_path, log = work / "arm.json", work / "fired.jsonl"
    out_log, ref_log = work / "chaos.log", work / "reference.log"
    t0 = time.time()
    common = [f"trainer.max_steps={max_steps}", "trainer.eval_every=null", *overrides]
    ref = spawn(
        torchrun_cmd(ref_dir, [*common, "checkpoint.async_save=true"], nproc, 0),
        base_env(cache_dir),
        ref_log,
    )
    wait_first_beat_any = time.time() + WAIT_S
    while time.time() < wait_first_beat_any and ref.poll() is None and heartbeat(ref_dir) is None:
        time.sleep(0.05)

    seen: set[int] = set()
    progress, done = 0, 0
    for li, batch in enumerate(launches):
        last = li == len(launches) - 1
        async_save = (li % 2 == 0) == first_async
        restarts = len(batch) if last else len(batch) - 1
        disarm(arm_path)
        agent = spawn(
            torchrun_cmd(
                run_dir,
                [*common, f"checkpoint.async_save={str(async_save).lower()}"],
                nproc,
                restarts,
            ),
            base_env(cache_dir, arm_path, log),
            out_log,
        )
        report.launches += 1
        for ki, k in enumerate(batch):
            k = guard(k, progress, max_steps, len(kills) - done)
            done += 1
            deadline = time.time() + WAIT_S
            gen = _generation(agent, nproc, seen, deadline)
            if not gen:
                raise DrillError(
                    f"torchrun exited {agent.returncode} before kill {ki} of launch {li}:\n{tail(out_log)}"
                )
            seen.update(gen)
            starts = {pid: started(pid) for pid in gen}
            _WORKERS.update(starts)
            report.worker_generations += 1
            start, how, victim = time.time(), k.kind, None
            if k.kind.startswith("startup"):
                while time.time() < start + k.delay and all(alive(p) for p in gen):
                    beat = heartbeat(run_dir, k.rank)
                    if beat and beat["pid"] in gen and beat["step"] >= k.cap:
                        break
                    time.sleep(0.005)
                victim = _rank_pid(gen, k.rank) or gen[0]
            elif k.kind == "step":
                beat = _wait_beat(run_dir, k.rank, gen, agent, deadline)
                if beat is not None:
                    beat = _wait_beat(run_dir, k.rank, gen, agent, deadline, beat["step"] + k.ahead)
                    time.sleep(k.delay)
                victim = beat["pid"] if beat else _rank_pid(gen, k.rank)
            else:
                arm(arm_path, k, f"{seed}-{li}-{ki}")
                beat = _wait_beat(run_dir, 0, gen, agent, deadline)
                if beat is not None:
                    limit = beat["step"] + 4 * (k.ahead + 1) + 2
                    while time.time() < deadline and all(alive(p) for p in gen):
                        beat = heartbeat(run_dir)
                        if beat and beat["pid"] in gen and beat["step"] >= limit:
                            break
                        time.sleep(0.02)
                if disarm(arm_path):  # never reached: kill rank 0 from outside instead
                    how = f"{k.kind}-unreached"
                    victim = _rank_pid(gen, 0)
                else:
                    shot = [f for f in fired(log) if f["pid"] in gen]
                    if not shot:
                        raise DrillError(f"the {k.kind} arm was consumed, but no firing recorded")
            killed = victim is not None and kill_same(victim, starts.get(victim))
            if not killed and (k.kind not in PHASES or how != k.kind):
                # the group died on its own before the kill: that is a failure, not a kill
                raise DrillError(
                    f"launch {li} kill {ki} ({how}): the worker group ended before the kill\n"
                    f"{tail(out_log, 120)}"
                )
            for r in range(nproc):
                b = heartbeat(run_dir, r)
                if b and b["pid"] in gen:
                    progress = max(progress, b["step"])
            beat = heartbeat(run_dir, k.rank)
            report.kills.append(
                {
                    "kind": how,
                    "rank": k.rank,
                    "async_save": async_save,
                    "launch": li,
                    "heartbeat_step": beat["step"] if beat and beat["pid"] in gen else None,
                    "after_s": round(time.time() - start, 2),
                }
            )
        if last:
            deadline = time.time() + WAIT_S
            gen = _generation(agent, nproc, seen, deadline)
            if gen:
                seen.update(gen)
                _WORKERS.update({pid: started(pid) for pid in gen})
                report.worker_generations += 1
        rc = finish(agent)
        if last and rc != 0:
            raise DrillError(f"the last torchrun launch exited {rc}:\n{tail(out_log, 120)}")
        if not last and rc == 0:
            raise DrillError(f"torchrun launch {li} finished although its restarts were spent")
        orphans = [p for p in seen if p in _WORKERS and started(p) == _WORKERS[p]]
        if orphans:
            raise DrillError(f"workers {orphans} outlived torchrun launch {li}")
        restore_every_step(run_dir)

    expected = len(kills) + 1
    if report.worker_generations != expected:
        raise DrillError(f"{report.worker_generations} worker groups ran; expected {expected}")
    rc = finish(ref)
    if rc != 0:
        raise DrillError(f"the uninterrupted torchrun exited {rc}:\n{tail(ref_log, 120)}")
    check_end_state(run_dir, ref_dir, max_steps, report)
    report.duration_s = time.time() - t0
    report.outcome = "pass"
