"""The live snapshot: `NOTIFY pepsi_live` every LIVE_INTERVAL while the pipeline is busy.

Readers (`pepsi top`, the web console; `pepsi.admin.watch.live`) want rates fresher
than the statistics the dispatcher writes every STATS_INTERVAL. Rather than
write more, the dispatcher publishes its counters since start (the ones the
metrics endpoint serves, `Stats.snapshot()`) and its pools' gauges in a
notification on its claim connection: one short statement, no table write.

When: every LIVE_INTERVAL while a worker holds a message; while idle, once
more within LIVE_INTERVAL when a counter or gauge changed (wakeups do not
count, as for the flusher), and otherwise a heartbeat only. The heartbeat
rides on the wakeups the loop makes anyway (its POLL_INTERVAL tick): an idle
dispatcher still starts no statement between its ticks. It comes at the
first wakeup past LIVE_HEARTBEAT - POLL_INTERVAL/2 since the last
notification, so the silence between two is at most `heartbeat_bound`
(12.5 s with the default 5 s POLL_INTERVAL), which the payload states.
At shutdown a last one says `"final": true`.

The payload is JSON (docs/dispatcher.md lists its keys). A notification's
payload must stay under 8000 bytes: the stages are spread over several
notifications (`part` of `parts`, the same `seq`), all sent by one statement
so that they arrive together; past MAX_PARTS the remaining stages are left
out and `dropped` counts them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psycopg

from pepsi.db.queries import query
from pepsi.dispatch.services.metrics import Snapshot
from pepsi.dispatch.stats import DISPATCH_FIELDS, PASSIVE

AConn = psycopg.AsyncConnection[tuple[Any, ...]]

CHANNEL = "pepsi_live"
VERSION = 1
LIVE_INTERVAL = 1.0  # seconds between snapshots while busy
LIVE_HEARTBEAT = 10.0  # seconds: an idle dispatcher still says it is alive about this often
PAYLOAD_LIMIT = 7800  # bytes per notification; PostgreSQL refuses 8000 and more
MAX_PARTS = 8  # notifications per snapshot; stages beyond are dropped (`dropped`)
MAX_EXECUTING = 400  # ids of started messages per snapshot (`executing_complete` if all)

# Per stage, in this order: counters since start (Stats), then gauges (Gauges).
STAGE_COUNTERS = ("processed", "failed", "requeued", "finished", "advanced", "retries", "strikes")
STAGE_GAUGES = ("in_flight", "workers")
FIELDS = (*STAGE_COUNTERS, *STAGE_GAUGES)


def heartbeat_bound(heartbeat: float, poll_interval: float) -> float:
    """The longest silence of an idle, live dispatcher (see the module's docstring)."""
    return max(heartbeat + poll_interval / 2, poll_interval)


def _key(snapshot: Snapshot) -> tuple[Any, ...]:
    """What a change is: any counter but the wakeups, or a gauge of workers."""
    counts, gauges = snapshot.counts, snapshot.gauges
    return (
        sorted((name, sorted(c.items())) for name, c in counts.stages.items()),
        sorted((k, n) for k, n in counts.dispatch.items() if k not in PASSIVE and n),
        sorted(gauges.workers.items()),
        sorted(gauges.in_flight.items()),
        gauges.executing,
    )


def stage_rows(snapshot: Snapshot) -> list[tuple[str, list[int]]]:
    """(stage, FIELDS values) for every stage counted or with a pool, by name."""
    counts, gauges = snapshot.counts, snapshot.gauges
    names = sorted(set(counts.stages) | set(gauges.workers) | set(gauges.in_flight))
    rows = []
    for name in names:
        counter = counts.stages.get(name)
        values = [0 if counter is None else int(counter[key]) for key in STAGE_COUNTERS]
        values += [gauges.in_flight.get(name, 0), gauges.workers.get(name, 0)]
        rows.append((name, values))
    return rows


def payloads(
    snapshot: Snapshot,
    *,
    seq: int,
    at: float,
    quiet_since: float,
    interval: float,
    heartbeat: float,
    final: bool = False,
    pid: int | None = None,
    limit: int = PAYLOAD_LIMIT,
    max_parts: int = MAX_PARTS,
) -> list[str]:
    """The notifications of one snapshot: one, or several parts of `limit` bytes at most."""
    header: dict[str, Any] = {
        "v": VERSION,
        "pid": os.getpid() if pid is None else pid,
        "start": round(snapshot.gauges.started, 3),
        "t": round(at, 3),
        "seq": seq,
        "quiet_since": round(quiet_since, 3),  # the counters have not changed since
        "interval": interval,
        "heartbeat": heartbeat,
        "final": final,
        "dispatch": {k: int(snapshot.counts.dispatch.get(k, 0)) for k in DISPATCH_FIELDS},
        "fields": list(FIELDS),
        # the messages a worker has started (the head of each); `pepsi queue` tells them
        # from those read ahead, which are `running` in the table too
        "executing": list(snapshot.gauges.executing[:MAX_EXECUTING]),
        "executing_complete": len(snapshot.gauges.executing) <= MAX_EXECUTING,
    }
    entries = [json.dumps(name) + ":" + json.dumps(values, separators=(",", ":"))
               for name, values in stage_rows(snapshot)]  # fmt: skip
    # the fixed part, with the widest numbers the parts' and dropped counts may take
    fixed = len(_encode({**header, "part": 999, "parts": 999, "dropped": len(entries)}, []))
    budget = limit - fixed
    groups: list[list[str]] = [[]]
    used = 0
    dropped = 0
    for entry in entries:
        size = len(entry.encode()) + 1  # and its comma
        if size > budget:  # a stage name too long to fit anywhere
            dropped += 1
            continue
        if used + size > budget:
            if len(groups) == max_parts:
                dropped += 1
                continue
            groups.append([])
            used = 0
        groups[-1].append(entry)
        used += size
    return [
        _encode({**header, "part": n, "parts": len(groups), "dropped": dropped}, group)
        for n, group in enumerate(groups, start=1)
    ]


def _encode(header: Mapping[str, Any], entries: Sequence[str]) -> str:
    text = json.dumps(header, separators=(",", ":"))
    return text[:-1] + ',"stages":{' + ",".join(entries) + "}}"


class LivePublisher:
    """The dispatcher's service: `due`/`deadlines` for the loop, `run_once` to notify."""

    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        clock: Callable[[], float],
        *,
        poll_interval: float,
        interval: float = LIVE_INTERVAL,
        heartbeat: float = LIVE_HEARTBEAT,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.snapshot = snapshot  # the metrics endpoint's: counters since start, gauges
        self.clock = clock
        self.wall = wall
        self.interval = interval
        self.heartbeat = heartbeat
        self.poll_interval = poll_interval
        self.bound = heartbeat_bound(heartbeat, poll_interval)
        self.last_sent = float("-inf")  # the first cycle announces the start
        self.seq = 0
        self.sent = 0  # notifications, for tests and logs
        self._last_key: tuple[Any, ...] | None = None
        self._quiet_since = 0.0  # wall time of the first snapshot with the last key
        self._seen_change = False  # since the last snapshot sent

    def _changed(self) -> bool:
        """A change since the last snapshot sent. Once seen it stays one until the next
        (counters only grow): the loop asks twice a cycle while idle, and making the
        snapshot to compare was most of the dispatcher's wait for AMQP clients (Celery)."""
        if not self._seen_change:
            self._seen_change = _key(self.snapshot()) != self._last_key
        return self._seen_change

    def due(self, idle: bool) -> bool:
        """Busy: every interval. Idle: within an interval of a change, else the heartbeat."""
        since = self.clock() - self.last_sent
        if since >= self.interval and (not idle or self._changed()):
            return True
        return idle and since >= max(self.interval, self.heartbeat - self.poll_interval / 2)

    def deadlines(self, idle: bool) -> list[float]:
        """No deadline of its own for the heartbeat: it rides on the loop's ticks."""
        if not idle or self._changed():
            return [self.last_sent + self.interval]
        return []

    def take(self, *, final: bool = False) -> list[str]:
        """The next snapshot's notifications; from now on it counts as sent."""
        self.last_sent = self.clock()
        snapshot = self.snapshot()
        key = _key(snapshot)
        at = self.wall()
        if key != self._last_key:
            self._last_key, self._quiet_since = key, at
        self._seen_change = False
        self.seq += 1
        return payloads(
            snapshot,
            seq=self.seq,
            at=at,
            quiet_since=self._quiet_since,
            interval=self.interval,
            heartbeat=self.bound,
            final=final,
        )

    async def run_once(self, conn: AConn, *, final: bool = False) -> None:
        """One statement: the snapshot's notifications (several parts sent together)."""
        await conn.execute(query("live_notify"), {"payloads": self.take(final=final)})
        self.sent += 1
