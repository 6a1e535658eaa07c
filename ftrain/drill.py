"""``python -m ftrain.drill [options] [hydra overrides]``: the fault drill, end to end.

Runs the real CLI under ``torchrun`` (gloo on CPU) and checks what the fault-tolerance
playbook promises, printing one line per scenario and a one-line verdict (exit 0 only on
pass)::

    python -m ftrain.drill                                   # gpt2_tiny, 2 ranks
    python -m ftrain.drill dist.nproc=2 dist.shard=optimizer model=gpt2_tiny
    python -m ftrain.drill drill.steps=40 drill.commit_every=10 drill.kill_at=15

Scenarios (``S`` steps, a commit every ``C``, a kill at ``K``, ``C < K < 2C <= S``):

1. ``reference``: an uninterrupted run of ``S`` steps.
2. ``machine``: the same run; every rank is SIGKILLed at once when step ``K`` is reached
   (the machine dies, the torchrun agent survives); torchrun (``--max-restarts``)
   restarts the group, every rank resumes from ``C``, step ``C+1`` has the reference's
   loss (the same batch) and learning rate, and the run ends bit-identical to the
   reference; the steps redone are counted.
3. ``kill``: one rank SIGKILLed at ``K``: the survivors' next collective fails and they
   make a one-rank emergency save of the last finished step before the restart (a
   sharded state cannot: then the last commit is used); the resume is from that step and
   the run ends bit-identical.
4. ``kill_during_save``: rank 0 SIGKILLs itself while writing step ``2C`` (after its data,
   before the manifest); that step is not committed, the restart resumes from ``C``, and
   the run ends bit-identical to the reference.
5. ``corrupt_newest``: one chunk of the newest checkpoint of (2) is flipped; a re-run
   detects it, rejects that step, resumes from the previous one and ends bit-identical.
6. ``world_size``: the reference's step ``C`` resumed on ``N-1`` ranks (1 for 2) continues
   the same global sample order to ``S`` (results equal up to reduction rounding).

Options (``drill.*`` and ``dist.nproc`` are the drill's; everything else goes to ftrain):
``drill.steps`` (12), ``drill.commit_every`` (4), ``drill.kill_at`` (6), ``drill.dir``
(a temporary directory, removed on pass), ``dist.nproc`` (2), ``drill.only`` (all
scenarios; e.g. ``drill.only=machine,kill``: the reference always runs, and
``corrupt_newest`` brings ``machine``, whose run it corrupts).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ftrain._stdio import run_tool
from ftrain.faults import inject_dir

__all__ = ["main"]

_DEFAULTS = {"drill.steps": 12, "drill.commit_every": 4, "drill.kill_at": 6, "dist.nproc": 2}
_TIMEOUT_S = 900.0

# a world-size change reorders the gradient reduction: the params after a few steps differ
# by ~1e-4 relative (gpt2_tiny, 12 steps); a real difference (per-rank dropout) by ~0.4
ROUNDING = 1e-2


@dataclass
class Plan:
    steps: int
    commit: int
    kill: int
    nproc: int
    root: Path
    overrides: list[str]
    keep: bool
    only: tuple[str, ...] = ()  # the scenarios to run (with what they need); () = all


class DrillFailed(Exception):
    """A scenario did not hold; the message says what was seen."""


class _Usage(SystemExit):
    """A setting the drill cannot run with: the message on stderr, exit 2 (as ftrain's own
    bad settings; exit 1 is a drill that ran and failed)."""

    def __init__(self, message: str) -> None:
        print(message, file=sys.stderr)
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _parse(argv: list[str]) -> Plan:
    if any(a in ("-h", "--help") for a in argv):  # it went to Hydra as an override
        print(__doc__ or "python -m ftrain.drill: see docs/distributed.md")  # -OO strips it
        raise SystemExit(0)
    opts, rest, root, only = dict(_DEFAULTS), [], None, ()
    for arg in argv:
        key, eq, value = arg.partition("=")
        if key == "drill.dir" and eq:
            root = value
        elif key == "drill.only" and eq:
            only = _chosen(value)
        elif key in opts and eq:
            if not value.isdigit():
                raise _Usage(f"{key}={value!r} must be a positive integer")
            opts[key] = int(value)
        else:
            rest.append(arg)
    steps, commit = opts["drill.steps"], opts["drill.commit_every"]
    kill, nproc = opts["drill.kill_at"], opts["dist.nproc"]
    if not 0 < commit < kill < 2 * commit <= steps:
        raise _Usage(
            f"need 0 < drill.commit_every < drill.kill_at < 2 * drill.commit_every <= drill.steps, "
            f"got steps={steps} commit_every={commit} kill_at={kill}"
        )
    if nproc < 2:
        raise _Usage(f"dist.nproc={nproc}: the drill kills one rank of several; use >= 2")
    if root is not None and Path(root).is_dir() and any(Path(root).iterdir()):
        raise _Usage(
            f"drill.dir={root} is not empty: an earlier drill's runs there would be resumed "
            "(a reference that trains nothing passes) and their heartbeats name processes "
            "long gone; use a new or empty directory"
        )
    plan = Plan(
        steps, commit, kill, nproc, Path(root or "."), rest, keep=root is not None, only=only
    )
    _check_overrides(plan)
    if root is None:  # made only once everything holds: a refused drill leaves none behind
        plan.root = Path(tempfile.mkdtemp(prefix="ftrain-drill-"))
    return plan


def _chosen(value: str) -> tuple[str, ...]:
    """``drill.only=a,b``: the named scenarios plus what they need, in the drill's order."""
    known = [s.__name__ for s in SCENARIOS]
    names = {n.strip() for n in value.split(",") if n.strip()}
    unknown = sorted(names - set(known))
    if unknown or not names:
        raise _Usage(
            f"drill.only={value!r}: {', '.join(unknown) or 'no scenario named'}; "
            f"choose from {', '.join(known)} (comma-separated)"
        )
    names |= {"reference"} | ({"machine"} if "corrupt_newest" in names else set())
    return tuple(n for n in known if n in names)


