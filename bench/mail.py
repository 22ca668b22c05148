"""Mail in and mail through: Pepsi against Postfix, under `smtp-source`, in one run.

    .venv/bin/python bench/mail.py [--pipeline discard|relay|sign-relay] [--messages 20000]
                                   [--sessions 20] [--size 1024 | --message FILE]
                                   [--rounds 3] [--json FILE]

The load is Postfix's own generator, `smtp-source -s SESSIONS -m MESSAGES -l SIZE`
(one message per connection, as smtp-source sends them; with `--message FILE`,
`-F FILE`: that message, for example the 28 KB text one `bench/mail_message.py`
writes, instead of smtp-source's filler of a few repeated lines), against:

- **Pepsi**: `pepsi ingress --serve` at its defaults (LISTEN, STAGE, DOMAINS)
  with the dispatcher running, on the embedded server (or $PEPSI_DSN's) in a
  scratch database; each `250` is a committed row. Its pipeline (`--pipeline`):
  `discard` (the default: one `pepsi-stage-discard` stage), `relay`
  (`pepsi-stage-relay-to-smarthost` to `smtp-sink`) or `sign-relay`
  (`pepsi-stage-dkim-sign` with a 2048-bit key, then that relay).
- **Postfix** as Debian ships it (its main.cf and master.cf), a second
  instance (tests/postfix.py) relaying everything to the same `smtp-sink`.
  Its `250` comes after cleanup's fsync of the queue file.
- with `sign-relay`, also **Postfix + OpenDKIM** (like for like: Postfix
  signs too): the same Postfix with Debian's `opendkim` as its milter
  (`smtpd_milters`), signing relaxed/relaxed with its own 2048-bit key. Skipped,
  with a line saying so, when `opendkim` is not installed (`apt-get install
  opendkim`; a benchmark's peer, not a test's).

Per phase: `accepted` = messages / the time smtp-source took; `end_to_end` =
messages / the time until the queue is empty again (every message finished:
discarded, or handed to smtp-sink). Rounds alternate who goes first. CPU
seconds per component come from /proc; PostgreSQL's are split by the session
each backend serves (the ingress's publishes, the workers', the dispatcher's,
and the rest). Needs root and Debian's `postfix`
package (smtp-source, smtp-sink). Prints one JSON document (also to --json FILE)
and a summary: the rates, and each round's CPU a message against each peer's (the
steadier figure on a machine whose speed moves within a run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
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
from common import exclusive_run, scratch_database

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))  # tests/postfix.py: the Postfix instance the tests use too

from tests import postfix  # noqa: E402

DB = "pepsi_bench_mail"
# PostgreSQL's CPU by the application_name of the session a backend serves
SESSION_ROLES = {
    "pepsi-publish": "postgresql: ingress",
    "pepsi-worker": "postgresql: workers",
    "pepsi-dispatch": "postgresql: dispatcher",
    "pepsi-dispatch-listen": "postgresql: dispatcher",
    "pepsi-dispatch-vacuum": "postgresql: dispatcher",
}
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
        """Pepsi's processes, and PostgreSQL's by whose session they serve (the rest:
        the postmaster, its background processes, this script's polling session)."""
        assert self.postmaster is not None
        found: dict[str, list[psutil.Process]] = {
            "ingress": tree(self.ingress.pid),
            "dispatcher+workers": tree(self.dispatcher.pid),
        }
        roles = {
            int(pid): SESSION_ROLES.get(str(app).partition(":")[0], "postgresql: other")
            for pid, app in self.db.execute("SELECT pid, application_name FROM pg_stat_activity")
        }
        for proc in tree(self.postmaster.pid):
            found.setdefault(roles.get(proc.pid, "postgresql: other"), []).append(proc)
        return found

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


class OpenDkim:
    """Debian's OpenDKIM as a milter, signing every message with a key of its own, on the
    Unix socket Debian's own setup uses (inside Postfix's chroot); on TCP loopback each
    message waited about 90 ms (Nagle and delayed ACKs on the milter's small writes)."""

    def __init__(self, tmp: Path, socket_dir: Path) -> None:
        folder = tmp / "opendkim"
        folder.mkdir()
        folder.chmod(0o755)
        key = folder / "dkim.key"
        subprocess.run(
            [postfix.tool("openssl") or "openssl", "genrsa", "-out", str(key), "2048"],
            check=True, capture_output=True,
        )  # fmt: skip
        shutil.chown(key, "opendkim", "opendkim")
        key.chmod(0o600)
        socket_dir.mkdir(exist_ok=True)
        shutil.chown(socket_dir, "opendkim", "opendkim")
        socket_dir.chmod(0o755)
        self.socket = socket_dir / "opendkim.sock"
        (folder / "keytable").write_text(f"bench._domainkey.example.com example.com:bench:{key}\n")
        (folder / "signingtable").write_text("* bench._domainkey.example.com\n")
        conf = folder / "opendkim.conf"
        conf.write_text(
            f"Mode s\nSocket local:{self.socket}\nUMask 000\nKeyTable file:{folder}/keytable\n"
            f"SigningTable refile:{folder}/signingtable\nCanonicalization relaxed/relaxed\n"
            f"UserID opendkim\nPidFile {folder}/opendkim.pid\nSyslog no\n"
            # the key lies under the world-writable /tmp: OpenDKIM would refuse it as unsafe
            "RequireSafeKeys no\n"
        )
        self.proc = subprocess.Popen(
            [shutil.which("opendkim") or "/usr/sbin/opendkim", "-f", "-x", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        postfix.wait_for(self.socket.exists, 30, "opendkim to listen")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class PostfixDkimMail(PostfixMail):
    """Postfix relaying to the sink, every message signed by OpenDKIM on the way."""

    def __init__(self, sink: Sink, tmp: Path) -> None:
        self.sink = sink
        milter = "unix:opendkim/opendkim.sock"  # smtpd runs chrooted in the queue folder
        self.server = postfix.Postfix(
            relayhost=f"[127.0.0.1]:{sink.port}",
            settings={
                "smtpd_recipient_restrictions": "",
                "smtpd_milters": milter,
                "non_smtpd_milters": milter,
                "milter_default_action": "tempfail",  # unsigned mail is not counted as sent
            },
        )
        self.dkim = OpenDkim(tmp, self.server.spool / "opendkim")
        self.server.start()
        self.port = self.server.port

    def components(self) -> dict[str, list[psutil.Process]]:
        return {**super().components(), "opendkim": tree(self.dkim.proc.pid)}

    def close(self) -> None:
        super().close()
        self.dkim.stop()


def content(args: argparse.Namespace) -> list[str]:
    """smtp-source's options for what it sends: --message's file, else --size of filler."""
    return ["-F", str(args.message)] if args.message else ["-l", str(args.size)]


def smtp_source(port: int, messages: int, sessions: int, what: list[str]) -> float:
    """Seconds smtp-source took; it exits non-zero on any reply it did not expect."""
    started = time.monotonic()
    subprocess.run(
        [postfix.tool("smtp-source") or "smtp-source", "-s", str(sessions), "-m", str(messages),
         *what, "-f", SENDER, "-t", RECIPIENT, f"127.0.0.1:{port}"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return time.monotonic() - started


def phase(system: Any, args: argparse.Namespace) -> dict[str, Any]:
    before = {name: cpu_seconds(procs) for name, procs in system.components().items()}
    started = time.monotonic()
    seconds = smtp_source(system.port, args.messages, args.sessions, content(args))
    postfix.wait_for(system.drained, 900, "the queue to drain")
    total = time.monotonic() - started
    after = {name: cpu_seconds(procs) for name, procs in system.components().items()}
    cpu = {name: round(cpu_used(before.get(name, {}), after[name]), 2) for name in after}
    return {
        "accepted": round(args.messages / seconds),
        "end_to_end": round(args.messages / total),
        "seconds": round(seconds, 2),
        "drained_after_s": round(total - seconds, 2),
        "cpu_s": cpu,
        "cpu_ms_per_message": round(1000 * sum(cpu.values()) / args.messages, 3),
    }


@contextmanager
def systems(tmp: Path, summary: dict[str, str], *, pipeline: str) -> Iterator[dict[str, Any]]:
    """The systems of this run, by name: pepsi, postfix, and with sign-relay (when OpenDKIM
    is installed) postfix+opendkim."""
    sink = Sink()
    started: dict[str, Any] = {}
    try:
        pepsi = PepsiMail(tmp, sink, pipeline=pipeline)
        started["pepsi"] = pepsi
        started["postfix"] = PostfixMail(sink)
        if pipeline == "sign-relay":
            if shutil.which("opendkim"):
                started["postfix+opendkim"] = PostfixDkimMail(sink, tmp)
            else:
                print("bench/mail.py: opendkim is not installed: no Postfix + OpenDKIM peer")
        yield started
    finally:
        for name, system in reversed(started.items()):
            if name == "pepsi":
                summary["ingress"], summary["dispatcher"] = system.close()
            else:
                system.close()
        sink.stop()


def run_rounds(systems_: dict[str, Any], args: argparse.Namespace) -> list[Any]:
    warm = argparse.Namespace(**{**vars(args), "messages": 500})
    for system in systems_.values():
        phase(system, warm)
    rounds = []
    names = list(systems_)
    for number in range(args.rounds):  # each round starts with the next system: drift spread
        order = names[number % len(names) :] + names[: number % len(names)]
        rounds.append({name: phase(systems_[name], args) for name in order})
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
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--size", type=int, default=1024, help="smtp-source's filler, bytes")
    what.add_argument("--message", type=Path, metavar="FILE", help="send this message instead")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the JSON here")
    args = parser.parse_args()
    if args.message and not args.message.is_file():
        parser.error(f"--message: no such file: {args.message}")
    problem = postfix.missing()
    if problem is not None or postfix.tool("smtp-source") is None:
        raise SystemExit(f"bench/mail.py: {problem or 'smtp-source is not installed'}")
    summary: dict[str, str] = {}
    lock = exclusive_run("bench/mail.py")  # one run at a time: one scratch database
    with lock, tempfile.TemporaryDirectory(prefix="pepsi-bench-mail-") as tmp:
        Path(tmp).chmod(0o755)  # OpenDKIM, as its own user, walks into it
        with systems(Path(tmp), summary, pipeline=args.pipeline) as started:
            rounds = run_rounds(started, args)
    measure = "accepted" if args.pipeline == "discard" else "end_to_end"
    medians = {name: statistics.median(r[name][measure] for r in rounds) for name in rounds[0]}
    ratios = {
        peer: [round(r["pepsi"][measure] / r[peer][measure], 2) for r in rounds]
        for peer in rounds[0]
        if peer != "pepsi"
    }
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "load": f"smtp-source -s {args.sessions} -m {args.messages} {' '.join(content(args))}",
        "pepsi_pipeline": args.pipeline,
        "measure": measure,
        "rounds": rounds,
        "medians": medians,
        "pepsi_median": medians["pepsi"],
        "postfix_median": medians["postfix"],
        "ratios": ratios["postfix"],
        "ratio_median": statistics.median(ratios["postfix"]),
        "ratios_by_peer": ratios,
        "ingress_commits": summary.get("ingress", ""),  # warm-up included
        "dispatcher_claims": summary.get("dispatcher", ""),
    }
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    what = "mail in" if args.pipeline == "discard" else f"mail through ({args.pipeline})"
    for peer, values in ratios.items():
        print(
            f"{what}, {measure}: Pepsi {medians['pepsi']} msg/s, {peer} {medians[peer]} msg/s "
            f"(median of {args.rounds}); Pepsi/{peer} {statistics.median(values)} "
            f"(rounds: {', '.join(map(str, values))})"
        )
        cpu = [
            round(r["pepsi"]["cpu_ms_per_message"] / r[peer]["cpu_ms_per_message"], 2)
            for r in rounds
        ]
        print(f"{what}, CPU a message: Pepsi/{peer} (rounds: {', '.join(map(str, cpu))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
