"""Running one stage's function over batches of ids on one connection (W-2, W-8).

A batch: load the rows in one SELECT, run the stage on each message, decide
each row's update (`outcomes`, pure), write every update in one statement,
and answer one status line per id, in order.

A transactional stage (`@stage(transactional=True)`, issue 18) runs each
message in a transaction of its own on the worker's connection: the stage's
writes through `msg.db` and the row's outcome commit together. The outcome
is guarded by the claim token (the row's xmin as loaded): a row handed to
another worker meanwhile is left alone and the stage's writes roll back.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import select
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.types.json import Jsonb

from pepsi.config import Config, StageConfig
from pepsi.db.connect import one_line
from pepsi.db.queries import query
from pepsi.errors import EX_IOERR, EX_TEMPFAIL, DatabaseUnavailable, database_exit_code
from pepsi.protocol import Pass, format_status
from pepsi.stage import Message, Needs, is_transactional, needs_of
from pepsi.telemetry import NO_SINK, Sink
from pepsi.worker.fusion import fusable
from pepsi.worker.handlers import StageFunc
from pepsi.worker.messages import Conn, MessageLoader
from pepsi.worker.outcomes import Clock
from pepsi.worker.passes import MessagePasses
from pepsi.worker.settings import OverrideCheck, Plan, plan
from pepsi.worker.writes import Batch, split_params

log = logging.getLogger("pepsi.worker")
# A batch whose messages have run this long is written and answered before the
# next message runs (its outcomes in one statement, its status lines at once).
FLUSH_AFTER_NS = 100_000_000


class _DatabaseGone(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def utc_now() -> datetime:
    """The runner's clock (the decisions take it injected)."""
    return datetime.now(UTC)


