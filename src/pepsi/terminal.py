"""Terminal output with rich: tables for people, unwrapped lines when piped."""

from __future__ import annotations

import sys

from rich import box
from rich.console import Console
from rich.table import Table

PIPED_WIDTH = 200  # when not a terminal, do not fold lines at rich's default 80


def console() -> Console:
    return Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)


def table(title: str, *columns: str) -> Table:
    result = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for column in columns:
        result.add_column(column, no_wrap=True)
    return result


def grid() -> Table:
    """Two columns of facts: a bold label and its value."""
    result = Table.grid(padding=(0, 2))
    result.add_column(style="bold")
    result.add_column()
    return result
