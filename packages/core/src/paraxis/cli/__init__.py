"""Layer 7, the ``paraxis`` command line: ``validate``, ``train``, ``plan``,
``checkpoint`` and the commands plugins add. Imports every layer below it."""

from paraxis.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
