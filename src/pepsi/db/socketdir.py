"""Where the embedded server's Unix socket lives: a directory only its user can enter.

The data directory (0700) when the socket's path fits in a socket address;
otherwise `/tmp/pepsi-<hash>`, created 0700 for the server's user, and
refused if someone else made it first.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path

SOCKET_NAME = ".s.PGSQL.5432"
SOCKET_PATH_MAX = 107  # bytes: sun_path holds 108 with the terminating NUL


def choose(data_dir: Path, uid: int, gid: int) -> Path:
    """The socket directory for a server of user `uid` in `data_dir`, made private."""
    if fits(data_dir) and is_private(data_dir, uid):
        return data_dir
    digest = hashlib.sha256(f"{uid}:{data_dir}".encode()).hexdigest()[:16]
    for base in dict.fromkeys((Path(tempfile.gettempdir()), Path("/tmp"))):  # noqa: S108
        candidate = base / f"pepsi-{digest}"
        if fits(candidate):
            make_private(candidate, uid, gid)
            return candidate
    raise RuntimeError("no directory short enough for the server's Unix socket")


def fits(directory: Path) -> bool:
    return len(os.fsencode(directory / SOCKET_NAME)) <= SOCKET_PATH_MAX


def is_private(directory: Path, uid: int) -> bool:
    found = os.lstat(directory)
    return stat.S_ISDIR(found.st_mode) and found.st_uid == uid and not found.st_mode & 0o077


def make_private(directory: Path, uid: int, gid: int, what: str = "socket directory") -> None:
    """Create `directory` 0700 for `uid`, or accept it only if it already is so."""
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    else:
        if uid != os.geteuid():
            os.chown(directory, uid, gid)
    if not is_private(directory, uid):
        found = os.lstat(directory)
        raise RuntimeError(
            f"the {what} {directory} is not private (owner uid {found.st_uid}, "
            f"mode {stat.S_IMODE(found.st_mode):o}); remove it"
        )


def tighten(directory: Path, uid: int, gid: int) -> None:
    """Make a running server's socket directory private where it is, if ours."""
    if is_private(directory, uid):
        return
    found = os.lstat(directory)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid not in (uid, os.geteuid()):
        raise RuntimeError(
            f"the running server's socket directory {directory} belongs to uid "
            f"{found.st_uid}; stop the server (pepsi db stop) to start it in a private one"
        )
    if found.st_uid != uid:
        os.chown(directory, uid, gid, follow_symlinks=False)
    directory.chmod(0o700)
