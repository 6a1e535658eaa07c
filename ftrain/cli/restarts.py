"""A torchrun restart continues the history its job began: ``resume=N`` is the first
attempt's.

``torchrun --max-restarts=K -m ftrain ... resume=N`` reruns the same command line in every
attempt after a rank dies. Taking ``resume=N`` again went back to N on every restart and
set aside the steps the job had committed since (superseded), so a failure that recurs
after N lost that work each time until the restarts ran out. A restart attempt
(``TORCHELASTIC_RESTART_COUNT`` > 0) whose run records show that *this* job (same host,
same torchrun agent process, same rendezvous id) went back to N and has committed steps
after N since resumes from the latest commit instead, and says so. Every step after N
that is still committed then belongs to the job's own history: a resume that goes back
sets the old history's steps aside at its first commit.

A restart before the job's first commit after going back keeps ``resume=N`` (the old
history's steps are still there, and N is still what was asked for). ``resume=none`` (with
or without ``run.overwrite=true``) is the first attempt's too: a restart refused to start
over the job's own commits (exit 2 on every restart), or with ``run.overwrite`` moved them
aside and trained from step 0 again; once the job has started it resumes from its latest
commit (or starts fresh if it committed nothing). Another supervisor
that reruns one command line (systemd, a Slurm requeue) cannot be told apart from a user
asking again: give it ``resume=latest``.
"""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ftrain.dist import World, broadcast_json
from ftrain.metrics.history import read_history

__all__ = ["continue_restarted_job", "elastic_job"]


def elastic_job() -> str | None:
    """This process's torchrun job (None outside torchrun): the host, the agent process
    that started the workers, and the rendezvous id (``none`` by default without
    ``--standalone``, so not unique alone)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    return f"{socket.gethostname()}:{os.getppid()}:{run_id}"


def _restart_attempt() -> int:
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def committed_since_going_back(run_dir: Path, step: int, job: str) -> list[int]:
    """Steps after ``step`` committed since ``job``'s last resume to ``resume=step``
    ([] if that job never resumed there, or committed nothing since)."""
    since: list[int] | None = None
    for r in read_history(run_dir):
        kind, s = r.get("kind"), r.get("step")
        if kind == "resume" and r.get("reason") == f"resume={step}" and r.get("elastic_job") == job:
            since = []
        elif since is not None and kind == "committed" and type(s) is int and s > step:
            since.append(s)
    return since or []


def started_fresh(run_dir: Path, job: str) -> bool:
    """Whether ``job`` already made a fresh start (``resume=none``) in ``run_dir``."""
    return any(
        r.get("kind") == "start" and r.get("elastic_job") == job for r in read_history(run_dir)
    )


def continue_restarted_job(cfg: DictConfig, world: World) -> tuple[DictConfig, str | None]:
    """``cfg``, with ``resume=latest`` in place of the first attempt's ``resume=N`` (once the
    job committed after going back to N) or ``resume=none`` (once the job started fresh;
    ``run.overwrite`` then off: it would move the job's own steps aside) on a torchrun
    restart; and the line that says so (None: as asked). The coordinator reads the
    records; every rank takes its answer."""
    job, resume = elastic_job(), cfg.resume
    step = not isinstance(resume, bool) and isinstance(resume, int)
    if job is None or _restart_attempt() == 0 or not (step or resume == "none"):
        return cfg, None
    mine = None
    if world.is_coordinator:
        run_dir = Path(cfg.run.dir)
        mine = (
            committed_since_going_back(run_dir, resume, job)
            if step
            else started_fresh(run_dir, job)
        )
    since = broadcast_json(mine)
    if not since:
        return cfg, None
    began = (
        f"the history it began (step(s) {', '.join(map(str, sorted(set(since))))} committed since)"
        if step
        else "the run it started"
    )
    note = (
        f"resume={resume}{' run.overwrite=true' if cfg.run.overwrite else ''} was this torchrun "
        f"job's first attempt's: restart {_restart_attempt()} continues {began}, so resume=latest"
    )
    cfg = copy.deepcopy(cfg)
    OmegaConf.set_readonly(cfg, False)
    cfg.resume, cfg.run.overwrite = "latest", False
    return cfg, note
