"""The console's token when it has no PASSWORD, as Jupyter's: drawn at each start, kept in
a file only its owner can read, carried once in the URL and exchanged for a session.

Each running console (`pepsi web`, or a dispatcher's) writes `console-PID-PORT.json`
(0600) in a private folder (0700) beside the embedded server's default data
(`~/.local/share/pepsi/web`, or under `$XDG_DATA_HOME`), and removes it when it
stops; `pepsi web url` prints the links of those whose process still runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

from pepsi.config.model import default_data_dir
from pepsi.db.socketdir import make_private

QUERY = "token"  # the query parameter that carries it


def folder() -> Path:
    return default_data_dir().parent / "web"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def link(url: str, token: str) -> str:
    """The console's `url` with the token that logs in."""
    return f"{url}?{urlencode({QUERY: token})}"


@dataclass(frozen=True)
class Console:
    """One running console, as its file describes it."""

    pid: int
    link: str
    by: str  # `pepsi web`, `pepsi dispatch`


def publish(console: Console, port: int, where: Path | None = None) -> Path:
    """Write `console`'s file, readable by its owner only; its path."""
    base = where or folder()
    base.parent.mkdir(parents=True, exist_ok=True)
    make_private(base, os.geteuid(), os.getegid(), "console token folder")
    path = base / f"console-{console.pid}-{port}.json"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a file of an earlier process that had this pid
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        json.dump({"pid": console.pid, "link": console.link, "by": console.by}, out)
    return path


def running(where: Path | None = None) -> list[Console]:
    """The consoles whose process still runs, oldest file first; the others' files go."""
    base = where or folder()
    if not base.is_dir():
        return []
    found = []
    for path in sorted(base.glob("console-*.json"), key=lambda p: p.stat().st_mtime):
        try:
            data = json.loads(path.read_text())
            console = Console(int(data["pid"]), str(data["link"]), str(data["by"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(console.pid):
            found.append(console)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge
    return True
