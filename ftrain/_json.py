"""``json.loads`` for files a crash, a full disk or a hostile hand may have written."""

from __future__ import annotations

import json

__all__ = ["loads"]


def loads(raw: str | bytes | bytearray):
    """``json.loads``, where a document nested past Python's recursion limit (``[[[[...``
    100,000 deep: a few hundred kilobytes) is a ``json.JSONDecodeError`` like any other
    malformed one. ``RecursionError`` is no ``ValueError``: it went past every handler
    of a damaged record and stopped listings, restores and starts.

    Example:
        >>> loads(b'{"step": 3}')
        {'step': 3}
        >>> loads("[" * 100_000)  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        json.decoder.JSONDecodeError: nested too deeply: line 1 column 1 (char 0)
    """
    try:
        return json.loads(raw)
    except RecursionError:
        doc = raw if isinstance(raw, str) else bytes(raw[:64]).decode("utf-8", "replace")
        raise json.JSONDecodeError("nested too deeply", doc, 0) from None
