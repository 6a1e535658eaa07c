"""``python -m ftrain.eval RUN [--step N] [--json] [KEY=VALUE ...]``: evaluate a checkpoint.

The implementation is :mod:`ftrain.cli.evaluate` (read it for what may be overridden).
"""

import sys

from ftrain._stdio import run_tool
from ftrain.cli.evaluate import evaluate_run, main

__all__ = ["evaluate_run", "main"]

if __name__ == "__main__":
    sys.exit(run_tool(main, "ftrain.eval"))
