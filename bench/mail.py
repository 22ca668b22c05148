"""Mail in and mail through: Pepsi against Postfix, under `smtp-source`, in one run.

    .venv/bin/python bench/mail.py [--pipeline discard|relay|sign-relay] [--messages 20000]
                                   [--sessions 20] [--size 1024] [--rounds 3]

The load is Postfix's own generator, `smtp-source -s SESSIONS -m MESSAGES -l SIZE`
(one message per connection, as smtp-source sends them), against:

- **Pepsi**: `pepsi ingress --serve` at its defaults (LISTEN, STAGE, DOMAINS)
  with the dispatcher running, on the embedded server (or $PEPSI_DSN's) in a
  scratch database; each `250` is a committed row. Its pipeline (`--pipeline`):
  `discard` (the default: one `pepsi-stage-discard` stage), `relay`
  (`pepsi-stage-relay-to-smarthost` to `smtp-sink`) or `sign-relay`
  (`pepsi-stage-dkim-sign` with a 2048-bit key, then that relay).
- **Postfix** as Debian ships it (its main.cf and master.cf), a second
  instance (tests/postfix.py) relaying everything to the same `smtp-sink`.
  Its `250` comes after cleanup's fsync of the queue file.

Per phase: `accepted` = messages / the time smtp-source took; `end_to_end` =
messages / the time until the queue is empty again (every message finished:
discarded, or handed to smtp-sink). Rounds alternate who goes first. CPU
seconds per component come from /proc. Needs root and Debian's `postfix`
package (smtp-source, smtp-sink). Prints one JSON document and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import psycopg
from common import scratch_database

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))  # tests/postfix.py: the Postfix instance the tests use too

from tests import postfix  # noqa: E402

DB = "pepsi_bench_mail"
SENDER, RECIPIENT = "load@sender.example", "bob@example.com"


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


class Sink:
    """smtp-sink: takes every message and forgets it."""

    def __init__(self) -> None:
        self.port = postfix.free_port()
        self.proc = subprocess.Popen(
            [postfix.tool("smtp-sink") or "smtp-sink", "-u", "postfix",
             f"127.0.0.1:{self.port}", "1000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class PepsiMail:
    """The dispatcher and one ingress on a scratch database, at their defaults."""

    def __init__(self, tmp: Path, sink: Sink, *, pipeline: str) -> None:
        self.dsn = scratch_database(DB)
        self.port = postfix.free_port()
        self.conf = tmp / "pepsi-mail.conf"
        text = (
            "[pepsi-ingress]\n"
            f"LISTEN = 127.0.0.1:{self.port}\nSTAGE = inbox\nDOMAINS = example.com\n"
        )
        relay = (
            "PROGRAM = pepsi-stage-relay-to-smarthost\nHOST = 127.0.0.1\n"
            f"PORT = {sink.port}\nTLS = none\n"
        )
        if pipeline == "sign-relay":
            key = tmp / "dkim.key"
            subprocess.run(
                [postfix.tool("openssl") or "openssl", "genrsa", "-out", str(key), "2048"],
                check=True,
                capture_output=True,
            )
            text += (
                "[stage-inbox]\nPROGRAM = pepsi-stage-dkim-sign\nDOMAIN = example.com\n"
                f"SELECTOR = bench\nKEY_FILE = {key}\nNEXT = relay\n[stage-relay]\n{relay}"
            )
        elif pipeline == "relay":
            text += f"[stage-inbox]\n{relay}"
        else:
            text += "[stage-inbox]\nPROGRAM = pepsi-stage-discard\n"
        self.conf.write_text(text)
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
        postfix.wait_for(lambda: ready in log.read_text() or proc.poll() is not None, 60, name)
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
        # not count(*): polled every 50 ms, a scan of 20 000 rows would be Pepsi's CPU too
        row = self.db.execute("SELECT NOT EXISTS (SELECT 1 FROM pepsi.workqueue)").fetchone()
        return row is not None and bool(row[0])

    def close(self) -> tuple[str, str]:
        """Stop both; their last lines (messages stored, commits; claims, claim statements)."""
        for proc in (self.ingress, self.dispatcher):
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        self.db.close()
        return self._stopped("ingress"), self._stopped("dispatch")

    def _stopped(self, name: str) -> str:
        lines = (self.logs / f"{name}.log").read_text().splitlines()
        line = next((line for line in reversed(lines) if "stopped:" in line), "")
        return line.partition("stopped: ")[2]


class PostfixMail:
    """Postfix relaying everything to the sink, with Debian's restrictions (none added)."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.server = postfix.Postfix(
            relayhost=f"[127.0.0.1]:{sink.port}", settings={"smtpd_recipient_restrictions": ""}
        ).start()
        self.port = self.server.port

    def components(self) -> dict[str, list[psutil.Process]]:
        """Postfix's master and what it started (taken again each phase), and smtp-sink."""
        return {"postfix": tree(self.server.master_pid()), "smtp-sink": tree(self.sink.proc.pid)}

    def drained(self) -> bool:
        return self.server.queue_empty()

    def close(self) -> None:
        self.server.close()