def _check_overrides(plan: Plan) -> None:
    from ftrain.config import ConfigError, load_config

    try:
        load_config(_overrides(plan, plan.root / "check"))
    except ConfigError as err:
        raise _Usage(f"ftrain.drill: {err}") from None


def _overrides(plan: Plan, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"run.dir={run_dir}",
        "run.plot=false",
        "trainer.eval_every=null",
        *plan.overrides,
        "trainer.log_every=1",  # every step's record: the checks read step C+1's
        f"trainer.max_steps={plan.steps}",
        f"checkpoint.every_steps={plan.commit}",
        "checkpoint.keep_last=null",
        *extra,
    ]


def _env(arm: Path | None = None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("FTRAIN_CHAOS_ARM", None)
    if arm is not None:  # the shipped injector: the process kills itself at a protocol phase
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(inject_dir()), env.get("PYTHONPATH")])
        )
        env["FTRAIN_CHAOS_ARM"] = str(arm)
    return env


def _torchrun(plan: Plan, run_dir: Path, *extra: str, nproc: int | None = None, arm=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc or plan.nproc}"]
    cmd += ["--standalone", "--max-restarts=2", "-m", "ftrain", *_overrides(plan, run_dir, *extra)]
    return subprocess.Popen(  # its own process group: a failed scenario stops all of it
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(arm),
        start_new_session=True,
    )


def _single(plan: Plan, run_dir: Path, *extra: str):
    cmd = [sys.executable, "-m", "ftrain", *_overrides(plan, run_dir, *extra)]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()
    )


def _finish(proc, what: str) -> str:
    try:
        out, _ = proc.communicate(timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        out, _ = proc.communicate()
        raise DrillFailed(f"{what}: timed out\n{out[-2000:]}") from None
    except BaseException:  # Ctrl-C: the ranks are in their own session, not the terminal's
        _stop_group(proc)
        raise
    if proc.returncode != 0:
        raise DrillFailed(f"{what}: exit {proc.returncode}\n{out[-3000:]}")
    return out


def _records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r.get("kind") == kind]


def _state(run_dir: Path, step: int):
    from ftrain.ckpt.readonly import read_subtree

    return read_subtree(
        run_dir / "checkpoints", step, only=("step", "params", "opt", "data", "rng")
    )[1]


