"""Errors of the CLI's start-up that more than one of its modules raises."""

__all__ = ["ResumeError"]


class ResumeError(RuntimeError):
    """The requested resume cannot be done as asked (the message says what to do)."""