class StageRunner(MessagePasses):
    """Runs one stage's function over batches of ids on one connection."""

    def __init__(
        self,
        config: Config,
        stage: StageConfig,
        func: StageFunc,
        conn: Conn,
        *,
        reconnect: Callable[[], Conn] | None = None,
        now: Clock = utc_now,
        monotonic: Callable[[], float] = time.monotonic,
        sink: Sink = NO_SINK,
    ) -> None:
        self.stage = stage
        self.sink = sink  # P-11: a span per pass when on; off, one flag per batch
        self.stages = config.stages  # where an Advance may go
        self.func = func
        self.needs = needs_of(func)
        self.transactional = is_transactional(func)  # issue 18: one transaction per message
        self.messages = MessageLoader(stage, self.needs)
        self.conn = conn
        self.reconnect = reconnect
        self.now = now
        self.overrides = OverrideCheck(monotonic)
        # W-10: the stages an advance may run in this pass, by configuration
        self.fuse_into = (
            {name: s for name, s in config.stages.items() if fusable(s)}
            if config.pepsi.allow_fusion
            else {}
        )
        self.overridden: frozenset[str] = frozenset()  # stages with per-address overrides
        self.refused: dict[int, str] = {}  # W-9: messages whose overrides cannot be used
        self.handlers: dict[str, tuple[StageFunc, Needs] | None] = {}
        # Once at start, so that a worker's first batch costs what the others do;
        # if the database is gone, the first batch asks again (and answers 74/75).
        with contextlib.suppress(psycopg.Error):
            self._check_overrides()
        self.stage_log = logging.getLogger(f"pepsi.stage.{stage.name}")
        self.loop: asyncio.AbstractEventLoop | None = None
        if inspect.iscoroutinefunction(func):
            self.loop = asyncio.new_event_loop()

    @property
    def batch_limit(self) -> int:
        """Every buffered id, up to QUEUE_LIMIT (W-8), loaded in one SELECT; for a stage
        that reads the header block or the body too, their contents come with the rows
        (up to `messages.INLINE` each), but each outcome is written, and answered, as
        soon as it is known (`answer_each`)."""
        return self.stage.queue_limit

    @property
    def takes_rows(self) -> bool:
        """Whether the dispatcher may hand this worker its rows with the ids ("ready rows"):
        a stage that reads only metadata, which a claimed row holds all of."""
        return self.needs is Needs.METADATA

    @property
    def answer_each(self) -> bool:
        """Whether each message's outcome is written and answered before the next runs.

        A stage that reads the message's content does work that may reach outside
        the database (a relay's SMTP, a signature): a crash must not make it run
        again for the batch-mates that went before (the manual's one at a time).
        A metadata-only stage writes its batch at once (W-8)."""
        return self.needs is not Needs.METADATA

    def run_batch(self, ids: list[int], rows: Mapping[int, bytes] | None = None) -> bytes:
        """Process `ids`; return their status lines, in order, as one buffer."""
        return b"".join(self.answers(ids, rows))

    def answers(self, ids: list[int], rows: Mapping[int, bytes] | None = None) -> Iterator[bytes]:
        """Process `ids`; their status lines, in order, in as few buffers as can be.

        Each buffer answers the messages whose outcomes were just written: the
        whole batch at once when it runs quickly, and every FLUSH_AFTER when
        its messages are slow (a relay waiting on a remote server), so that
        the dispatcher hears of each message soon after it ran (its
        MAX_RUNTIME runs from the answer before it).

        If the worker's own connection is lost or cannot be had, every id not
        answered yet is answered 74 (lost) or 75 (connection limit): the
        dispatcher pauses or requeues them; the stage's outcome, if any, was
        not recorded and the stage will run again (W-4, W-5).

        `rows`: those the dispatcher handed with their ids, run without a load.
        """
        answered = 0
        try:
            if self.conn.closed or self.conn.broken or ended_by_server(self.conn):
                self._reopen()
            for lines, count in self._run_batch(ids, rows):
                answered += count
                yield lines
        except _DatabaseGone as gone:
            yield b"".join(format_status(gone.code) for _ in ids[answered:])
        except psycopg.Error as exc:
            code = database_exit_code(exc)
            if code is None:
                raise
            log.warning(
                "database unavailable (%s): answering %d for %d messages",
                one_line(exc),
                code,
                len(ids) - answered,
            )
            # Not reused: a node that became a standby keeps the session open and would
            # refuse every batch's write (25006); the next batch reconnects to the primary.
            self.conn.close()
            yield b"".join(format_status(code) for _ in ids[answered:])

    def _reopen(self) -> None:
        self.conn.close()  # a server-ended session may still hold its socket
        if self.reconnect is None:
            raise _DatabaseGone(EX_IOERR)
        try:
            self.conn = self.reconnect()
        except DatabaseUnavailable as exc:
            code = exc.exit_code if exc.exit_code in (EX_IOERR, EX_TEMPFAIL) else EX_IOERR
            log.warning("cannot reconnect (%s): answering %d", exc, code)
            raise _DatabaseGone(code) from None

    def _run_batch(
        self, ids: list[int], rows: Mapping[int, bytes] | None
    ) -> Iterator[tuple[bytes, int]]:
        """Run the batch; each written segment's status lines and how many ids they answer."""
        started = time.perf_counter_ns()
        if self.overrides.due():  # at most every few seconds while the stage has none
            self._check_overrides()
        if self.overrides.exists:  # the rows handed are not enough: loaded with them
            messages = self._load_with_settings(ids)
        else:
            messages = self.messages.load(self.conn, ids, rows)
        segment: list[int] = []
        batch = Batch()
        spent: dict[int, int] = {}
        traced = self.sink.enabled
        each = self.answer_each
        for wid in ids:
            segment.append(wid)
            msg = messages.get(wid)
            if msg is not None:  # else no longer running here (moved by a repair command)
                t0 = time.perf_counter_ns()
                if traced:
                    self._run_traced(msg, batch)
                else:
                    self._run_one(msg, batch)
                spent[wid] = time.perf_counter_ns() - t0
            now = time.perf_counter_ns()
            if each or now - started >= FLUSH_AFTER_NS or wid == ids[-1]:
                self._write(batch)
                yield self._lines(segment, batch, spent, started), len(segment)
                segment, batch, spent = [], Batch(), {}
                started = time.perf_counter_ns()

    def _lines(self, ids: list[int], batch: Batch, spent: dict[int, int], started: int) -> bytes:
        """The status lines of a written segment; its database time shared evenly."""
        overhead = (time.perf_counter_ns() - started - sum(spent.values())) // max(1, len(ids))
        lines = []
        for wid in ids:
            decision = batch.decisions.get(wid)
            if decision is None:
                lines.append(format_status(0))
                continue
            passes = batch.passes.get(wid)
            if passes is None:
                micros = (spent[wid] + overhead) // 1000
                report = [Pass(self.stage.name, micros, decision.outcome)]
            else:  # a fused pass: one entry per stage, the database's share on the first
                report = [
                    Pass(name, (ns + (overhead if i == 0 else 0)) // 1000, outcome)
                    for i, (name, ns, outcome) in enumerate(passes)
                ]
            lines.append(format_status(decision.exit_status, report))
        return b"".join(lines)

    def _write(self, batch: Batch) -> None:
        """The batch's outcomes: a split each (issue 32), then all the rest at once."""
        for wid, decision in batch.splits:
            params = split_params(wid, self.stage.name, decision)
            self.conn.execute(query("workqueue_record_split"), params)
        if batch.finished or batch.updates:
            self.conn.execute(*batch.statement(self.stage.name))

    def _check_overrides(self) -> None:
        row = self.conn.execute(
            query("settings_exist_for_stage"), {"stage": self.stage.name}
        ).fetchone()
        self.overrides.record(bool(row and row[0]))
        if self.fuse_into:  # a successor with overrides is dispatched, not fused
            found = self.conn.execute(query("settings_stages_overridden")).fetchone()
            self.overridden = frozenset(found[0] if found else ())

    def _load_with_settings(self, ids: list[int]) -> dict[int, Message]:
        """Load with the overrides, lay them over the stage, split diverging rows (W-9).

        The split is its own transaction, committed before the stage runs: if
        the worker dies after it, the row runs again with its first group
        only (which resolves to one group: no second split) and the new rows
        are already pending, once each.
        """
        loaded = self.messages.load_with_settings(self.conn, ids)
        self.overrides.record(loaded.any_override)
        plans: dict[int, Plan] = {}
        for wid, msg in loaded.messages.items():
            plans[wid] = plan(
                self.stage,
                msg.recipients,
                msg.sender,
                msg.state,
                overrides=loaded.overrides.get(wid),
                stages=self.stages,
            )
            error = plans[wid].error
            if error is not None:  # that message fails, permanently; the stage goes on
                self.refused[wid] = f"per-address settings: {error}"
        splits = [
            {"workqueue_id": wid, "groups": [list(g) for g in p.groups]}
            for wid, p in plans.items()
            if p.split
        ]
        if splits:
            # Issue 18: a transactional stage reads the split rows' new tokens in the split's
            # transaction (the split updated them, so their xmin is the split's).
            split_tx: contextlib.AbstractContextManager[Any] = (
                self.conn.transaction() if self.transactional else contextlib.nullcontext()
            )
            with split_tx:
                rows = self.conn.execute(
                    query("workqueue_split_many"),
                    {"stage": self.stage.name, "splits": Jsonb(splits)},
                ).fetchall()
                if self.transactional:
                    split_ids = [wid for wid, p in plans.items() if p.split]
                    tokens: dict[int, str] = {
                        int(row[0]): str(row[1])
                        for row in self.conn.execute(
                            query("workqueue_claim_tokens"),
                            {"ids": split_ids, "stage": self.stage.name},
                        )
                    }
                    for wid in split_ids:
                        if wid in loaded.messages:
                            loaded.messages[wid]._token = tokens.get(wid)
            for wid, new_ids in rows:
                if new_ids is None:  # no longer running here: nothing to do, as in `load`
                    del loaded.messages[wid]
                    continue
                loaded.messages[wid].recipients = plans[wid].groups[0]
                log.info("message %d split by per-address settings: new %s", wid, new_ids)
        for wid, msg in loaded.messages.items():
            msg.options = plans[wid].options[0]
        return loaded.messages


def ended_by_server(conn: Conn) -> bool:
    """Whether the server has spoken on this idle connection since its last statement.

    A worker's idle session gets nothing unasked but the notice that ends it
    (a terminate, a restart, a failover) and the socket's close: seen here
    without a round trip, so the first batch after an outage reconnects
    instead of answering 74 (a DB_ERROR_PAUSE) for messages it never ran.
    A rare other message (a reported setting) costs one needless reconnect.
    """
    status = conn.info.transaction_status
    if status != TransactionStatus.IDLE:
        return status == TransactionStatus.UNKNOWN  # libpq already knows it is bad
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError):  # no usable socket: as good as ended
        return True
    return bool(readable)
