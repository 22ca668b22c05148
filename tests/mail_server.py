"""A real `pepsi ingress --serve` process for the mail tests, and small SMTP helpers."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.scenarios.conftest import REPO, wait_until

BASE = """[pepsi-postgres]
CONNECT_TIMEOUT = 2s
[pepsi-ingress]
{listen}STAGE = inbox
DOMAINS = example.com
HOSTNAME = mx.test
{ingress}
[stage-inbox]
HANDLER = tests.stages:noop
{stages}
"""


class IngressProcess:
    """One ingress process on a test's database; `smtp` is its (host, port)."""

    def __init__(
        self,
        dsn: str,
        tmp: Path,
        ingress: str = "",
        stages: str = "",
        name: str = "ingress",
        *,
        conf: str | None = None,  # the whole configuration instead
    ) -> None:
        self.dsn = dsn
        self.conf = tmp / f"{name}.conf"
        listen = "" if re.search(r"^LISTEN\b", ingress, re.MULTILINE) else "LISTEN = 127.0.0.1:0\n"
        self.conf.write_text(
            conf if conf is not None else BASE.format(listen=listen, ingress=ingress, stages=stages)
        )
        self.log_path = tmp / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.addresses: dict[str, tuple[str, int] | str] = {}

    def env(self) -> dict[str, str]:
        return {**os.environ, "PEPSI_DSN": self.dsn, "PYTHONPATH": str(REPO)}

    def start(self) -> IngressProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pepsi", "-c", str(self.conf), "ingress", "--serve"],
                env=self.env(),
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        proc = self.proc
        line = wait_until(
            lambda: self._accepting() or proc.poll() is not None, what="the ingress to listen"
        )
        assert isinstance(line, str), f"the ingress exited {proc.returncode}:\n{self.log}"
        self.addresses = {}
        for kind, where in re.findall(r"(smtp|lmtp) (\S+?)(?:,|$)", line):
            if where.startswith("/"):
                self.addresses[kind] = where
            else:
                host, _, port = where.rpartition(":")
                self.addresses[kind] = (host.strip("[]"), int(port))
        return self

    def _accepting(self) -> str | None:
        found = re.findall(r"accepting mail for stage \S+ on (.*)", self.log)
        return found[-1] if found else None

    @property
    def smtp(self) -> tuple[str, int]:
        address = self.addresses["smtp"]
        assert isinstance(address, tuple)
        return address

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss(self) -> int:
        return int(psutil.Process(self.pid).memory_info().rss)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Line:
    """A raw SMTP connection: send bytes, read reply lines (a multi-line reply whole)."""

    def __init__(self, address: tuple[str, int] | str, source: str | None = None) -> None:
        if isinstance(address, str):
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect(address)
        else:
            self.sock = socket.create_connection(
                address, timeout=30, source_address=(source, 0) if source else None
            )
        self.sock.settimeout(30)
        self.file = self.sock.makefile("rb")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reply(self) -> list[str]:
        """One reply: its lines, decoded (the last has a space after the code)."""
        lines = []
        while True:
            raw = self.file.readline()
            if not raw:
                raise ConnectionError(f"closed after {lines}")
            line = raw.decode("utf-8").rstrip("\r\n")
            lines.append(line)
            if len(line) < 4 or line[3] != "-":
                return lines

    def command(self, text: str) -> list[str]:
        self.send(text.encode() + b"\r\n")
        return self.reply()

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def queued_id(reply: bytes | str) -> int:
    """The workqueue id in `250 2.0.0 Queued as ID`."""
    text = reply.decode() if isinstance(reply, bytes) else reply
    found = re.search(r"Queued as (\d+)", text)
    assert found is not None, text
    return int(found.group(1))


def message(subject: str = "hello", body: str = "Hello there.\r\n", **headers: str) -> bytes:
    lines = [f"Subject: {subject}", "From: Alice <alice@sender.org>", "To: bob@example.com"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n" + body).encode()


def outside_address() -> str | None:
    """An IPv4 address of this machine that is not loopback, if it has one."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return str(address.address)
    return None


def add_user(server: IngressProcess, name: str, password: str) -> None:
    """`pepsi mail user add NAME --password-stdin` on the server's database."""
    subprocess.run(
        [sys.executable, "-m", "pepsi", "-c", str(server.conf), "mail", "user", "add", name,
         "--password-stdin"],
        input=password.encode(), env=server.env(), cwd=REPO, check=True, capture_output=True,
    )  # fmt: skip


def make_certificate(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for host `name` (its CN and SAN), and its key."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed (scripts/dev.py installs it)")
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
         f"/CN={name}", "-addext", f"subjectAltName=DNS:{name}", "-keyout", str(key),
         "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key
