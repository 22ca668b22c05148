"""`pepsi worker`: run one HANDLER stage behind the line protocol (W-1, W-2, W-8).

Start: check the configuration and import the stage function (exit 78 if
either is wrong), connect, check the schema (78 if not current), print
`ready`. Then, until stdin closes: take a batch of ids (every id already
buffered, up to QUEUE_LIMIT, for a metadata-only stage; one at a time for a
stage that reads the header block or body), load them in one SELECT, run the
stage on each, record every outcome in one statement, and write one status
line per id, in order.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb, set_json_loads

from pepsi import policy
from pepsi.config import Config, StageConfig
from pepsi.db import schema
from pepsi.db.connect import one_line
from pepsi.db.queries import query
from pepsi.errors import (
    EX_CONFIG,
    EX_IOERR,
    EX_TEMPFAIL,
    ConfigError,
    DatabaseUnavailable,
    database_exit_code,
)
from pepsi.protocol import READY, Pass, format_status
from pepsi.stage import Advance, Finish, Message, Needs, Pause, PermanentError, needs_of
from pepsi.worker.reader import IdReader

log = logging.getLogger("pepsi.worker")
Conn = psycopg.Connection[tuple[Any, ...]]
StageFunc = Callable[[Message], Any]
STATUS_FAILED = 1
PER_STAGE = ("strikes", "temporary_failures")  # counts that start again at each stage


class _DatabaseGone(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class WorkerRefused(ConfigError):
    """The worker cannot run this stage as configured: exit 78 before ready."""

    exit_code = EX_CONFIG


def load_handler(stage: StageConfig) -> StageFunc:
    """Import `package.module:function`; WorkerRefused if it is not there."""
    if stage.handler is None:
        raise WorkerRefused(
            "has no HANDLER: `pepsi worker` runs Python stages only",
            section=f"stage-{stage.name}",
        )
    module_name, _, attr = stage.handler.partition(":")
    where = {"section": f"stage-{stage.name}", "key": "HANDLER"}
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except ImportError as exc:
        raise WorkerRefused(f"cannot import {module_name}: {exc}", **where) from None
    except AttributeError:
        raise WorkerRefused(f"{module_name} has no {attr}", **where) from None
    except Exception as exc:  # noqa: BLE001  # a module failing at import: refuse (W-7)
        detail = f"{type(exc).__name__}: {exc}"
        raise WorkerRefused(f"importing {module_name} failed: {detail}", **where) from None
    if not callable(target):
        raise WorkerRefused(f"{stage.handler} is not callable", **where)
    func: StageFunc = target
    return func


@dataclass
class Batch:
    """Outcomes collected for one batch, written in one statement."""

    finished: list[int] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    outcomes: dict[int, str] = field(default_factory=dict)  # for the report (P-9)


class StageRunner:
    """Runs one stage's function over batches of ids on one connection."""

    def __init__(
        self,
        config: Config,
        stage: StageConfig,
        func: StageFunc,
        conn: Conn,
        reconnect: Callable[[], Conn] | None = None,
    ) -> None:
        self.config = config
        self.stage = stage
        self.func = func
        self.needs = needs_of(func)
        self.conn = conn
        self.reconnect = reconnect
        self.stage_log = logging.getLogger(f"pepsi.stage.{stage.name}")
        self.loop: asyncio.AbstractEventLoop | None = None
        if inspect.iscoroutinefunction(func):
            self.loop = asyncio.new_event_loop()

    @property
    def batch_limit(self) -> int:
        """Metadata-only stages take every buffered id (W-8); others one at a time."""
        return self.stage.queue_limit if self.needs is Needs.METADATA else 1

    def load(self, ids: list[int]) -> dict[int, Message]:
        rows = self.conn.execute(
            query("workqueue_load_running"),
            {
                "ids": ids,
                "stage": self.stage.name,
                "with_header": self.needs is not Needs.METADATA,
                "with_body": self.needs is Needs.BODY,
            },
        ).fetchall()
        return {int(row[0]): self._message(row) for row in rows}

    def _message(self, row: tuple[Any, ...]) -> Message:
        (wid, stage, arrived, message_id, sender, recipients, user, peer, header_from,
         subject, content_type, correlation_id, properties, state, sender_key, body_id,
         header, body) = row  # fmt: skip
        msg = Message(
            id=wid,
            stage=stage,
            arrived=arrived,
            options=self.stage,
            message_id=message_id,
            sender=sender,
            recipients=tuple(recipients or ()),
            origin_user=user,
            origin_peer=peer,
            header_from=header_from,
            subject=subject,
            content_type=content_type,
            correlation_id=correlation_id,
            properties=dict(properties or {}),
            state=dict(state or {}),
            sender_key=sender_key,
            _header=header,
            _body=body,
        )
        if self.needs is not Needs.BODY and body_id is not None:
            msg._loader = self._body_loader(body_id, keep_header=self.needs is Needs.HEADER)
        return msg

    def _body_loader(
        self, body_id: int, *, keep_header: bool
    ) -> Callable[[], tuple[bytes | None, bytes | None]]:
        """Load what the stage did not declare, on first access (one SELECT)."""

        def load() -> tuple[bytes | None, bytes | None]:
            row = self.conn.execute(
                query("workqueue_body_get"), {"body_id": body_id, "with_header": not keep_header}
            ).fetchone()
            return (row[0], row[1]) if row else (None, None)

        return load

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
        messages = self.load(ids)
        batch = Batch()
        spent: dict[int, int] = {}
        for wid in ids:
            msg = messages.get(wid)
            if msg is None:
                # No longer running here (moved by a repair command): nothing to do.
                batch.statuses[wid] = 0
                continue
            t0 = time.perf_counter_ns()
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
            report = None
            if wid in spent:
                micros = (spent[wid] + overhead) // 1000
                report = [Pass(self.stage.name, micros, batch.outcomes.get(wid))]
            lines.append(format_status(batch.statuses[wid], report))
        return b"".join(lines)

    def _call(self, msg: Message) -> Any:
        result = self.func(msg)
        if self.loop is not None and inspect.isawaitable(result):
            return self.loop.run_until_complete(result)
        return result

    def _run_one(self, msg: Message, batch: Batch) -> None:
        # An empty state (the common case) needs no copy to restore from.
        loaded_state = json.dumps(msg.state) if msg.state else "{}"
        try:
            outcome = self._call(msg)
            _check_state(msg, loaded_state)
            self._record(msg, outcome, batch)
        except PermanentError as exc:
            _check_state(msg, loaded_state, quiet=True)
            decision = policy.on_permanent_error(msg.stage, msg.state, str(exc) or "permanent")
            self.stage_log.error("message %d failed permanently: %s", msg.id, exc)
            self._apply(msg, decision, batch)
        except Exception as exc:  # any other error is a host failure (W-3)
            if self.conn.broken and database_exit_code(exc) is not None:
                raise  # our own connection went (a lazy body load): the batch answers 74/75
            _check_state(msg, loaded_state, quiet=True)
            self._host_failure(msg, f"{type(exc).__name__}: {exc}", batch)

    def _record(self, msg: Message, outcome: Any, batch: Batch) -> None:
        if outcome is None:
            outcome = Advance()
        match outcome:
            case Advance(to=to):
                target = to or self.stage.next
                if target is None:
                    batch.finished.append(msg.id)
                    batch.outcomes[msg.id] = "finish"
                elif target not in self.config.stages:
                    self._host_failure(msg, f"advance to unknown stage {target!r}", batch)
                    return
                else:
                    state = msg.state
                    if target != msg.stage:  # retry and strike counts are per stage
                        state = {k: v for k, v in state.items() if k not in PER_STAGE}
                    batch.updates.append(_update(msg.id, target, "pending", state))
                    batch.outcomes[msg.id] = "advance"
            case Finish():
                batch.finished.append(msg.id)
                batch.outcomes[msg.id] = "finish"
            case Pause(until=until, reason=reason):
                state = {**msg.state, "pause_reason": reason} if reason else msg.state
                batch.updates.append(_update(msg.id, msg.stage, "paused", state, until))
                batch.outcomes[msg.id] = "pause"
            case _:
                self._host_failure(msg, f"stage returned {outcome!r}, not an outcome", batch)
                return
        batch.statuses[msg.id] = 0

    def _host_failure(self, msg: Message, error: str, batch: Batch) -> None:
        decision = policy.on_host_failure(
            msg.stage,
            msg.state,
            error,
            arrived=msg.arrived,
            now=datetime.now(UTC),
            max_lifetime=self.stage.max_lifetime,
            bounce_stage=self.stage.bounce_stage,
            first_delay=self.stage.retry_delay,
            max_delay=self.stage.retry_max_delay,
        )
        if decision.status == "paused":
            self.stage_log.warning(
                "message %d: %s; retry %d at %s",
                msg.id,
                error,
                decision.state["temporary_failures"],
                decision.timeout,
            )
        else:
            self.stage_log.error("message %d: %s; giving up after retries", msg.id, error)
        self._apply(msg, decision, batch)

    def _apply(self, msg: Message, decision: policy.Decision, batch: Batch) -> None:
        batch.updates.append(
            _update(msg.id, decision.stage, decision.status, decision.state, decision.timeout)
        )
        failed = decision.status == "failed"
        batch.statuses[msg.id] = STATUS_FAILED if failed else 0
        # paused: a retry after a host failure; pending: bounced on to BOUNCE_STAGE
        batch.outcomes[msg.id] = {"failed": "fail", "paused": "retry"}.get(
            decision.status, "advance"
        )


