"""Errors of the CLI's start-up that more than one of its modules raises."""

__all__ = ["ResumeError", "ResumeReadError"]


class ResumeError(RuntimeError):
    """The requested resume cannot be done as asked (the message says what to do)."""


class ResumeReadError(OSError):
    """The step to resume could not be read for a reason of the disk or the machine of
    the moment (an I/O error outside the chunks' own checks, a file system gone): not the
    config (exit 2) and not the checkpoint's fault (nothing falls back); the start stops
    with exit 1 so a supervisor retries."""
