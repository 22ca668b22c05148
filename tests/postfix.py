"""A real Postfix, and a real name server, for the mail delivery tests and bench/mail.py.

`Postfix` is a second Postfix instance in a folder of its own, configured as
Debian ships the system's (its main.cf and master.cf, chroot and all), with
smtpd on a loopback port and what a test needs on top: mail for the test
domains delivered to a Maildir per recipient, an access map that can accept,
defer or refuse each recipient, or a relayhost. `Dnsmasq` serves MX, A and
TXT records on a loopback port. Both need root and Debian's packages
(postfix, dnsmasq-base), which scripts/dev.py installs; the tests skip
without them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

POSTFIX_TOOLS = ("postfix", "postconf", "postqueue")
NOBODY = 65534  # who the virtual delivery agent writes mailboxes as


def tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin")


def missing() -> str | None:
    """Why a Postfix cannot be run here, or None."""
    if os.geteuid() != 0:
        return "Postfix runs as root (its queue belongs to user postfix)"
    for name in (*POSTFIX_TOOLS, "dnsmasq"):
        if tool(name) is None:
            return f"{name} is not installed (scripts/dev.py installs postfix and dnsmasq-base)"
    if not Path("/etc/postfix/main.cf").exists():
        return "/etc/postfix/main.cf is missing"
    return None


T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(predicate: Callable[[], T], timeout: float, what: str) -> T:
    """Poll `predicate` until it returns something truthy (for tests' wait_until, without
    pytest: bench/mail.py uses it too)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


