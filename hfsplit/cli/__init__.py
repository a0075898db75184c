"""Command line: `hfsplit` (`commands`: named without loading them), `hfsplit plan` (`plan`) and its memory chart
(`charts`)."""
from hfsplit.cli.commands import main

__all__ = ["main"]
