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
import json
import logging
import select
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.types.json import Jsonb

from pepsi.config import Config, StageConfig
from pepsi.db.connect import one_line
from pepsi.db.queries import query
from pepsi.errors import (
    EX_IOERR,
    EX_TEMPFAIL,
    DatabaseUnavailable,
    WorkerRefused,
    database_exit_code,
)
from pepsi.protocol import Pass, format_status
from pepsi.stage import Message, Needs, PermanentError, is_transactional, needs_of
from pepsi.telemetry import NO_SINK, TRACEPARENT, Sink
from pepsi.worker import edits
from pepsi.worker.fusion import fusable, may_fuse
from pepsi.worker.handlers import StageFunc, load_handler
from pepsi.worker.messages import Conn, MessageLoader
from pepsi.worker.outcomes import Clock, Decision, after_raise, after_return
from pepsi.worker.settings import OverrideCheck, Plan, plan
from pepsi.worker.writes import Batch, outcome_word, split_params

log = logging.getLogger("pepsi.worker")
# A batch whose messages have run this long is written and answered before the
# next message runs (its outcomes in one statement, its status lines at once).
FLUSH_AFTER_NS = 100_000_000


class _DatabaseGone(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _Undo(Exception):  # not an error: leaves a stage's transaction
    """Rolls a transactional stage's writes back: its row is no longer its own, or
    its result is a failure (then the decision is recorded after the rollback)."""

    def __init__(self, decision: Decision | None) -> None:
        super().__init__()
        self.decision = decision


def utc_now() -> datetime:
    """The runner's clock (the decisions take it injected)."""
    return datetime.now(UTC)


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
    def answer_each(self) -> bool:
        """Whether each message's outcome is written and answered before the next runs.

        A stage that reads the message's content does work that may reach outside
        the database (a relay's SMTP, a signature): a crash must not make it run
        again for the batch-mates that went before (the manual's one at a time).
        A metadata-only stage writes its batch at once (W-8)."""
        return self.needs is not Needs.METADATA

    def run_batch(self, ids: list[int]) -> bytes:
        """Process `ids`; return their status lines, in order, as one buffer."""
        return b"".join(self.answers(ids))

    def answers(self, ids: list[int]) -> Iterator[bytes]:
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
        """
        answered = 0
        try:
            if self.conn.closed or self.conn.broken or ended_by_server(self.conn):
                self._reopen()
            for lines, count in self._run_batch(ids):
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

    def _run_batch(self, ids: list[int]) -> Iterator[tuple[bytes, int]]:
        """Run the batch; each written segment's status lines and how many ids they answer."""
        started = time.perf_counter_ns()
        if self.overrides.due():  # at most every few seconds while the stage has none
            self._check_overrides()
        if self.overrides.exists:
            messages = self._load_with_settings(ids)
        else:
            messages = self.messages.load(self.conn, ids)
        segment: list[int] = []
        batch = Batch()
        spent: dict[int, int] = {}
        traced = self.sink.enabled
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
            if self.answer_each or now - started >= FLUSH_AFTER_NS or wid == ids[-1]:
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

    def _call(self, msg: Message, func: StageFunc | None = None) -> Any:
        if self.refused and func is None and msg.id in self.refused:
            raise PermanentError(self.refused.pop(msg.id))
        result = (func or self.func)(msg)
        if inspect.isawaitable(result):
            if self.loop is None:  # a fused async successor of a sync stage
                self.loop = asyncio.new_event_loop()
            return self.loop.run_until_complete(result)
        return result

    def _run_traced(self, msg: Message, batch: Batch) -> None:
        parent = msg.properties.get(TRACEPARENT)
        with self.sink.stage_pass(msg.id, self.stage.name, parent) as outcome:
            self._run_one(msg, batch)
            passes = batch.passes.get(msg.id)  # fused: this span is the first stage's
            decision = batch.decisions.get(msg.id)  # none: the row was not ours (issue 18)
            outcome(passes[0][2] if passes else decision.outcome if decision else "none")

    def _run_one(self, msg: Message, batch: Batch) -> None:
        if self.transactional:
            self._run_transactional(msg, batch)
            return
        # An empty state (the common case) needs no copy to restore from.
        loaded_state = json.dumps(msg.state) if msg.state else "{}"
        loaded = edits.snapshot(msg)
        if not self.fuse_into:
            decision = self._decide(msg, loaded_state, loaded)
        else:
            started = time.perf_counter_ns()
            decision = self._decide(msg, loaded_state, loaded)
            # a split's row advances with its parts and new messages: written, not fused
            if (
                decision.outcome == "advance"
                and decision.parts is None
                and decision.stage in self.fuse_into
            ):
                decision = self._fuse(msg, decision, loaded, started, batch)
        decision = self._with_edits(msg, decision, loaded, loaded_state)
        self._log_failures(msg, decision)
        batch.add(msg.id, decision)

    def _run_transactional(self, msg: Message, batch: Batch) -> None:
        """Issue 18: the stage and its outcome in one transaction; never fused.

        Success: the stage's writes and the guarded outcome commit together.
        A failure (an exception, or a result that is a host failure): the
        writes roll back, then the failure's outcome is recorded, guarded
        too. A row no longer this worker's (token, status or stage changed):
        rolled back, nothing recorded, no decision (answered 0, as a row a
        repair moved).
        """
        loaded_state = json.dumps(msg.state) if msg.state else "{}"
        loaded = edits.snapshot(msg)
        decision: Decision | None = None
        try:
            with self.conn.transaction():
                msg._db = self.conn
                try:
                    result = self._call(msg)
                finally:
                    msg._db = None
                decision = after_return(result, msg, loaded_state, self.stages, self.now)
                if decision.error is None:
                    decision = self._with_edits(msg, decision, loaded, loaded_state)
                if decision.error is not None:
                    raise _Undo(decision)  # a host failure: its writes must not stay
                if not self._record(msg, decision):
                    raise _Undo(None)
        except _Undo as undo:
            decision = undo.decision
        except Exception as exc:  # the stage's, its writes', the outcome's or the commit's
            if self.conn.broken and database_exit_code(exc) is not None:
                raise  # our own connection went: the batch answers 74/75
            decision = after_raise(exc, msg, loaded_state, self.now)
        else:  # committed: the stage's writes and the outcome
            assert decision is not None
            batch.decisions[msg.id] = decision
            return
        if decision is None or not self._record(msg, decision):
            log.info("message %d is no longer this worker's: its writes rolled back", msg.id)
            return
        self._log_failures(msg, decision)
        batch.decisions[msg.id] = decision

    def _record(self, msg: Message, decision: Decision) -> bool:
        """Write one row's outcome, guarded by its claim token; whether it was written.

        An outcome with edits goes as a split of one part, which applies them."""
        if decision.parts is None and decision.edits is not None:
            decision = decision._replace(parts=((tuple(msg.recipients), decision),))
        if decision.parts is not None:
            params = split_params(msg.id, self.stage.name, decision, token=msg._token)
            found = self.conn.execute(query("workqueue_record_split"), params).fetchone()
            return found is not None and found[0] is not None
        row = self.conn.execute(
            query("workqueue_record_outcome_tx"),
            {
                "id": msg.id,
                "stage": self.stage.name,
                "token": msg._token,
                "outcome": outcome_word(decision),
                "next_stage": decision.stage,
                "until": decision.timeout,
                "state": None if decision.state is None else Jsonb(decision.state),
            },
        ).fetchone()
        return bool(row and row[0])

    def _decide(
        self,
        msg: Message,
        loaded_state: str,
        before: edits.Snapshot,
        func: StageFunc | None = None,
    ) -> Decision:
        """Run the stage; its decision. A stage that fails leaves no edits behind."""
        try:
            result = self._call(msg, func)
            decision = after_return(result, msg, loaded_state, self.stages, self.now)
        except Exception as exc:  # any error is the stage's: PermanentError or a host failure
            if self.conn.broken and database_exit_code(exc) is not None:
                raise  # our own connection went (a lazy body load): the batch answers 74/75
            decision = after_raise(exc, msg, loaded_state, self.now)
        # (a split's first part may retry or fail: its edits stand, as a transactional stage's)
        failed = decision.parts is None and decision.outcome in ("retry", "fail")
        if failed and edits.changed(msg, before):
            edits.restore(msg, before)
        return decision

    def _with_edits(
        self, msg: Message, decision: Decision, loaded: edits.Snapshot, loaded_state: str
    ) -> Decision:
        """The decision with what the stage (or fused chain) changed in the message."""
        if decision.stage is None:
            return decision  # finished: nothing of the row is left to change
        found = edits.edits(msg, loaded)
        if found is None:
            return decision
        problem = edits.problem(found)
        if problem is not None:  # the stage's mistake: a host failure, nothing changed
            edits.restore(msg, loaded)
            return after_raise(TypeError(problem), msg, loaded_state, self.now)
        return decision._replace(edits=found)

    def _fuse(
        self,
        msg: Message,
        decision: Decision,
        loaded: edits.Snapshot,
        started: int,
        batch: Batch,
    ) -> Decision:
        """Run the successors this advance may fuse (W-10); the last stage's decision.

        The row is written once, by the batch, with the decision of the stage
        the chain stopped at: an advance to a stage that may not be fused, a
        finish, or that stage's own failure (its MAX_LIFETIME, its
        BOUNCE_STAGE), with the state every fused stage left.
        """
        passes = [(self.stage.name, time.perf_counter_ns() - started, decision.outcome)]
        while decision.outcome == "advance" and decision.parts is None and decision.stage:
            successor = self.fuse_into.get(decision.stage)
            handler = self._handler(successor) if successor is not None else None
            if successor is None or handler is None:
                break
            if not may_fuse(
                successor,
                loaded=self.needs,
                needs=handler[1],
                depth=len(passes),
                refused=not decision.fuse,
                # a rewritten message with recipients a later split would clone from
                changed=len(msg.recipients) > 1 and edits.changed(msg, loaded),
                overridden=successor.name in self.overridden,
                transactional=is_transactional(handler[0]),
            ):
                break
            msg.stage, msg.options = successor.name, successor
            msg.state = decision.state if decision.state is not None else {}
            loaded_state = json.dumps(msg.state) if msg.state else "{}"
            started = time.perf_counter_ns()
            before = edits.snapshot(msg)
            if self.sink.enabled:  # P-11: a span per stage, fused or not
                parent = msg.properties.get(TRACEPARENT)
                with self.sink.stage_pass(msg.id, successor.name, parent) as outcome:
                    decision = self._decide(msg, loaded_state, before, handler[0])
                    outcome(decision.outcome)
            else:
                decision = self._decide(msg, loaded_state, before, handler[0])
            passes.append((successor.name, time.perf_counter_ns() - started, decision.outcome))
        if len(passes) > 1:
            batch.passes[msg.id] = passes
        return decision

    def _handler(self, stage: StageConfig) -> tuple[StageFunc, Needs] | None:
        """A successor's function, imported once; None if it cannot be (then it is dispatched)."""
        if stage.name not in self.handlers:
            try:
                func = load_handler(stage)
            except WorkerRefused as exc:
                log.warning("stage %s is not fused: %s", stage.name, exc)
                self.handlers[stage.name] = None
            else:
                self.handlers[stage.name] = (func, needs_of(func))
        return self.handlers[stage.name]

    def _log_failures(self, msg: Message, decision: Decision) -> None:
        """Log a failed outcome: the message's, or each failed part's of a split."""
        if decision.parts is None:
            if decision.error is not None:
                self._log_failure(msg, decision)
            return
        for recipients, part in decision.parts:
            if part.error is not None:
                self._log_failure(msg, part, f" ({len(recipients)} of its recipients)")

    def _log_failure(self, msg: Message, decision: Decision, which: str = "") -> None:
        wid = msg.id
        stage_log = (
            self.stage_log
            if msg.stage == self.stage.name
            else logging.getLogger(f"pepsi.stage.{msg.stage}")
        )
        state = decision.state or {}
        if decision.outcome == "retry":
            stage_log.warning(
                "message %d%s: %s; retry %d at %s",
                wid,
                which,
                decision.error,
                state["temporary_failures"],
                decision.timeout,
            )
        elif state.get("failure_class") == "permanent":
            stage_log.error("message %d%s failed permanently: %s", wid, which, decision.error)
        else:
            stage_log.error("message %d%s: %s; giving up after retries", wid, which, decision.error)


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
