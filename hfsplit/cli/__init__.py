"""Command line: `hfsplit` (`commands`: named without loading them), `hfsplit plan` (`plan`) and the pictures of a
plan (`charts`)."""
from hfsplit.cli.commands import main

__all__ = ["main"]
