"""The telemetry switch (SPEC P-11): `[pepsi] SHARE_TELEMETRY` in the file, and who runs what.

`switch` rewrites the one line in the configuration file (every other byte
kept), then sends `NOTIFY telemetry_changed`: the dispatcher replaces its
live workers, and each new one installs its sink from the file. `status`
reads the file's value and counts the live workers that report (each worker
holds a shared advisory lock that says which; see `pepsi.worker.runtime`).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psycopg

from pepsi.config import Config
from pepsi.db.queries import query
from pepsi.errors import ConfigError

KEY = "SHARE_TELEMETRY"
SECTION = "pepsi"
APPLICATION_NAME = "pepsi-telemetry"
WORKER_PREFIX = "pepsi-worker:"
_SECTION = re.compile(r"^\s*\[([^\]]*)\]")
_KEY = re.compile(r"^(\s*)([A-Za-z0-9_]+)\s*[=:]")


@dataclass(frozen=True)
class StageWorkers:
    stage: str
    live: int
    reporting: int


def config_file(config: Config) -> Path:
    """The file to rewrite: the one the configuration was read from."""
    if config.path is None:
        raise ConfigError(f"no configuration file to write {KEY} in: give one with -c FILE")
    return config.path


def rewrite(text: str, on: bool) -> str:
    """`text` with `[pepsi] SHARE_TELEMETRY` set: that line replaced, or one line inserted.

    Every other line is kept byte for byte. Without a [pepsi] section, one
    is appended at the end.
    """
    value = "yes" if on else "no"
    lines = text.splitlines(keepends=True)
    section: str | None = None
    section_end: int | None = None  # after the last non-blank line of [pepsi]
    found = False
    for index, line in enumerate(lines):
        header = _SECTION.match(line)
        if header:
            section = header.group(1).strip()  # as the parser reads them: case matters
            if section == SECTION:
                section_end = index + 1
            continue
        if section != SECTION:
            continue
        key = _KEY.match(line)
        if key and key.group(2).upper() == KEY:
            ending = line[len(line.rstrip("\r\n")) :] or "\n"
            lines[index] = f"{key.group(1)}{KEY} = {value}{ending}"
            found = True
        elif line.strip() and not line.lstrip().startswith(("#", ";")):
            section_end = index + 1  # a comment further down may introduce the next section
    if found:
        return "".join(lines)
    newline = _newline(text)
    if section_end is not None:
        lines.insert(section_end, f"{KEY} = {value}{newline}")
        return "".join(lines)
    separator = "" if not text or text.endswith(("\n", "\r")) else newline
    blank = newline if text.strip() else ""
    return f"{text}{separator}{blank}[{SECTION}]{newline}{KEY} = {value}{newline}"


def _newline(text: str) -> str:
    return "\r\n" if "\r\n" in text else "\n"


def write_switch(path: Path, on: bool) -> bool:
    """Set the switch in `path`; False if it already said so (the file is left as it was)."""
    try:
        data = path.read_bytes()
        text = data.decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}", file=str(path)) from None
    except UnicodeDecodeError:
        raise ConfigError("not UTF-8 text: not rewritten", file=str(path)) from None
    new = rewrite(text, on)
    if new == text:
        return False
    _replace(path, new.encode("utf-8"))
    return True


def _replace(path: Path, data: bytes) -> None:
    """Write `data` to `path` at once: a worker starting meanwhile reads the old or the new."""
    target = path.resolve()  # a symlinked file is rewritten where it lives
    try:
        stat = target.stat()
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except PermissionError:  # a directory we may not write in: the file itself, in place
        _overwrite(path, target, data)
        return
    except OSError as exc:
        raise _unwritable(path, exc) from None
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        Path(tmp).chmod(stat.st_mode & 0o7777)
        with contextlib.suppress(OSError):  # only root can give it back to another owner
            os.chown(tmp, stat.st_uid, stat.st_gid)
        Path(tmp).replace(target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise _unwritable(path, exc) from None


def _overwrite(path: Path, target: Path, data: bytes) -> None:
    if not os.access(target, os.W_OK):
        raise _unwritable(path, PermissionError("permission denied"))
    try:
        target.write_bytes(data)
    except OSError as exc:
        raise _unwritable(path, exc) from None


def _unwritable(path: Path, exc: OSError) -> ConfigError:
    reason = exc.strerror or str(exc)
    return ConfigError(f"cannot write: {reason}; the switch is unchanged", file=str(path))


def notify_changed(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    """Tell the dispatcher: it replaces every live worker (P-11)."""
    conn.execute(query("telemetry_notify_changed"))


def live_workers(conn: psycopg.Connection[tuple[object, ...]]) -> list[StageWorkers]:
    """Live `pepsi worker` processes per stage, and how many of them report telemetry.

    A stage's own connections (named after it through PGAPPNAME) and the
    workers of PROGRAM stages hold no mark: they are not counted.
    """
    rows = conn.execute(query("telemetry_count_workers")).fetchall()
    return [
        StageWorkers(
            str(name).removeprefix(WORKER_PREFIX), int(str(on)) + int(str(off)), int(str(on))
        )
        for name, on, off in rows
    ]
