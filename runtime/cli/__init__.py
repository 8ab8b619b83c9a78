"""The `xpod` command (`runtime.cli.main`): one module per command, the shared flag groups
(`flags`, `engine_flags`) and the argparse types (`argtypes`). The only part of `runtime` that
may import every other part, and `bench` (by name, through the command table)."""

from runtime.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
