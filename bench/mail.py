"""Mail in: Pepsi's SMTP ingress against Postfix, under `smtp-source`, in one run.

    .venv/bin/python bench/mail.py [--messages 20000] [--sessions 20] [--size 1024] [--rounds 3]

The load is Postfix's own generator, `smtp-source -s SESSIONS -m MESSAGES -l SIZE`
(one message per connection, as smtp-source sends them), against:

- **Pepsi**: `pepsi ingress --serve` at its defaults (only LISTEN, STAGE,
  DOMAINS) feeding a one-stage pipeline (`pepsi-stage-discard`) with the
  dispatcher running, on the embedded server (or $PEPSI_DSN's) in a scratch
  database. Each `250` is a row committed with synchronous_commit on.
- **Postfix** as Debian ships it (its main.cf and master.cf, chroot and all),
  as a second instance in a temporary directory: smtpd on its own port,
  `relayhost` pointing at `smtp-sink`, logging to a file (`maillog_file`).
  Postfix's `250` comes after cleanup's fsync of the queue file.

Rate = messages accepted per second, from smtp-source's start to its end; each
round runs both, alternately (Pepsi first in odd rounds). CPU seconds per
component come from /proc, over the whole phase. Needs Debian's `postfix`
package (smtp-source, smtp-sink) and root (Postfix's queue is owned by user
postfix). Prints one JSON document and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import psycopg
from common import scratch_database

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DB = "pepsi_bench_mail"
SENDER, RECIPIENT = "load@sender.example", "bob@example.com"


POSTFIX_TOOLS = ("smtp-source", "smtp-sink", "postfix", "postconf", "postqueue")


def tool(name: str) -> str:
    """The absolute path of one of Postfix's programs."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
    if found is None:
        raise SystemExit(f"bench/mail.py: {name} not found (apt-get install postfix)")
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"bench/mail.py: timed out waiting for {what}")
        time.sleep(0.05)


def cpu_seconds(processes: list[psutil.Process]) -> dict[int, float]:
    """CPU seconds of each process, its reaped children's included."""
    found = {}
    for proc in processes:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        found[proc.pid] = times.user + times.system + times.children_user + times.children_system
    return found


def cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU spent between two readings: a process started in between counts whole; one that
    ended in between counts in its parent's reaped children."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def smtp_source(port: int, messages: int, sessions: int, size: int) -> float:
    """Seconds smtp-source took; it exits non-zero on any reply it did not expect."""
    started = time.monotonic()
    subprocess.run(
        [tool("smtp-source"), "-s", str(sessions), "-m", str(messages), "-l", str(size),
         "-f", SENDER, "-t", RECIPIENT, f"127.0.0.1:{port}"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return time.monotonic() - started


class PepsiMail:
    """The dispatcher and one ingress on a scratch database, at their defaults."""

    def __init__(self, tmp: Path) -> None:
        self.dsn = scratch_database(DB)
        self.port = free_port()
        self.conf = tmp / "pepsi-mail.conf"
        self.conf.write_text(
            "[pepsi-ingress]\n"
            f"LISTEN = 127.0.0.1:{self.port}\nSTAGE = inbox\nDOMAINS = example.com\n"
            "[stage-inbox]\nPROGRAM = pepsi-stage-discard\n"
        )
        env = {**os.environ, "PEPSI_DSN": self.dsn, "PYTHONPATH": str(REPO / "src")}
        self.logs = tmp
        self.dispatcher = self._start(["dispatch", "serve"], "dispatch", env, "dispatching")
        self.ingress = self._start(["ingress", "--serve"], "ingress", env, "accepting mail")
        self.db = psycopg.connect(self.dsn, autocommit=True)
        row = self.db.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        self.postmaster = psutil.Process(int(row[0])).parent()

    def _start(self, args: list[str], name: str, env: dict[str, str], ready: str) -> Any:
        log = self.logs / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pepsi", "-c", str(self.conf), *args],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        wait_for(lambda: ready in log.read_text() or proc.poll() is not None, 60, name)
        if proc.poll() is not None:
            raise SystemExit(f"bench/mail.py: pepsi {name} exited:\n{log.read_text()}")
        return proc

    def components(self) -> dict[str, list[psutil.Process]]:
        assert self.postmaster is not None
        return {
            "ingress": tree(self.ingress.pid),
            "dispatcher+workers": tree(self.dispatcher.pid),
            "postgresql": tree(self.postmaster.pid),
        }

    def drained(self) -> bool:
        row = self.db.execute("SELECT count(*) FROM pepsi.workqueue").fetchone()
        return row is not None and row[0] == 0

    def close(self) -> str:
        """Stop both; the ingress's last line (messages stored, commits)."""
        for proc in (self.ingress, self.dispatcher):
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        self.db.close()
        lines = (self.logs / "ingress.log").read_text().splitlines()
        return next((line for line in reversed(lines) if "stopped:" in line), "")


class Postfix:
    """A second Postfix instance, configured as Debian ships the first, relaying to smtp-sink."""

    def __init__(self, tmp: Path) -> None:
        self.root = tmp / "postfix"
        etc, spool, data = self.root / "etc", self.root / "spool", self.root / "data"
        for folder in (etc, spool, data):
            folder.mkdir(parents=True)
        shutil.chown(data, "postfix")
        for name in ("main.cf", "master.cf", "dynamicmaps.cf"):
            shutil.copy(Path("/etc/postfix") / name, etc / name)
        self.port, self.sink_port = free_port(), free_port()
        self.sink = subprocess.Popen(
            [tool("smtp-sink"), "-u", "postfix", f"127.0.0.1:{self.sink_port}", "1000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.postconf(
            "-e", f"queue_directory={spool}", f"data_directory={data}",
            f"relayhost=[127.0.0.1]:{self.sink_port}", "inet_interfaces=127.0.0.1",
            "inet_protocols=ipv4", "mydestination=", "alias_maps=", "alias_database=",
            "syslog_name=postfix-bench", f"maillog_file={self.root}/maillog",
            f"maillog_file_prefixes=/var, /dev/stdout, {self.root}",
        )  # fmt: skip
        self.postconf("-M#", "smtp/inet")  # smtpd on a port of its own instead of 25
        service = f"127.0.0.1:{self.port}"
        self.postconf("-M", f"{service}/inet={service} inet n - y - - smtpd")
        started = subprocess.run(
            [tool("postfix"), "-c", str(etc), "start"], capture_output=True, text=True, check=False
        )
        if started.returncode != 0:
            log = (self.root / "maillog").read_text() if (self.root / "maillog").exists() else ""
            raise SystemExit(f"bench/mail.py: postfix did not start:\n{started.stderr}{log}")
        wait_for(self._listening, 30, "postfix to listen")

    def postconf(self, *args: str) -> None:
        subprocess.run([tool("postconf"), "-c", str(self.root / "etc"), *args], check=True)

    def _listening(self) -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", self.port)) == 0

    def components(self) -> dict[str, list[psutil.Process]]:
        """Postfix's master and every process it started (taken again each phase: they
        come and go), and smtp-sink."""
        pid = int((self.root / "spool" / "pid" / "master.pid").read_text().split()[0])
        return {"postfix": tree(pid), "smtp-sink": tree(self.sink.pid)}

    def drained(self) -> bool:
        out = subprocess.run(
            [tool("postqueue"), "-c", str(self.root / "etc"), "-p"], capture_output=True, text=True,
            check=False,
        )  # fmt: skip
        return "Mail queue is empty" in out.stdout

    def close(self) -> None:
        etc = str(self.root / "etc")
        subprocess.run([tool("postfix"), "-c", etc, "stop"], check=False, capture_output=True)
        self.sink.terminate()
        self.sink.wait(10)


def phase(system: Any, args: argparse.Namespace) -> dict[str, Any]:
    before = {name: cpu_seconds(procs) for name, procs in system.components().items()}
    seconds = smtp_source(system.port, args.messages, args.sessions, args.size)
    after = {name: cpu_seconds(procs) for name, procs in system.components().items()}
    cpu = {name: round(cpu_used(before[name], after[name]), 2) for name in after}
    drain_started = time.monotonic()
    wait_for(system.drained, 600, "the queue to drain")
    return {
        "seconds": round(seconds, 2),
        "rate": round(args.messages / seconds),
        "drain_after_s": round(time.monotonic() - drain_started, 2),
        "cpu_s": cpu,
        "cpu_ms_per_message": round(1000 * sum(cpu.values()) / args.messages, 3),
    }


@contextmanager
def systems(tmp: Path, summary: dict[str, str]) -> Iterator[tuple[PepsiMail, Postfix]]:
    pepsi = PepsiMail(tmp)
    try:
        postfix = Postfix(tmp)
        try:
            yield pepsi, postfix
        finally:
            postfix.close()
    finally:
        summary["ingress"] = pepsi.close().partition("pepsi-ingress: ")[2]


def run_rounds(pepsi: PepsiMail, postfix: Postfix, args: argparse.Namespace) -> list[Any]:
    warm = argparse.Namespace(**{**vars(args), "messages": 500})
    phase(pepsi, warm)
    phase(postfix, warm)
    rounds = []
    for number in range(args.rounds):
        order: list[tuple[str, Any]] = [("pepsi", pepsi), ("postfix", postfix)]
        if number % 2:
            order.reverse()
        rounds.append({name: phase(system, args) for name, system in order})
    return rounds


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for program in POSTFIX_TOOLS:
        tool(program)
    if os.geteuid() != 0:
        raise SystemExit("bench/mail.py: run as root (Postfix's queue belongs to user postfix)")
    summary: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="pepsi-bench-mail-") as tmp:
        Path(tmp).chmod(0o755)  # Postfix's own users walk into its queue
        with systems(Path(tmp), summary) as (pepsi, postfix):
            rounds = run_rounds(pepsi, postfix, args)
    pepsi_rates = [r["pepsi"]["rate"] for r in rounds]
    postfix_rates = [r["postfix"]["rate"] for r in rounds]
    ratios = [round(p / q, 2) for p, q in zip(pepsi_rates, postfix_rates, strict=True)]
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "load": f"smtp-source -s {args.sessions} -m {args.messages} -l {args.size}",
        "rounds": rounds,
        "pepsi_rate_median": statistics.median(pepsi_rates),
        "postfix_rate_median": statistics.median(postfix_rates),
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
        "ingress_commits": summary.get("ingress", ""),  # warm-up included
    }
    print(json.dumps(result, indent=2))
    print(
        f"mail in: Pepsi {result['pepsi_rate_median']} msg/s, Postfix "
        f"{result['postfix_rate_median']} msg/s (median of {args.rounds}); Pepsi/Postfix "
        f"{result['ratio_median']} (rounds: {', '.join(map(str, ratios))})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