def _same(a: Path, b: Path, step: int) -> str | None:
    from ftrain.state import first_difference

    return first_difference(_state(a, step), _state(b, step))


def _steps_by_number(run_dir: Path) -> dict[int, dict]:
    """The last record of each step (a redone step's record replaces the first one)."""
    return {r["step"]: r for r in _records(run_dir, "step")}


# -- scenarios --------------------------------------------------------------------


def reference(plan: Plan) -> str:
    _finish(_torchrun(plan, plan.root / "reference"), "reference run")
    return f"{plan.steps} steps on {plan.nproc} ranks, commits every {plan.commit}"


def machine(plan: Plan) -> str:
    """Every rank SIGKILLed at once (a machine dies; the agent restarts the group)."""
    run = plan.root / "machine"
    proc = _torchrun(plan, run)
    killed_at = _kill_at(run, proc, plan.kill, range(plan.nproc), after_commit=plan.commit)
    _finish(proc, "machine-death run")
    _resumed_from(run, plan.commit)
    _same_next_step(plan, run)
    _bit_identical(plan, run)
    return (
        f"all {plan.nproc} ranks SIGKILLed at step {killed_at}, restarted, resumed from "
        f"{plan.commit} on every rank, step {plan.commit + 1} same batch and lr, "
        f"{killed_at - plan.commit} step(s) redone, bit-identical"
    )


def kill(plan: Plan) -> str:
    """One rank SIGKILLed: the survivors' next collective fails, and each makes a one-rank
    emergency save of the last finished step (the state is replicated) before torchrun
    restarts the group; with a sharded state they cannot, and the last commit is used."""
    run = plan.root / "kill"
    proc = _torchrun(plan, run)
    killed_at = _kill_at(run, proc, plan.kill, [plan.nproc - 1], after_commit=plan.commit)
    _finish(proc, "kill run")
    resume = _records(run, "resume")
    start = resume[-1].get("from_step") if resume else None
    if not isinstance(start, int) or not plan.commit <= start <= killed_at:
        raise DrillFailed(
            f"expected a resume from a step in {plan.commit}..{killed_at}, got {resume[-1:]}"
        )
    _bit_identical(plan, run)
    how = "an emergency save of the survivors" if start > plan.commit else "the last commit"
    return (
        f"rank {plan.nproc - 1} SIGKILLed at step {killed_at}, restarted, resumed from {start} "
        f"({how}), {killed_at - start} step(s) redone, bit-identical"
    )


def _resumed_from(run: Path, step: int) -> None:
    resume = _records(run, "resume")
    if not resume or resume[-1].get("from_step") != step:
        raise DrillFailed(f"expected a resume from step {step}, got {resume[-1:]}")


def _bit_identical(plan: Plan, run: Path) -> None:
    diff = _same(plan.root / "reference", run, plan.steps)
    if diff:
        raise DrillFailed(f"final state differs from the reference: {diff}")


def _kill_at(run: Path, proc, step: int, ranks, after_commit: int) -> int:
    """:func:`_kill_when`; if it fails (or the drill is interrupted), the scenario's whole
    torchrun group is stopped: it kept training through the later scenarios and after the
    drill had exited."""
    try:
        return _kill_when(run, proc, step, ranks, after_commit)
    except BaseException:
        _stop_group(proc)
        proc.communicate()
        raise


