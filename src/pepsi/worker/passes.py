"""One message's pass through the stage: the call, its decision, its edits.

`StageRunner` runs a batch and writes it; what happens to each message is
here: the stage function called (a coroutine on the runner's event loop),
its result or exception decided (`outcomes`), what it changed in the
message kept or restored (`edits`), the successors an advance may run in the
same pass (W-10), a transactional stage's message in a transaction of its
own with its outcome guarded by the claim token (issue 18), and the log
line of a failure.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from psycopg.types.json import Jsonb

from pepsi.config import StageConfig
from pepsi.db.queries import query
from pepsi.errors import WorkerRefused, database_exit_code
from pepsi.stage import Message, Needs, PermanentError, is_transactional, needs_of
from pepsi.telemetry import TRACEPARENT, Sink
from pepsi.worker import edits
from pepsi.worker.fusion import may_fuse
from pepsi.worker.handlers import StageFunc, load_handler
from pepsi.worker.messages import Conn
from pepsi.worker.outcomes import Clock, Decision, after_raise, after_return
from pepsi.worker.writes import Batch, outcome_word, split_params

log = logging.getLogger("pepsi.worker")


class _Undo(Exception):  # not an error: leaves a stage's transaction
    """Rolls a transactional stage's writes back: its row is no longer its own, or
    its result is a failure (then the decision is recorded after the rollback)."""

    def __init__(self, decision: Decision | None) -> None:
        super().__init__()
        self.decision = decision


class MessagePasses:
    """Runs one message of a batch through the stage (and what it may fuse); a base of
    `StageRunner`, which sets these attributes."""

    stage: StageConfig
    stages: Mapping[str, StageConfig]  # where an Advance may go
    func: StageFunc
    needs: Needs
    transactional: bool
    conn: Conn
    now: Clock
    sink: Sink
    fuse_into: dict[str, StageConfig]
    overridden: frozenset[str]
    refused: dict[int, str]
    handlers: dict[str, tuple[StageFunc, Needs] | None]
    stage_log: logging.Logger
    loop: asyncio.AbstractEventLoop | None

    def _call(self, msg: Message, func: StageFunc | None = None) -> Any:
        if self.refused and func is None and msg.id in self.refused:
            raise PermanentError(self.refused.pop(msg.id))
        result = (func or self.func)(msg)
        if result is not None and inspect.isawaitable(result):  # None: most stages
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
