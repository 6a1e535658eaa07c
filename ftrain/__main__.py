"""``python -m ftrain`` — see :mod:`ftrain.cli.run`."""

from ftrain.cli.run import console_main

if __name__ == "__main__":
    console_main()
