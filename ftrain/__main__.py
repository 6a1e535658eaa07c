"""``python -m ftrain`` — see :mod:`ftrain.cli.run`."""

import sys

from ftrain.cli.run import main

if __name__ == "__main__":
    sys.exit(main())