def smtp_source(port: int, messages: int, sessions: int, size: int) -> float:
    """Seconds smtp-source took; it exits non-zero on any reply it did not expect."""
    started = time.monotonic()
    subprocess.run(
        [postfix.tool("smtp-source") or "smtp-source", "-s", str(sessions), "-m", str(messages),
         "-l", str(size), "-f", SENDER, "-t", RECIPIENT, f"127.0.0.1:{port}"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return time.monotonic() - started


def phase(system: Any, args: argparse.Namespace) -> dict[str, Any]:
    before = {name: cpu_seconds(procs) for name, procs in system.components().items()}
    started = time.monotonic()
    seconds = smtp_source(system.port, args.messages, args.sessions, args.size)
    postfix.wait_for(system.drained, 900, "the queue to drain")
    total = time.monotonic() - started
    after = {name: cpu_seconds(procs) for name, procs in system.components().items()}
    cpu = {name: round(cpu_used(before[name], after[name]), 2) for name in after}
    return {
        "accepted": round(args.messages / seconds),
        "end_to_end": round(args.messages / total),
        "seconds": round(seconds, 2),
        "drained_after_s": round(total - seconds, 2),
        "cpu_s": cpu,
        "cpu_ms_per_message": round(1000 * sum(cpu.values()) / args.messages, 3),
    }


@contextmanager
def systems(
    tmp: Path, summary: dict[str, str], *, pipeline: str
) -> Iterator[tuple[PepsiMail, PostfixMail]]:
    sink = Sink()
    try:
        pepsi = PepsiMail(tmp, sink, pipeline=pipeline)
        try:
            other = PostfixMail(sink)
            try:
                yield pepsi, other
            finally:
                other.close()
        finally:
            summary["ingress"], summary["dispatcher"] = pepsi.close()
    finally:
        sink.stop()


def run_rounds(pepsi: PepsiMail, other: PostfixMail, args: argparse.Namespace) -> list[Any]:
    warm = argparse.Namespace(**{**vars(args), "messages": 500})
    phase(pepsi, warm)
    phase(other, warm)
    rounds = []
    for number in range(args.rounds):
        order: list[tuple[str, Any]] = [("pepsi", pepsi), ("postfix", other)]
        if number % 2:
            order.reverse()
        rounds.append({name: phase(system, args) for name, system in order})
    return rounds


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--pipeline",
        choices=("discard", "relay", "sign-relay"),
        default="discard",
        help="Pepsi's stages after the ingress (default: discard)",
    )
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    problem = postfix.missing()
    if problem is not None or postfix.tool("smtp-source") is None:
        raise SystemExit(f"bench/mail.py: {problem or 'smtp-source is not installed'}")
    summary: dict[str, str] = {}
    with (
        tempfile.TemporaryDirectory(prefix="pepsi-bench-mail-") as tmp,
        systems(Path(tmp), summary, pipeline=args.pipeline) as (pepsi, other),
    ):
        rounds = run_rounds(pepsi, other, args)
    measure = "accepted" if args.pipeline == "discard" else "end_to_end"
    pepsi_rates = [r["pepsi"][measure] for r in rounds]
    postfix_rates = [r["postfix"][measure] for r in rounds]
    ratios = [round(p / q, 2) for p, q in zip(pepsi_rates, postfix_rates, strict=True)]
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "load": f"smtp-source -s {args.sessions} -m {args.messages} -l {args.size}",
        "pepsi_pipeline": args.pipeline,
        "measure": measure,
        "rounds": rounds,
        "pepsi_median": statistics.median(pepsi_rates),
        "postfix_median": statistics.median(postfix_rates),
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
        "ingress_commits": summary.get("ingress", ""),  # warm-up included
        "dispatcher_claims": summary.get("dispatcher", ""),
    }
    print(json.dumps(result, indent=2))
    what = "mail in" if args.pipeline == "discard" else f"mail through ({args.pipeline})"
    print(
        f"{what}, {measure}: Pepsi {result['pepsi_median']} msg/s, Postfix "
        f"{result['postfix_median']} msg/s (median of {args.rounds}); Pepsi/Postfix "
        f"{result['ratio_median']} (rounds: {', '.join(map(str, ratios))})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
