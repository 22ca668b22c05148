"""`pepsi systemd unit [dispatch|ingress]`: print pepsi-dispatch.service or pepsi-ingress.service.

The units ship in the package (pepsi/data/): Restart=always with no start
limit, restarts spaced from 2 s up to one a minute (RestartSteps=,
RestartMaxDelaySec=: systemd 254 or later) and a stop timeout longer than the
program's own shutdown. The dispatcher's (SPEC P-15) sends SIGTERM to the
dispatcher alone; the ingress's (docs/mail.md) may bind port 25 as an
unprivileged user. This command prints one with the paths of this
installation filled in:

  ExecStart=        PROGRAM -c CONFIG dispatch serve   (or: ingress --serve)
  EnvironmentFile=  the environment file (a leading '-': read only if it exists)
  User=             the user the program runs as

Install one with

  pepsi systemd unit | sudo tee /etc/systemd/system/pepsi-dispatch.service
  pepsi systemd unit ingress | sudo tee /etc/systemd/system/pepsi-ingress.service
  sudo systemctl daemon-reload && sudo systemctl enable --now pepsi-dispatch

See "Running under systemd" in docs/operations.md.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from importlib import resources
from pathlib import Path

from pepsi.commands import Context, summary
from pepsi.errors import EX_OK, UsageError

# The programs with a unit: their unit file and the arguments after `-c CONFIG`.
UNITS = {
    "dispatch": ("pepsi-dispatch.service", "dispatch serve"),
    "ingress": ("pepsi-ingress.service", "ingress --serve"),
}
UNIT_NAME = UNITS["dispatch"][0]  # the default unit
DEFAULT_CONFIG = Path("/etc/pepsi/pepsi.conf")
DEFAULT_ENVIRONMENT_FILE = "-/etc/default/pepsi"
DEFAULT_USER = "pepsi"
# What systemd accepts in User= without quoting: a name or a numeric id.
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
# A word of these characters needs no quoting on a systemd command line.
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def shipped_unit(program: str = "dispatch") -> str:
    """The unit of `program` as the package ships it (with its default paths)."""
    name = UNITS[program][0]
    return (resources.files("pepsi") / "data" / name).read_text(encoding="utf-8")


def default_executable() -> Path:
    """The `pepsi` next to the running interpreter (its venv), else the one on PATH."""
    # Not resolved: a venv's python is a symlink to the system's, its pepsi is not.
    beside = Path(sys.executable).parent / "pepsi"
    if beside.is_file():
        return beside.absolute()
    found = shutil.which("pepsi")
    if found is None:
        raise UsageError("no pepsi executable found beside Python or on PATH; give --exec PATH")
    return Path(found).absolute()


def render_unit(
    program: Path | str,
    config: Path | str,
    environment_file: str | None = DEFAULT_ENVIRONMENT_FILE,
    user: str | None = DEFAULT_USER,
    unit: str = "dispatch",
) -> str:
    """The shipped unit of `unit` (dispatch or ingress) with ExecStart=,
    EnvironmentFile= and User= set.

    Relative paths are taken from the current directory. `environment_file`
    may start with '-' (an optional file); None or "" drops EnvironmentFile=,
    as `user` None or "" drops User= (root).
    """
    config_word = quote_word(_absolute(config, "--config-file"))
    values = {
        "ExecStart": f"{_executable(program)} -c {config_word} {UNITS[unit][1]}",
        "EnvironmentFile": _environment_file(environment_file) if environment_file else None,
        "User": _user(user) if user else None,
    }
    lines = []
    replaced = set()
    for line in shipped_unit(unit).splitlines(keepends=True):
        key, equals, _ = line.partition("=")
        if not equals or key not in values:
            lines.append(line)
            continue
        replaced.add(key)
        if values[key] is not None:
            lines.append(f"{key}={values[key]}\n")
    # A shipped unit without one of these lines is a packaging bug, not a user's mistake.
    assert replaced == set(values), f"{UNITS[unit][0]} lacks {set(values) - replaced}"
    return "".join(lines)


def quote_word(word: str) -> str:
    """`word` as one argument of a systemd command line (systemd.syntax(7) quoting).

    '%' starts a specifier and '$' a variable in systemd, so both are doubled.
    """
    _refuse_control(word, "an argument")
    word = word.replace("%", "%%")
    if _PLAIN_WORD.fullmatch(word):
        return word
    escaped = word.replace("\\", "\\\\").replace('"', '\\"').replace("$", "$$")
    return f'"{escaped}"'


def _executable(program: Path | str) -> str:
    path = _absolute(program, "--exec")
    _refuse_control(path, "--exec")
    # systemd takes the program's path verbatim (no variables) and refuses these in it.
    if any(c in path for c in "\"'\\"):
        raise UsageError(f"--exec: systemd cannot run a path with quotes or backslashes: {path}")
    path = path.replace("%", "%%")
    return path if _PLAIN_WORD.fullmatch(path.replace("$", "")) else f'"{path}"'


def _environment_file(value: str) -> str:
    optional = value.startswith("-")
    path = _absolute(value[1:] if optional else value, "--environment-file")
    _refuse_control(path, "--environment-file")
    if path != path.strip():
        # systemd strips a setting's value: the name would change.
        raise UsageError(f"--environment-file: a path cannot end in whitespace: {path!r}")
    # The value is taken as it stands, without quotes; only specifiers are expanded.
    return ("-" if optional else "") + path.replace("%", "%%")


def _user(user: str) -> str:
    if not _USER.fullmatch(user):
        raise UsageError(f"--user: not a user name or id: {user!r}")
    return user


def _absolute(path: Path | str, option: str) -> str:
    """`path` from the current directory: systemd runs the unit from /."""
    if not str(path):
        raise UsageError(f"{option}: an empty path")
    return str(Path.cwd() / path)  # an absolute `path` replaces the directory


def _refuse_control(text: str, what: str) -> None:
    if _CONTROL.search(text):
        raise UsageError(f"{what}: a control character cannot go into a unit file: {text!r}")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("systemd", help=summary("systemd"))
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    unit = actions.add_parser(
        "unit",
        help="print pepsi-dispatch.service or pepsi-ingress.service with this installation's paths",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    unit.add_argument(
        "program",
        nargs="?",
        default="dispatch",
        choices=sorted(UNITS),
        metavar="PROGRAM",
        help="dispatch (default): the dispatcher's unit; ingress: the SMTP/LMTP server's",
    )
    unit.add_argument(
        "--config-file",
        metavar="PATH",
        help="the configuration the dispatcher reads (default: the global -c FILE, "
        f"else {DEFAULT_CONFIG})",
    )
    unit.add_argument(
        "--environment-file",
        metavar="PATH",
        default=DEFAULT_ENVIRONMENT_FILE,
        help="EnvironmentFile= of the unit, for variables such as PEPSI_DSN; a leading '-' "
        "(written --environment-file=-PATH) reads it only if it exists; '' for none "
        f"(default {DEFAULT_ENVIRONMENT_FILE})",
    )
    unit.add_argument(
        "--user",
        metavar="USER",
        default=DEFAULT_USER,
        help=f"the user the program runs as; '' for root (default {DEFAULT_USER})",
    )
    unit.add_argument(
        "--exec",
        metavar="PATH",
        help="the pepsi program (default: the one beside this Python, else on PATH)",
    )
    unit.set_defaults(handler=run_unit)


def run_unit(args: argparse.Namespace, ctx: Context) -> int:
    config = args.config_file if args.config_file is not None else ctx.config_path
    program = args.exec if args.exec is not None else default_executable()
    if config is None:
        config = DEFAULT_CONFIG
    sys.stdout.write(render_unit(program, config, args.environment_file, args.user, args.program))
    return EX_OK
