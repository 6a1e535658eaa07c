"""Environment settings that break the torch import itself, said in one line first.

``import ftrain`` imports tensordict, which imports ``torch._dynamo``, which creates
``TORCHINDUCTOR_CACHE_DIR`` at import: set to a file, or a path that cannot be created,
every ftrain command died in a 40-line ``FileExistsError`` traceback from inside torch
before any ftrain code ran. Nothing here imports more than the standard library.
"""

from __future__ import annotations

import os
import sys

# variables torch reads while it is imported (not at the first compile)
_AT_IMPORT = ("TORCHINDUCTOR_CACHE_DIR",)


class EnvironmentSettingError(ImportError):
    """An environment variable torch reads at import names something it cannot use."""


def problem() -> str | None:
    """What is wrong with the environment for the torch import, or None."""
    for var in _AT_IMPORT:
        value = os.environ.get(var)
        if not value:
            continue
        try:  # what torch does on import (it creates the directory too)
            os.makedirs(value, exist_ok=True)
            _probe_write(value)  # a read-only one failed at the first compiled step
        except OSError as err:
            why = "not a directory" if os.path.lexists(value) and not os.path.isdir(value) else None
            return (
                f"{var}={value} cannot be torch's compile cache ({why or err.strerror}): point "
                f"it at a directory this user can write, or unset it"
            )
    return None


def _probe_write(directory: str) -> None:
    """Create and remove one file in ``directory`` (``os.access`` says yes to root on a
    read-only mount): exists is not enough, Inductor writes its kernels there. A cache that
    could not be written stopped a compiled run at its first step, exit 1, 118 lines."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix=".ftrain-probe-", dir=directory)
    os.close(fd)
    os.unlink(path)


def _an_ftrain_command(argv: list[str]) -> bool:
    """``python [-u ...] -m ftrain[.tool] ...`` or the ``ftrain`` console script (also as
    torchrun starts it: ``python -u .../bin/ftrain ...``)."""
    rest = argv[1:]
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
        rest = rest[2:] if rest[0] in ("-X", "-W") else rest[1:]  # interpreter options
    if rest[:1] == ["-m"]:
        module = rest[1] if len(rest) > 1 else ""
        return module == "ftrain" or module.startswith("ftrain.")
    return bool(rest) and os.path.basename(rest[0]) == "ftrain"


def check() -> None:
    """Exit 2 with one line (an ftrain command) or raise :class:`EnvironmentSettingError`
    (a library import) if the torch import would fail on the environment."""
    message = problem()
    if message is None:
        return
    if _an_ftrain_command(list(getattr(sys, "orig_argv", []))):
        print(f"ftrain: {message}", file=sys.stderr)
        raise SystemExit(2)  # a setting: a supervisor's retry would fail the same way
    raise EnvironmentSettingError(message)


check()  # on import, in ftrain/__init__.py before torch
