"""The SMTP protocol layer's own CPU a message, with nothing stored: where the ingress's goes.

    .venv/bin/python bench/smtp_floor.py [--messages 10000] [--sessions 20] [--size 1024]
                                         [--rounds 2]

Each receiver runs in a process of its own on uvloop (as `pepsi ingress --serve`
does) and answers `250` to every message without storing it; Postfix's
`smtp-source -s SESSIONS -m MESSAGES -l SIZE` (one message a connection) drives it:

- **pepsi-session**: the ingress's own session (`pepsi.mail.ingress.session`, on
  aiosmtpd) with everything but the commit: admission, the relay policy, the
  message and its Received field built, then a committer that answers at once;
- **aiosmtpd**: aiosmtpd's stock `SMTP` with a handler that accepts each message;
- **protocol**: a bare `asyncio.Protocol` that answers each command line and the end
  of DATA, parsing nothing: the floor of Python, the event loop and the sockets.

The CPU of the receiving process (from /proc) per message, rounds alternating; the
full ingress adds the publish (see bench/mail.py, whose Postfix column is the bar).
Needs Debian's `postfix` package (smtp-source). Prints one JSON document and a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

HERE = Path(__file__).resolve().parent
KINDS = ("pepsi-session", "aiosmtpd", "protocol")
EHLO = b"250-floor\r\n250-PIPELINING\r\n250-SIZE 26214400\r\n250-8BITMIME\r\n250 SMTPUTF8\r\n"
REPLIES = {b"MAIL": b"250 2.1.0 Ok\r\n", b"RCPT": b"250 2.1.5 Ok\r\n", b"RSET": b"250 Ok\r\n"}


class Bare(asyncio.Protocol):
    """Answers each command line and the end of DATA; parses nothing."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.lines = b""
        self.data: bytes | None = None
        self.transport.write(b"220 floor ESMTP\r\n")

    def data_received(self, chunk: bytes) -> None:
        if self.data is not None:
            self.data += chunk
            if b"\r\n.\r\n" not in self.data:
                return
            _, _, rest = self.data.partition(b"\r\n.\r\n")
            self.data = None
            self.transport.write(b"250 2.0.0 Ok: queued\r\n")
            chunk = rest
        self.lines += chunk
        while self.data is None and b"\r\n" in self.lines:
            line, _, self.lines = self.lines.partition(b"\r\n")
            verb = line[:4].upper()
            if verb in (b"EHLO", b"HELO"):
                self.transport.write(EHLO)
            elif verb == b"DATA":
                self.transport.write(b"354 End data with <CR><LF>.<CR><LF>\r\n")
                self.data, self.lines = b"\r\n" + self.lines, b""
                self.data_received(b"")
            elif verb == b"QUIT":
                self.transport.write(b"221 2.0.0 Bye\r\n")
                self.transport.close()
                return
            else:
                self.transport.write(REPLIES.get(verb, b"250 Ok\r\n"))


class AcceptAll:
    """aiosmtpd's handler: every message accepted."""

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802
        return "250 2.0.0 Ok: queued"


class AnswerAtOnce:
    """The ingress's committer, without the database: every message '250 … queued'."""

    def __init__(self, queued: Any) -> None:
        self.queued = queued  # pepsi.mail.protocol.replies.queued
        self.stored = 0

    async def commit(self, message: Any, queue_id: str) -> tuple[Any, int]:
        self.stored += 1
        return self.queued(self.stored), self.stored


async def serve(kind: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    logging.getLogger("mail.log").setLevel(logging.WARNING)  # as the ingress runs it
    if kind == "protocol":
        server = await loop.create_server(Bare, "127.0.0.1", port, backlog=1024)
    elif kind == "aiosmtpd":
        from aiosmtpd.smtp import SMTP  # noqa: PLC0415

        server = await loop.create_server(
            lambda: SMTP(AcceptAll(), hostname="floor.test"), "127.0.0.1", port, backlog=1024
        )
    else:
        from pepsi.config.model import IngressOptions  # noqa: PLC0415
        from pepsi.mail.ingress.connection import Ingress, skip_dropped_command_logs  # noqa: PLC0415
        from pepsi.mail.ingress.session import SmtpSession  # noqa: PLC0415
        from pepsi.mail.protocol import replies  # noqa: PLC0415

        async def no_login(name: str, password: bytes) -> bool:
            return False

        skip_dropped_command_logs()
        ingress = Ingress(
            options=IngressOptions(stage="inbox", domains=("example.com",)),
            stage="inbox",
            hostname="floor.test",
            committer=AnswerAtOnce(replies.queued),  # type: ignore[arg-type]  # stubbed
            check_login=no_login,
        )
        server = await loop.create_server(
            lambda: SmtpSession(ingress), "127.0.0.1", port, backlog=1024
        )
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def one_run(kind: str, source: str, args: argparse.Namespace) -> dict[str, Any]:
    from common import process_cpu  # noqa: PLC0415  # not in the receivers' processes

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)])}
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--serve", kind, str(port)],
        stdout=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {kind} receiver did not start")
        before, start = process_cpu(proc.pid), time.perf_counter()
        subprocess.run(
            [source, "-s", str(args.sessions), "-m", str(args.messages), "-l", str(args.size),
             "-f", "load@sender.example", "-t", "bob@example.com", f"127.0.0.1:{port}"],
            check=True,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        cpu = process_cpu(proc.pid) - before
    finally:
        proc.terminate()
        proc.wait(10)
    return {
        "per_s": round(args.messages / seconds),
        "cpu_s": round(cpu, 2),
        "cpu_us_per_message": round(cpu / args.messages * 1e6),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=10000)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        kind, port = args.serve
        from pepsi import eventloop  # noqa: PLC0415

        eventloop.run(serve(kind, int(port)))
        return 0
    source = shutil.which("smtp-source") or shutil.which("smtp-source", path="/usr/sbin")
    if source is None:
        print("smtp-source is missing: apt-get install postfix", file=sys.stderr)
        return 2
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for n in range(args.rounds):
        for kind in KINDS if n % 2 == 0 else reversed(KINDS):
            runs[kind].append(one_run(kind, source, args))
    medians = {
        kind: statistics.median(r["cpu_us_per_message"] for r in found)
        for kind, found in runs.items()
    }
    summary = {"messages": args.messages, "sessions": args.sessions, "size": args.size}
    print(json.dumps({**summary, "runs": runs, "cpu_us_median": medians}, indent=2))
    line = ", ".join(f"{kind} {medians[kind]:.0f}" for kind in KINDS)
    print(f"SUMMARY cpu µs a message (median): {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
