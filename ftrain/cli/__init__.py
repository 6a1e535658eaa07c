"""The command-line job: ``python -m ftrain [+recipe=NAME] [overrides]``."""
