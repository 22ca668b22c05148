"""Scenario harness: a real dispatcher process, real workers, a fresh database."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pepsi.config import load_config
from pepsi.publishing import OutgoingMessage, Publisher

REPO = Path(__file__).resolve().parents[2]


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll `predicate` until it returns something truthy, or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


class Dispatcher:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc = proc
        self.log_path = log

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)


class Pipeline:
    """One test's pipeline: config file, database, dispatchers started on demand."""

    def __init__(self, dsn: str, tmp: Path) -> None:
        self.dsn = dsn
        self.tmp = tmp
        self.conf = tmp / "pepsi.conf"
        self.dispatchers: list[Dispatcher] = []
        self.publisher: Publisher | None = None
        self.extra_env: dict[str, str] = {}
        self.db = psycopg.connect(dsn, autocommit=True)
        self.db.execute(
            "CREATE TABLE test_effects (workqueue_id bigint, stage text, pid int,"
            " at timestamptz DEFAULT clock_timestamp())"
        )

    def configure(self, text: str, **dispatch: str) -> None:
        """Write pepsi.conf: short timings so faults resolve within a test."""
        options = {
            "POLL_INTERVAL": "1s",
            "WORKER_IDLE_TIMEOUT": "1s",
            "STRIKE_DELAY": "300ms",
            "DB_ERROR_PAUSE": "1s",
            "START_COOLDOWN": "500ms",
            "TEMPFAIL_WINDOW": "3s",
            "RECONNECT_MAX_DELAY": "1s",
            **dispatch,
        }
        base = "[pepsi-dispatch]\n" + "".join(f"{k} = {v}\n" for k, v in options.items())
        self.conf.write_text(base + text if "[pepsi-dispatch]" not in text else text)

    def env(self) -> dict[str, str]:
        return {**os.environ, "PEPSI_DSN": self.dsn, "PYTHONPATH": str(REPO), **self.extra_env}

    def start(self, *extra: str) -> Dispatcher:
        log = self.tmp / f"dispatch-{len(self.dispatchers)}.log"
        handle = log.open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "pepsi", "-c", str(self.conf), *extra, "dispatch", "serve"],
            env=self.env(),
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
        handle.close()
        dispatcher = Dispatcher(proc, log)
        self.dispatchers.append(dispatcher)
        wait_until(
            lambda: "dispatching" in dispatcher.log or proc.poll() is not None,
            what="the dispatcher to start",
        )
        return dispatcher

    def publish(self, stage: str, count: int = 1, **kw: Any) -> list[int]:
        """Publish `count` copies through the real publisher, 1 000 per transaction."""
        if self.publisher is None:
            self.publisher = Publisher.connect(load_config(self.conf), self.dsn)
        if "recipients" in kw:
            kw["recipients"] = tuple(kw["recipients"])
        msg = OutgoingMessage(stage, kw.pop("body", None), **kw)
        ids: list[int] = []
        for start in range(0, count, 1000):
            ids += self.publisher.publish_many([msg] * min(1000, count - start))
        return ids

    def scalar(self, sql: str, *params: Any) -> Any:
        row = self.db.execute(sql, params).fetchone()
        return None if row is None else row[0]

    def row(self, wid: int) -> tuple[str, str, dict[str, Any]] | None:
        """(stage, status, state) of a message, or None once it finished."""
        found = self.db.execute(
            "SELECT stage, status::text, state FROM pepsi.workqueue WHERE workqueue_id = %s",
            (wid,),
        ).fetchone()
        return None if found is None else (str(found[0]), str(found[1]), dict(found[2]))

    def effects(self) -> dict[tuple[int, str], int]:
        rows = self.db.execute(
            "SELECT workqueue_id, stage, count(*) FROM test_effects GROUP BY 1, 2"
        ).fetchall()
        return {(int(w), str(s)): int(n) for w, s, n in rows}

    def settled(self) -> bool:
        """Nothing pending, running or paused: every message finished or ended."""
        return (
            self.scalar(
                "SELECT count(*) FROM pepsi.workqueue WHERE status IN ('pending', 'running', 'paused')"
            )
            == 0
        )

    def remaining(self) -> int:
        return int(self.scalar("SELECT count(*) FROM pepsi.workqueue"))

    def by_status(self) -> dict[str, int]:
        rows = self.db.execute(
            "SELECT status::text, count(*) FROM pepsi.workqueue GROUP BY 1"
        ).fetchall()
        return {str(s): int(n) for s, n in rows}

    def workers(self, stage: str | None = None) -> int:
        """Live worker connections (each worker holds one)."""
        pattern = f"pepsi-worker:{stage}" if stage else "pepsi-worker:%"
        return int(
            self.scalar(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name LIKE %s",
                pattern,
            )
        )

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        for dispatcher in self.dispatchers:
            if dispatcher.proc.poll() is None:
                dispatcher.proc.kill()
                dispatcher.proc.wait()
        self.db.close()


@pytest.fixture
def pipeline(dsn: str, tmp_path: Path) -> Iterator[Pipeline]:
    p = Pipeline(dsn, tmp_path)
    yield p
    p.close()


@pytest.fixture
def ingress(dsn: str, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Start `pepsi ingress --serve` processes (tests/mail_server.py); all killed at the end."""
    from tests.mail_server import IngressProcess  # noqa: PLC0415  # only the mail tests

    started: list[IngressProcess] = []

    def start(ingress: str = "", stages: str = "", name: str = "ingress") -> IngressProcess:
        process = IngressProcess(dsn, tmp_path, ingress, stages, name)
        started.append(process)
        return process.start()

    yield start
    for process in started:
        process.close()
