"""Running one stage's function over batches of ids on one connection (W-2, W-8).

A batch: load the rows in one SELECT, run the stage on each message, decide
each row's update (`outcomes`, pure), write every update in one statement,
and answer one status line per id, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from pepsi.config import Config, StageConfig
from pepsi.db.connect import one_line
from pepsi.db.queries import query
from pepsi.errors import EX_IOERR, EX_TEMPFAIL, DatabaseUnavailable, database_exit_code
from pepsi.protocol import Pass, format_status
from pepsi.stage import Message, Needs, needs_of
from pepsi.telemetry import NO_SINK, TRACEPARENT, Sink
from pepsi.worker.handlers import StageFunc
from pepsi.worker.messages import Conn, MessageLoader
from pepsi.worker.outcomes import Clock, Decision, after_raise, after_return
from pepsi.worker.settings import OverrideCheck, Plan, plan

log = logging.getLogger("pepsi.worker")


class _DatabaseGone(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def utc_now() -> datetime:
    """The runner's clock (the decisions take it injected)."""
    return datetime.now(UTC)


@dataclass
class Batch:
    """The decisions of one batch; finished rows and updates as one statement takes them."""

    finished: list[int] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)
    decisions: dict[int, Decision] = field(default_factory=dict)

    def add(self, wid: int, decision: Decision) -> None:
        if decision.stage is None:
            self.finished.append(wid)
        else:
            self.updates.append(decision.row(wid))
        self.decisions[wid] = decision


class StageRunner:
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
        self.messages = MessageLoader(stage, self.needs)
        self.conn = conn
        self.reconnect = reconnect
        self.now = now
        self.overrides = OverrideCheck(monotonic)
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
        """Metadata-only stages take every buffered id (W-8); others one at a time."""
        return self.stage.queue_limit if self.needs is Needs.METADATA else 1

    def run_batch(self, ids: list[int]) -> bytes:
        """Process `ids`; return their status lines, in order, as one buffer.

        If the worker's own connection is lost or cannot be had, every id of
        the batch is answered 74 (lost) or 75 (connection limit): the
        dispatcher pauses or requeues them; the stage's outcome, if any, was
        not recorded and the stage will run again (W-4, W-5).
        """
        try:
            if self.conn.closed or self.conn.broken:
                self._reopen()
            return self._run_batch(ids)
        except _DatabaseGone as gone:
            return b"".join(format_status(gone.code) for _ in ids)
        except psycopg.Error as exc:
            code = database_exit_code(exc)
            if code is None:
                raise
            log.warning(
                "database unavailable (%s): answering %d for %d messages",
                one_line(exc),
                code,
                len(ids),
            )
            return b"".join(format_status(code) for _ in ids)

    def _reopen(self) -> None:
        if self.reconnect is None:
            raise _DatabaseGone(EX_IOERR)
        try:
            self.conn = self.reconnect()
        except DatabaseUnavailable as exc:
            code = exc.exit_code if exc.exit_code in (EX_IOERR, EX_TEMPFAIL) else EX_IOERR
            log.warning("cannot reconnect (%s): answering %d", exc, code)
            raise _DatabaseGone(code) from None

    def _run_batch(self, ids: list[int]) -> bytes:
        started = time.perf_counter_ns()
        if self.overrides.due():  # at most every few seconds while the stage has none
            self._check_overrides()
        if self.overrides.exists:
            messages = self._load_with_settings(ids)
        else:
            messages = self.messages.load(self.conn, ids)
        batch = Batch()
        spent: dict[int, int] = {}
        traced = self.sink.enabled
        for wid in ids:
            msg = messages.get(wid)
            if msg is None:
                continue  # no longer running here (moved by a repair command): nothing to do
            t0 = time.perf_counter_ns()
            if traced:
                self._run_traced(msg, batch)
            else:
                self._run_one(msg, batch)
            spent[wid] = time.perf_counter_ns() - t0
        if batch.finished or batch.updates:
            self.conn.execute(
                query("workqueue_record_outcomes"),
                {
                    "stage": self.stage.name,
                    "finished": batch.finished,
                    "updates": Jsonb(batch.updates),
                },
            )
        # Database time is shared evenly by the batch's messages.
        overhead = (time.perf_counter_ns() - started - sum(spent.values())) // max(1, len(ids))
        lines = []
        for wid in ids:
            decision = batch.decisions.get(wid)
            if decision is None:
                lines.append(format_status(0))
                continue
            micros = (spent[wid] + overhead) // 1000
            report = [Pass(self.stage.name, micros, decision.outcome)]
            lines.append(format_status(decision.exit_status, report))
        return b"".join(lines)

    def _check_overrides(self) -> None:
        row = self.conn.execute(
            query("settings_exist_for_stage"), {"stage": self.stage.name}
        ).fetchone()
        self.overrides.record(bool(row and row[0]))

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
            for problem in plans[wid].problems:
                self.stage_log.warning("message %d: per-address option ignored: %s", wid, problem)
        splits = [
            {"workqueue_id": wid, "groups": [list(g) for g in p.groups]}
            for wid, p in plans.items()
            if p.split
        ]
        if splits:
            rows = self.conn.execute(
                query("workqueue_split_many"), {"stage": self.stage.name, "splits": Jsonb(splits)}
            ).fetchall()
            for wid, new_ids in rows:
                if new_ids is None:  # no longer running here: nothing to do, as in `load`
                    del loaded.messages[wid]
                    continue
                loaded.messages[wid].recipients = plans[wid].groups[0]
                log.info("message %d split by per-address settings: new %s", wid, new_ids)
        for wid, msg in loaded.messages.items():
            msg.options = plans[wid].options[0]
        return loaded.messages

    def _call(self, msg: Message) -> Any:
        result = self.func(msg)
        if self.loop is not None and inspect.isawaitable(result):
            return self.loop.run_until_complete(result)
        return result

    def _run_traced(self, msg: Message, batch: Batch) -> None:
        parent = msg.properties.get(TRACEPARENT)
        with self.sink.stage_pass(msg.id, self.stage.name, parent) as outcome:
            self._run_one(msg, batch)
            outcome(batch.decisions[msg.id].outcome)

    def _run_one(self, msg: Message, batch: Batch) -> None:
        # An empty state (the common case) needs no copy to restore from.
        loaded_state = json.dumps(msg.state) if msg.state else "{}"
        try:
            decision = after_return(self._call(msg), msg, loaded_state, self.stages, self.now)
        except Exception as exc:  # any error is the stage's: PermanentError or a host failure
            if self.conn.broken and database_exit_code(exc) is not None:
                raise  # our own connection went (a lazy body load): the batch answers 74/75
            decision = after_raise(exc, msg, loaded_state, self.now)
        if decision.error is not None:
            self._log_failure(msg.id, decision)
        batch.add(msg.id, decision)

    def _log_failure(self, wid: int, decision: Decision) -> None:
        state = decision.state or {}
        if decision.outcome == "retry":
            self.stage_log.warning(
                "message %d: %s; retry %d at %s",
                wid,
                decision.error,
                state["temporary_failures"],
                decision.timeout,
            )
        elif state.get("failure_class") == "permanent":
            self.stage_log.error("message %d failed permanently: %s", wid, decision.error)
        else:
            self.stage_log.error("message %d: %s; giving up after retries", wid, decision.error)
