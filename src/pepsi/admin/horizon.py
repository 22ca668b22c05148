"""The oldest transaction holding back vacuum: who holds it, for how long, and when to warn.

A session left `idle in transaction` (or a long query, or a forgotten
prepared transaction) pins the MVCC horizon: vacuum keeps every row version
younger than its snapshot, dead tuples pile up at the head of the queue's
pending index and every claim walks them. Measured: a 3-minute idle
transaction cut throughput to 25–60 % and let the backlog grow from 18 to
50 k rows, with nothing lost; it recovered when the session ended. PostgreSQL
causes it, so Pepsi can only make it visible: `pepsi queue status`, `pepsi
top` and the metrics endpoint show it (docs/operations.md, "A transaction
holding back vacuum").

`read_oldest` is the one read (`activity_oldest_horizon`); `is_late` and
`warning` are pure; `Probe` reads on a short-lived connection of its own, for
the metrics endpoint's scrape thread.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg

from pepsi.db import connect
from pepsi.db.queries import query
from pepsi.durations import format_duration, parse_duration
from pepsi.errors import ConfigError, DatabaseUnavailable, one_line

# A transaction older than this is worth a warning: the pipeline's own are far shorter
# (a claim or a worker's batch: milliseconds), and a minute of dead rows already shows
# in the claim rate.
HORIZON_WARN_AFTER = 60.0
WARN_AFTER_ENV = "PEPSI_HORIZON_WARN_AFTER"  # a duration; overrides HORIZON_WARN_AFTER
PROBE_CACHE_FOR = 5.0  # seconds a scrape's reading of the horizon is reused
PROBE_APPLICATION_NAME = "pepsi-metrics"


@dataclass(frozen=True)
class Holder:
    """The oldest transaction holding back the horizon."""

    kind: str  # "session" or "prepared"
    age_s: float  # seconds since the transaction began (or was prepared)
    pid: int | None = None  # a session's backend; None for a prepared transaction
    user: str | None = None
    application: str | None = None
    client: str | None = None  # host:port, or "local" for a Unix socket
    state: str | None = None  # pg_stat_activity.state: "idle in transaction", "active", ...
    gid: str | None = None  # a prepared transaction's name

    def describe(self) -> str:
        """Who holds it, in a few words: `pid 1234 (user x, app psql, idle in transaction)`."""
        if self.kind == "prepared":
            return f"prepared transaction {self.gid!r} (owner {self.user or '?'})"
        details = [f"user {self.user or '?'}"]
        if self.application:
            details.append(f"app {self.application}")
        if self.client and self.client != "local":
            details.append(f"from {self.client}")
        details.append(self.state or "state unknown")
        return f"pid {self.pid} ({', '.join(details)})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "age_s": round(self.age_s, 1),
            "pid": self.pid,
            "user": self.user,
            "application": self.application,
            "client": self.client,
            "state": self.state,
            "gid": self.gid,
        }


def warn_after(environ: Mapping[str, str] = os.environ) -> float:
    """The warning threshold in seconds: $PEPSI_HORIZON_WARN_AFTER or HORIZON_WARN_AFTER."""
    text = environ.get(WARN_AFTER_ENV)
    if text is None or not text.strip():
        return HORIZON_WARN_AFTER
    try:
        return parse_duration(text)
    except ValueError:
        raise ConfigError(
            f"{WARN_AFTER_ENV}={text!r}: expected a duration such as 60s or 5m"
        ) from None


def is_late(holder: Holder | None, threshold: float) -> bool:
    """Whether the holder has held the horizon for longer than `threshold` seconds."""
    return holder is not None and holder.age_s > threshold


def warning(holder: Holder | None, threshold: float) -> str | None:
    """The operator's one-line warning, or None while nothing is held past `threshold`."""
    if holder is None or not is_late(holder, threshold):
        return None
    held = format_duration(holder.age_s)
    if holder.kind == "prepared":
        what, remedy = holder.describe(), "COMMIT PREPARED or ROLLBACK PREPARED it"
    else:
        what = f"transaction of {holder.describe()}"
        remedy = "end it or set idle_in_transaction_session_timeout"
    return (
        f"warning: {what} has held back vacuum for {held}: "
        f"dead rows pile up and the pipeline slows; {remedy}"
    )


def read_oldest(conn: psycopg.Connection[Any]) -> Holder | None:
    """The oldest holder of this database's horizon, None when nothing holds it."""
    row = conn.execute(query("activity_oldest_horizon")).fetchone()
    if row is None:
        return None
    kind, age, pid, user, application, client, state, gid = row
    return Holder(
        kind=str(kind),
        age_s=max(0.0, float(age)),
        pid=None if pid is None else int(pid),
        user=user,
        application=application or None,
        client=client,
        state=state,
        gid=gid,
    )


class Probe:
    """`read_oldest` for the metrics endpoint, on a connection of its own, kept between
    scrapes and opened again after a failure; the answer is kept `cache_for` seconds.

    A scrape must not wait on (or add a round trip to) the dispatcher's claim
    connection; and a flood of scrapes must not open a PostgreSQL session each (it did:
    a session's authentication costs the server far more than the query), nor run the
    query each: at most one read every `cache_for` seconds, one session in all.
    DatabaseUnavailable when it cannot read: not knowing is not "nothing holds it".
    """

    def __init__(
        self,
        dsn: str,
        timeout: float = 5.0,
        cache_for: float = PROBE_CACHE_FOR,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dsn = dsn
        self.timeout = timeout
        self.cache_for = cache_for
        self.clock = clock
        self._conn: psycopg.Connection[Any] | None = None
        self._cached: tuple[float, Holder | None] | None = None
        self._lock = threading.Lock()  # scrapes come on the server's threads

    def __call__(self) -> Holder | None:
        with self._lock:
            now = self.clock()
            if self._cached is not None and now - self._cached[0] < self.cache_for:
                return self._cached[1]
            try:
                if self._conn is None or self._conn.closed or self._conn.broken:
                    self._conn = connect.connect(
                        self.dsn, timeout=self.timeout, application_name=PROBE_APPLICATION_NAME
                    )
                holder = read_oldest(self._conn)
            except psycopg.Error as exc:
                self.close()
                raise DatabaseUnavailable(
                    f"reading the oldest transaction failed: {one_line(exc)}"
                ) from None
            self._cached = (now, holder)
            return holder

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()
