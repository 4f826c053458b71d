"""The consoles of hx's commands and scripts, and tables printed whole (rich only: importing
this starts no JAX, so scripts that only plan or simulate can use it)."""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.table import Table

out = Console()
err = Console(stderr=True)


def print_table(table: Table, stderr: bool = False) -> None:
    """Print a table on stdout or, for reports beside data written to stdout, on stderr, at
    least as wide as it needs (``rich.console.Console.measure``): piped, rich would squeeze it
    to 80 columns and cut cells ("SmolL…"); on a narrower terminal, lines wrap rather than
    lose text."""
    console = err if stderr else out
    needs = Console(width=10_000).measure(table).maximum
    Console(width=max(console.width, needs), stderr=stderr).print(table)


PIPED_HELP_WIDTH = 160  # columns of --help when no terminal tells rich a width


def widen_piped_help() -> None:
    """Let ``--help`` lines run to ``PIPED_HELP_WIDTH`` columns when stdout is not a terminal
    and neither ``COLUMNS`` nor ``TERMINAL_WIDTH`` is set: typer prints help with rich, which
    without a terminal falls back to 80 columns and cuts long defaults
    ("all-accelerator,all-host,stream-all,h…"). Sets typer's ``TERMINAL_WIDTH``; call it
    before the app runs (typer reads it when it first prints help)."""
    if not sys.stdout.isatty() and not {"COLUMNS", "TERMINAL_WIDTH"} & os.environ.keys():
        os.environ["TERMINAL_WIDTH"] = str(PIPED_HELP_WIDTH)