def _stop_group(proc) -> None:
    """SIGKILL a scenario's torchrun (its own process group) and its ranks, or the one
    process of a single-process run. torchrun starts each rank in a session of its own,
    so the ranks are found as torchrun's descendants first: killed with torchrun's group
    alone they trained on as orphans."""
    below = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    for pid in below:  # a rank leads its own group: its compile workers go with it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(
                pid, signal.SIGKILL
            )


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``; none found elsewhere)."""
    parent_of = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent_of[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parent_of.items() if p in frontier]
        found += children
        frontier = children
    return found


def _kill_when(run: Path, proc, step: int, ranks, after_commit: int) -> int:
    """SIGKILL the given ranks (pids from their heartbeats) once the first reached ``step``
    and step ``after_commit`` is committed. An async save of that step may still be being
    written at ``step`` on a busy machine; a kill before its commit would test a fresh
    start, not the resume the scenario is about. It must commit by step
    ``2 * after_commit``, whose save waits for it: the heartbeat of that step is written
    before its save, so only a later one proves the commit was missed."""
    beats = [run / (f"heartbeat.rank{r}.json" if r else "heartbeat.json") for r in ranks]
    deadline = time.time() + _TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise DrillFailed(f"the run ended before step {step}:\n{proc.stdout.read()[-2000:]}")
        infos = [_beat(b) for b in beats]
        reached = infos[0].get("step", -1) if all(infos) else -1
        if reached >= step and _committed(run, after_commit):
            for info in infos:
                _kill_rank(int(info["pid"]), proc.pid)
            return int(infos[0]["step"])
        if reached > 2 * after_commit:
            raise DrillFailed(f"step {after_commit} was not committed by step {reached}")
        time.sleep(0.005)
    raise DrillFailed(f"ranks {list(ranks)} never reached step {step}")


def _kill_rank(pid: int, launcher: int) -> None:
    """SIGKILL a rank of this drill's torchrun, never another process whose pid a
    heartbeat happens to name."""
    if not _descends_from(pid, launcher):
        raise DrillFailed(f"pid {pid} of a heartbeat is not a rank of this drill's torchrun")
    os.kill(pid, signal.SIGKILL)


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether ``ancestor`` is ``pid`` or one of its parents (``/proc``; without it, yes)."""
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return not Path("/proc/self/stat").exists()
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: ppid
    return False


def _committed(run: Path, step: int) -> bool:
    from ftrain.ckpt.commit import committed_steps

    return step in committed_steps(run / "checkpoints")