def _check_state(msg: Message, loaded: str, *, quiet: bool = False) -> None:
    """A state that is not JSON cannot be written: restore the loaded one.

    On the success path that is the stage's error (a host failure); on an
    error path the stage's own error is what gets recorded.
    """
    if type(msg.state) is dict and not msg.state:
        return  # empty: JSON as it stands (the common case, without encoding it)
    try:
        json.dumps(msg.state)
    except (TypeError, ValueError) as exc:
        msg.state = json.loads(loaded)
        if not quiet:
            raise TypeError(f"state is not JSON: {exc}") from None


def _update(
    wid: int, stage: str, status: str, state: dict[str, Any], timeout: datetime | None = None
) -> dict[str, Any]:
    return {
        "workqueue_id": wid,
        "stage": stage,
        "status": status,
        "timeout": timeout.isoformat() if timeout else None,
        "state": state,
    }


def run(config: Config, stage_name: str, dsn: str) -> int:
    """The worker's main loop; returns the exit status."""
    stage = config.stages.get(stage_name)
    if stage is None:
        raise WorkerRefused(f"no [stage-{stage_name}] in the configuration", file=_file(config))
    if config.path is not None:
        sys.path.insert(0, str(config.path.parent))
    func = load_handler(stage)

    def open_connection() -> Conn:
        conn = connect_worker(dsn, stage_name)
        set_json_loads(_loads_json, conn)
        if not config.postgres.worker_synchronous_commit:
            conn.execute(query("worker_asynchronous_commit"))
        return conn

    conn = open_connection()
    with conn:
        schema.require_current(conn)
        runner = StageRunner(config, stage, func, conn, reconnect=open_connection)
        out = sys.stdout.buffer
        out.write(READY + b"\n")
        out.flush()
        reader = IdReader(sys.stdin.fileno())
        while True:
            ids = reader.read_batch(runner.batch_limit)
            if not ids:
                return 0
            out.write(runner.run_batch(ids))
            out.flush()


def _loads_json(data: bytes | str) -> Any:
    """psycopg's json loader, without decoding the usual empty state and properties."""
    if data in (b"{}", "{}"):
        return {}  # a new dict each time: a stage may fill it
    return json.loads(data)


def connect_worker(dsn: str, stage_name: str) -> Conn:
    """The worker's connection; a refused one says whether to answer 74 or 75."""
    try:
        return psycopg.connect(dsn, autocommit=True, application_name=f"pepsi-worker:{stage_name}")
    except psycopg.Error as exc:
        error = DatabaseUnavailable(f"cannot connect to the database: {one_line(exc)}")
        error.exit_code = database_exit_code(exc) or EX_IOERR
        raise error from None


def _file(config: Config) -> str | None:
    return str(config.path) if config.path else None


def stage_from_env() -> str:
    name = os.environ.get("PEPSI_STAGE")
    if not name:
        raise WorkerRefused("PEPSI_STAGE is not set (the dispatcher sets it for its workers)")
    return name
