"""Command line: ``python -m attnkit info | demo | ...``."""