def _beat(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _same_next_step(plan: Plan, run: Path) -> None:
    ref, got = _steps_by_number(plan.root / "reference"), _steps_by_number(run)
    n = plan.commit + 1
    for key in ("loss", "lr"):
        if ref[n].get(key) != got[n].get(key):
            raise DrillFailed(
                f"step {n} after the restart: {key}={got[n].get(key)} != reference {ref[n].get(key)}"
            )


def kill_during_save(plan: Plan) -> str:
    run = plan.root / "kill_during_save"
    run.mkdir(parents=True, exist_ok=True)
    arm = run / "arm.json"  # the 2nd save's data is written, the manifest is not
    arm.write_text(json.dumps({"id": "drill", "phase": "data_written", "count": 2, "rank": 0}))
    _finish(_torchrun(plan, run, "checkpoint.async_save=false", arm=arm), "kill-during-save run")
    if not (run / "arm.json.fired").exists():
        raise DrillFailed("the injected kill did not fire")
    _resumed_from(run, plan.commit)  # step 2C was never committed
    _bit_identical(plan, run)
    return f"rank 0 killed while writing step {2 * plan.commit}: not committed, resumed from {plan.commit}, bit-identical"


def corrupt_newest(plan: Plan) -> str:
    run = plan.root / "corrupt_newest"
    shutil.copytree(plan.root / "machine", run, ignore=shutil.ignore_patterns("heartbeat*"))
    newest = run / "checkpoints" / f"step_{plan.steps:08d}"
    chunks = [p for p in (newest / "params").rglob("*") if p.is_file() and p.name != "zarr.json"]
    chunk = max(chunks, key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    out = _finish(_torchrun(plan, run), "corrupt-newest run")
    previous = (plan.steps - 1) // plan.commit * plan.commit  # the commit before the final save
    if "corrupt" not in out:
        raise DrillFailed(f"the flipped byte in {chunk} was not reported:\n{out[-2000:]}")
    _resumed_from(run, previous)
    _bit_identical(plan, run)
    return f"a flipped byte in step {plan.steps} ({chunk.relative_to(run)}) rejected, resumed from {previous}, bit-identical"


def world_size(plan: Plan) -> str:
    import torch

    run = plan.root / "world_size"
    src = plan.root / "reference" / "checkpoints" / f"step_{plan.commit:08d}"
    shutil.copytree(src, run / "checkpoints" / src.name)
    n = plan.nproc - 1
    out = _finish(_torchrun(plan, run, nproc=n) if n > 1 else _single(plan, run), "world-size run")
    if f"checkpoint written by {plan.nproc} rank(s), resumed on {n}" not in out:
        raise DrillFailed(f"the resume did not report the world-size change:\n{out[-2000:]}")
    ref, got = _state(plan.root / "reference", plan.steps), _state(run, plan.steps)
    if not torch.equal(ref["data", "position"], got["data", "position"]):
        raise DrillFailed("the data cursor did not continue the same global sample order")
    worst = max(
        float((a - b).abs().max() / a.abs().max().clamp_min(1e-12))
        for a, b in zip(
            ref["params"].flatten_keys().values(),
            got["params"].flatten_keys().values(),
            strict=True,
        )
    )
    if not worst <= ROUNDING:  # NaN too; it printed any difference as "rounding"
        raise DrillFailed(
            f"params differ by {worst:.1e} (relative to each tensor's largest value, the "
            f"worst tensor) after the resume on {n} rank(s): more than reduction rounding "
            f"gives ({ROUNDING:.0e}; ~1e-4 over 12 steps, growing with drill.steps). Per-rank "
            "randomness differs across world sizes by design (dropout: model.dropout=0 for "
            "this scenario); otherwise the resumed run computes something else"
        )
    return f"step {plan.commit} of {plan.nproc} ranks resumed on {n}: same sample order, params within {worst:.1e} (reduction rounding, at most {ROUNDING:.0e})"


SCENARIOS = (reference, machine, kill, kill_during_save, corrupt_newest, world_size)


class _Stopped(BaseException):
    """SIGTERM or SIGHUP to the drill: raised like Ctrl-C's KeyboardInterrupt, so the
    scenario's torchrun group (in a session of its own, which a closed terminal's SIGHUP
    never reaches) is stopped too; it trained on, orphaned, after the drill died."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, _frame) -> None:
    for sig in _STOPS:  # a second one (a supervisor's) must not cut the stopping short
        signal.signal(sig, signal.SIG_IGN)
    raise _Stopped(signum)


def main(argv: list[str] | None = None) -> int:
    """Run the drill; returns 0 when every scenario passed (130 or 128 + the signal's
    number when interrupted: the scenario's processes are stopped, its runs kept)."""
    plan = _parse(list(sys.argv[1:] if argv is None else argv))
    main_thread = threading.current_thread() is threading.main_thread()
    held = {s: signal.signal(s, _raise_stopped) for s in _STOPS} if main_thread else {}
    try:
        return _drill(plan)
    except (KeyboardInterrupt, _Stopped) as stop:
        name = "SIGINT" if isinstance(stop, KeyboardInterrupt) else str(stop)
        with contextlib.suppress(OSError):  # the terminal a SIGHUP closed
            print(
                f"drill interrupted ({name}): its processes are stopped; runs kept in {plan.root}"
            )
        return 130 if isinstance(stop, KeyboardInterrupt) else 128 + stop.signum
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)


_STOPS = (signal.SIGTERM, signal.SIGHUP)


def _drill(plan: Plan) -> int:
    chosen = [s for s in SCENARIOS if not plan.only or s.__name__ in plan.only]
    subset = f" only={','.join(s.__name__ for s in chosen)}" if plan.only else ""
    print(
        f"ftrain drill in {plan.root}: steps={plan.steps} commit_every={plan.commit} kill_at={plan.kill} ranks={plan.nproc}{subset} {' '.join(plan.overrides)}",
        flush=True,
    )
    failed = 0
    for scenario in chosen:
        t0 = time.perf_counter()
        try:
            detail = scenario(plan)
            print(
                f"  PASS {scenario.__name__:<17} {time.perf_counter() - t0:5.0f}s  {detail}",
                flush=True,
            )
        except (DrillFailed, OSError, KeyError, ValueError) as err:
            failed += 1
            print(
                f"  FAIL {scenario.__name__:<17} {time.perf_counter() - t0:5.0f}s  {err}",
                flush=True,
            )
            if scenario is reference:
                break
    verdict = "PASS" if not failed else f"FAIL ({failed} scenario(s))"
    print(f"verdict: {verdict}")
    if not failed and not plan.keep:
        shutil.rmtree(plan.root, ignore_errors=True)
    elif failed:
        print(f"(runs kept in {plan.root})")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(run_tool(main, "ftrain.drill"))
