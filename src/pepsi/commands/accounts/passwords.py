"""What the commands that set a password share: `--password-stdin`, the prompt, JSON lists.

Used by `pepsi amqp user`, `pepsi mail user` and `pepsi web password`.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from collections.abc import Sequence
from typing import Any

from pepsi.errors import UsageError


def password_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--password-stdin",
        action="store_true",
        help="read the password from standard input instead of asking on the terminal",
    )


def read_password(from_stdin: bool) -> str:
    """The new password: standard input with --password-stdin, else asked twice."""
    if from_stdin:
        text = sys.stdin.read()
        return text.removesuffix("\n").removesuffix("\r")
    if not sys.stdin.isatty():
        # getpass would fall back to reading a pipe with a warning: say what to do instead.
        raise UsageError("no terminal to ask for the password on: use --password-stdin")
    first = getpass.getpass("Password: ")
    if getpass.getpass("Password again: ") != first:
        raise UsageError("the passwords differ; nothing was changed")
    return first


def dump_json(items: Sequence[Any]) -> None:
    """Items that have `as_dict()`, as a JSON list on standard output."""
    json.dump([item.as_dict() for item in items], sys.stdout, indent=2)
    sys.stdout.write("\n")
