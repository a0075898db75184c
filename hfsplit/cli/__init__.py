"""Command line: `hfsplit plan` (`plan`) and its memory chart (`charts`)."""
from hfsplit.cli.plan import main

__all__ = ["main"]
