"""The embedded server's password: a random secret in a pgpass file (mode 0600).

The file is libpq's own format, so the DSN Pepsi hands around names it with
`passfile=` and the secret never appears in a DSN, an environment or a log.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

PASSFILE_NAME = "pepsi.pgpass"
SECRET_BYTES = 32  # 256 bits, 43 URL-safe characters: no ':' or '\' to escape


def passfile_path(data_dir: Path) -> Path:
    return data_dir / PASSFILE_NAME


def read_secret(path: Path) -> str | None:
    """The password of the file's first entry, or None if there is no file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            return line.rsplit(":", 1)[-1]
    raise ValueError(f"{path} holds no password entry")


def ensure_secret(path: Path, user: str) -> tuple[str, bool]:
    """The secret in `path`, created first if missing; True if it was created now.

    Written to a private temporary file and linked into place, so a reader
    never sees a partial file and two writers cannot both win.
    """
    import secrets  # noqa: PLC0415  # only when creating; a worker imports this module

    existing = read_secret(path)
    if existing is not None:
        return existing, False
    secret = secrets.token_urlsafe(SECRET_BYTES)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(f"*:*:*:{user}:{secret}\n")
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            found = read_secret(path)
            assert found is not None
            return found, False
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
    _fsync_dir(path.parent)
    return secret, True


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
