"""Suite-wide: the ``long`` marker's opt-in (for tests anywhere under tests/)."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    """``long`` tests (extra drill variants) run only with FTRAIN_LONG=1: CI keeps one of each."""
    if os.environ.get("FTRAIN_LONG") == "1":
        return
    skip = pytest.mark.skip(reason="long mode: set FTRAIN_LONG=1 to run it")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
