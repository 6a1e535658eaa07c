"""Suite-wide: the ``long`` marker's opt-in (for tests anywhere under tests/), and each
test's signal handlers put back after it."""

import os
import signal

import pytest

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT)


@pytest.fixture(autouse=True)
def _signal_handlers_put_back():
    """A test that runs CLI code in this process (a StopFlag it installs, a handler of the
    export tool's) must not decide how a later test's signal is handled: order-dependent
    results (a Ctrl-C test passing alone and failing in the whole suite)."""
    before = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
    yield
    for sig, handler in before.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)


def pytest_collection_modifyitems(config, items):
    """``long`` tests (extra drill variants) run only with FTRAIN_LONG=1: CI keeps one of each."""
    if os.environ.get("FTRAIN_LONG") == "1":
        return
    skip = pytest.mark.skip(reason="long mode: set FTRAIN_LONG=1 to run it")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