class Postfix:
    """One Postfix instance in a folder of its own, smtpd on 127.0.0.1:`port`.

    The folder is made in the system's temporary directory (Postfix's own
    users must walk into it, which pytest's private folders forbid) and
    removed by `close`.
    """

    def __init__(
        self,
        *,
        domains: Sequence[str] = (),
        relayhost: str | None = None,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        root = Path(tempfile.mkdtemp(prefix="pepsi-postfix-"))
        self.root = root
        self.etc, self.spool, self.data = root / "etc", root / "spool", root / "data"
        self.mail = root / "mail"
        for folder in (self.etc, self.spool, self.data, self.mail):
            folder.mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)
        shutil.chown(self.data, "postfix")
        os.chown(self.mail, NOBODY, NOBODY)
        for name in ("main.cf", "master.cf", "dynamicmaps.cf"):
            if (Path("/etc/postfix") / name).exists():
                shutil.copy(Path("/etc/postfix") / name, self.etc / name)
        self.port = free_port()
        (self.etc / "access").write_text("")
        values = {
            "queue_directory": str(self.spool),
            "data_directory": str(self.data),
            "inet_interfaces": "127.0.0.1",
            "inet_protocols": "ipv4",
            "mydestination": "",
            "alias_maps": "",
            "alias_database": "",
            "relayhost": relayhost or "",
            "syslog_name": f"postfix-test-{self.port}",
            "maillog_file": str(root / "maillog"),
            "maillog_file_prefixes": f"/var, /dev/stdout, {root}",
            "smtpd_recipient_restrictions": (
                f"check_recipient_access texthash:{self.etc}/access, permit_mynetworks, "
                "reject_unauth_destination"
            ),
        }
        if domains:
            values.update({
                "virtual_mailbox_domains": " ".join(domains),
                "virtual_mailbox_base": str(self.mail),
                # one Maildir for all (virtual(8) allows no $1 in its maps): each
                # delivery carries its recipient in Delivered-To:
                "virtual_mailbox_maps": "static:all/",
                "virtual_uid_maps": f"static:{NOBODY}",
                "virtual_gid_maps": f"static:{NOBODY}",
                "virtual_minimum_uid": "100",
            })  # fmt: skip
        values.update(settings or {})
        self.postconf("-e", *(f"{key}={value}" for key, value in values.items()))
        self.postconf("-M#", "smtp/inet")  # smtpd on a port of its own instead of 25
        service = f"127.0.0.1:{self.port}"
        self.postconf("-M", f"{service}/inet={service} inet n - y - - smtpd")

    def postconf(self, *args: str) -> None:
        subprocess.run([tool("postconf") or "postconf", "-c", str(self.etc), *args], check=True)

    def command(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [tool("postfix") or "postfix", "-c", str(self.etc), *args],
            capture_output=True, text=True, check=False,
        )  # fmt: skip

    def start(self) -> Postfix:
        started = self.command("start")
        if started.returncode != 0:
            raise RuntimeError(f"postfix did not start: {started.stderr}{self.log}")
        wait_for(self.listening, 30, "postfix to listen")
        return self

    def stop(self) -> None:
        self.command("stop")
        # the port closed and the master gone: a start right after must not find it running
        wait_for(
            lambda: not self.listening() and self.command("status").returncode != 0,
            30,
            "postfix to stop",
        )

    def close(self) -> None:
        """Stop it and remove its folder."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def listening(self) -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", self.port)) == 0

    def access(self, rules: Mapping[str, str]) -> None:
        """Each recipient's answer: OK, or a reply such as `450 4.2.0 later`.

        A running Postfix is restarted, not reloaded: each smtpd reads the table when it
        starts, and a reload leaves the one serving an open session (a relay's cached
        connection) answering from the old table.
        """
        (self.etc / "access").write_text("".join(f"{k} {v}\n" for k, v in rules.items()))
        if self.listening():
            self.stop()
            self.start()

    def mailbox(self, address: str) -> list[bytes]:
        """The messages delivered to `address` (by their Delivered-To:), oldest first."""
        wanted = address.lower()
        return [data for to, data in self._delivered() if to == wanted]

    def delivered(self) -> Counter[str]:
        """How many copies each address received (one pass over the mailbox)."""
        return Counter(to for to, _ in self._delivered())

    def _delivered(self) -> list[tuple[str, bytes]]:
        """(Delivered-To address, message) of every delivered message, oldest first."""
        folder = self.mail / "all" / "new"
        if not folder.exists():
            return []
        found = []
        for file in sorted(folder.iterdir(), key=lambda p: p.stat().st_mtime_ns):
            data = file.read_bytes()
            header = data.split(b"\n\n", 1)[0]
            to = next(
                (line[len(b"delivered-to:") :].strip() for line in header.lower().splitlines()
                 if line.startswith(b"delivered-to:")),
                b"",
            )  # fmt: skip
            found.append((to.decode(errors="replace"), data))
        return found

    def queue_empty(self) -> bool:
        """No queue file left (what `postqueue -p` lists, without its showq scan, whose CPU
        would count as Postfix's in bench/mail.py)."""
        for queue in ("maildrop", "incoming", "active", "deferred", "hold"):
            for _folder, _subfolders, files in os.walk(self.spool / queue):
                if files:
                    return False
        return True

    @property
    def log(self) -> str:
        path = self.root / "maillog"
        return path.read_text(errors="replace") if path.exists() else ""

    def master_pid(self) -> int:
        return int((self.spool / "pid" / "master.pid").read_text().split()[0])


class Dnsmasq:
    """A name server on 127.0.0.1:`port` that knows only what it is told."""

    def __init__(
        self,
        *,
        mx: Sequence[tuple[str, str, int]] = (),  # (domain, host, preference)
        hosts: Sequence[tuple[str, str]] = (),  # (name, address)
        txt: Sequence[tuple[str, str]] = (),  # (name, text)
    ) -> None:
        self.port = free_port()
        args = [
            tool("dnsmasq") or "dnsmasq", "--keep-in-foreground", "--no-resolv", "--no-hosts",
            "--no-poll", f"--port={self.port}", "--listen-address=127.0.0.1",
            "--bind-interfaces", "--pid-file", "--log-facility=-",
        ]  # fmt: skip
        args += [f"--mx-host={domain},{host},{preference}" for domain, host, preference in mx]
        args += [f"--host-record={name},{address}" for name, address in hosts]
        args += [f"--txt-record={name},{text}" for name, text in txt]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._answers, 30, "dnsmasq to answer")

    def _answers(self) -> bool:
        import dns.message  # noqa: PLC0415
        import dns.query  # noqa: PLC0415

        query = dns.message.make_query("ready.invalid", "A")
        try:
            dns.query.udp(query, "127.0.0.1", timeout=0.2, port=self.port)
        except (OSError, dns.exception.Timeout):
            return self.proc.poll() is not None  # it died: stop waiting (the test will fail)
        return True

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)
