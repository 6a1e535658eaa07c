"""Fault injection for drills: a ``sitecustomize`` that SIGKILLs a process at an exact point.

Put :func:`inject_dir` on ``PYTHONPATH`` of a training process and set ``FTRAIN_CHAOS_ARM``
to an arm file (``{"id", "phase", "count", "rank"}``): the process kills itself the
``count``-th time it reaches ``phase`` of the checkpoint commit protocol (``begun``,
``data_written``, ``manifest_written``, ``marker_written``, ``renamed``) or of a retention
delete. Without ``FTRAIN_CHAOS_ARM`` the module does nothing. Used by
``python -m ftrain.drill`` and the chaos tests (``tests/chaos``); see the module
``sitecustomize`` in this directory for the phases.
"""

from pathlib import Path

__all__ = ["inject_dir"]


def inject_dir() -> Path:
    """The directory holding the injector's ``sitecustomize.py``."""
    return Path(__file__).resolve().parent
