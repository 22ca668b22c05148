"""`pepsi` and its aliases (`pepsi-setup`, `pepsi-config`, …).

Global options come before the subcommand, everywhere: `pepsi -c FILE config
check`, `pepsi-setup -L debug schema`. A global flag after the subcommand is
rejected with one line rather than silently meaning something else. Every
user mistake ends in one line on stderr and an exit status, never a traceback.

`main()` is the boundary: a `PepsiError` is its one line and exit code; a
psycopg error that escapes a command is classified (`pepsi.errors.classify`:
74 lost, 75 busy) or, when the server refused a statement, one line with its
SQLSTATE (exit 1); Ctrl-C is 130. A bug (an exception that is none of these)
keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from pepsi import __version__
from pepsi.commands import Context, Handler, register
from pepsi.errors import (
    EX_ERROR,
    EX_INTERRUPTED,
    EX_OK,
    EX_USAGE,
    PepsiError,
    UsageError,
    classify,
    one_line,
)

log = logging.getLogger("pepsi.cli")

# Global options, as the pre-scan needs to know them.
_GLOBAL_VALUED = ("-c", "--config", "-L", "--log")
_GLOBAL_FLAGS = ("-v", "--verbose", "-V", "--version", "-h", "--help")
_LEVELS = ("debug", "info", "warning", "error", "critical")


def _global_token(token: str) -> str | None:
    """The global option `token` spells (in any of argparse's forms), else None."""
    for option in _GLOBAL_VALUED:
        if token == option or (option.startswith("--") and token.startswith(option + "=")):
            return option
        if not option.startswith("--") and token.startswith(option) and len(token) > 2:
            return option
    return token if token in _GLOBAL_FLAGS else None


def split_globals(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split argv into the global options and the rest (subcommand onwards)."""
    i = 0
    while i < len(argv):
        token = argv[i]
        option = _global_token(token)
        if option is None:
            break
        i += 2 if token in _GLOBAL_VALUED else 1
    return list(argv[:i]), list(argv[i:])


def reject_trailing_globals(rest: Sequence[str]) -> None:
    """A global option after the subcommand is an error (help excepted)."""
    for token in rest[1:]:
        if token == "--":
            return
        option = _global_token(token)
        if option is not None and option not in ("-h", "--help"):
            raise UsageError(
                f"global option {option} must come before the subcommand "
                f"(e.g. pepsi {option} ... {rest[0]} ...)"
            )


class Parser(argparse.ArgumentParser):
    """argparse, but a mistake is a UsageError (one line, exit 2) instead of usage + exit.

    Subcommand parsers are of this class too (argparse makes them `type(parent)`).
    """

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        # Python 3.11's argparse gives a one-value positional an empty list when a
        # second "--" ends the line (`... -- a b --`): a missing argument, not a crash.
        for action in self._actions:
            value = getattr(parsed, action.dest, None)
            if not action.option_strings and action.nargs is None and isinstance(value, list):
                self.error(f"argument {action.metavar or action.dest}: expected one argument")
        return parsed, extras


def build_parser(prog: str, command: str | None = None) -> argparse.ArgumentParser:
    """The parser of `pepsi`; only `command`'s module is imported (the others list by name)."""
    parser: argparse.ArgumentParser = Parser(
        prog=prog,
        description="Pepsi: a durable message pipeline stored in PostgreSQL.",
        epilog="Global options must precede the subcommand.",
    )
    parser.add_argument(
        "-c", "--config", metavar="FILE", type=Path, help="read configuration from FILE"
    )
    parser.add_argument(
        "-L",
        "--log",
        metavar="LEVEL",
        default="info",
        type=str.lower,
        choices=_LEVELS,
        help="log level: %(choices)s (default %(default)s)",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log from all sources, not only Pepsi"
    )
    parser.add_argument("-V", "--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    register(sub, command)
    return parser


def version_text() -> str:
    from pepsi.db.schema import build_version  # noqa: PLC0415

    return f"pepsi {__version__} (schema version {build_version()})"


# C0 controls, DEL and Unicode's line breaks, as escapes: a peer's text in a log line
# (an AMQP mechanism name, an SMTP command) cannot start a line of its own
_CONTROLS = {
    **{code: f"\\x{code:02x}" for code in (*range(0x20), 0x7F, 0x85)},
    0x0A: "\\n", 0x0D: "\\r", 0x09: "\t", 0x2028: "\\u2028", 0x2029: "\\u2029",
}  # fmt: skip


class OneLineFormatter(logging.Formatter):
    """Each record's message on one line: control characters escaped, whoever logged it;
    a traceback (exc_info) is appended as it is, below."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802  # logging's name
        record.message = record.message.translate(_CONTROLS)
        return super().formatMessage(record)


def setup_logging(level: str, verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    if not verbose:
        handler.addFilter(lambda record: record.name.split(".")[0] == "pepsi")
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def main(argv: Sequence[str] | None = None, *, command: str | None = None) -> int:
    """Entry point of `pepsi`; with `command`, of the alias `pepsi-<command>`."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    prog = f"pepsi-{command}" if command else "pepsi"
    try:
        head, rest = split_globals(args_in)
        if command:
            # `pepsi-setup -h` is the help of `pepsi setup`, not of `pepsi`.
            helps = [t for t in head if t in ("-h", "--help")]
            head = [t for t in head if t not in ("-h", "--help")]
            rest = [command, *rest, *helps]
        reject_trailing_globals(rest)
        parser = build_parser(prog, rest[0] if rest else None)
        args = parser.parse_args([*head, *rest])
        setup_logging(args.log, args.verbose)
        context = Context(prog=prog, config_path=args.config, verbose=args.verbose)
        handler: Handler = args.handler
        return handler(args, context)
    except PepsiError as exc:
        return _fail(prog, str(exc), exc.exit_code)
    except KeyboardInterrupt:
        return EX_INTERRUPTED
    except BrokenPipeError:
        return EX_ERROR
    except UnicodeEncodeError as exc:
        if exc.reason != "surrogates not allowed":
            raise
        # A byte string that is not UTF-8 (argv, a file name) reached text-only code.
        return _fail(prog, f"not valid UTF-8: {exc.object[exc.start : exc.end]!r}", EX_USAGE)
    except Exception as exc:
        code = _database_failure(prog, exc)
        if code is None:
            raise  # a bug: keep the traceback
        return code


def _database_failure(prog: str, exc: Exception) -> int | None:
    """A psycopg error that escaped a command, as one line; None if it is not one."""
    error = classify(exc)
    if error is not None:
        log.debug("database error: %r", exc)
        return _fail(prog, str(error), error.exit_code)
    import psycopg  # noqa: PLC0415  # only on this path: `pepsi --help` stays light

    sqlstate = exc.sqlstate if isinstance(exc, psycopg.Error) else None
    if sqlstate is None:
        return None  # not the server's answer: a client-side bug
    # The server refused a statement (a timeout, a permission): its words, not a traceback.
    log.debug("database error: %r", exc)
    return _fail(prog, f"database error (SQLSTATE {sqlstate}): {one_line(exc)}", EX_ERROR)


def _fail(prog: str, text: str, code: int) -> int:
    """Print `prog: text` as one line on stderr (undecodable bytes escaped); return `code`."""
    line = " ".join(text.splitlines()).encode("utf-8", "backslashreplace").decode("utf-8")
    print(f"{prog}: {line}", file=sys.stderr)
    return code


def _alias(command: str) -> Callable[[], int]:
    def entry() -> int:
        return main(command=command)

    entry.__name__ = f"main_{command}"
    return entry


main_setup = _alias("setup")
main_config = _alias("config")
main_dispatch = _alias("dispatch")
main_ingress = _alias("ingress")
main_failure_bouncer = _alias("failure-bouncer")
main_queue = _alias("queue")
main_settings = _alias("settings")
main_web = _alias("web")

__all__ = [
    "EX_OK",
    "main",
    "main_config",
    "main_dispatch",
    "main_failure_bouncer",
    "main_ingress",
    "main_setup",
]
