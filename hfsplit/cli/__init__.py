"""Command line: `hfsplit plan` (`plan`) and the pictures of a plan (`charts`)."""
from hfsplit.cli.plan import main

__all__ = ["main"]
