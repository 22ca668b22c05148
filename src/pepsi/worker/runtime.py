"""`pepsi worker`: run one HANDLER stage behind the line protocol (W-1, W-2, W-8).

Start: check the configuration and import the stage function (exit 78 if
either is wrong), connect, check the schema (78 if not current), print
`ready`. A stage the file does not define is looked up again with the
database overlay (`pepsi.config_override`) once connected. Then, until stdin
closes: take a batch of ids (every id already buffered, up to QUEUE_LIMIT,
for a metadata-only stage; one at a time for a stage that reads the header
block or body), hand it to the `StageRunner` and write its status lines.

The parts: `handlers` (importing the function), `messages` (rows to
`Message`s), `outcomes` (the pure decision: a stage's result to a row
update), `runner` (a batch over one connection), `reader` (ids from stdin).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from functools import partial
from typing import Any

from psycopg.types.json import set_json_loads

from pepsi.config import Config, StageConfig, read_overlay, with_overlay
from pepsi.db import schema
from pepsi.db.connect import DEFAULT_TIMEOUT, connect
from pepsi.db.queries import query
from pepsi.errors import ConfigError, DatabaseBusy, DatabaseLost, DatabaseUnavailable, WorkerRefused
from pepsi.protocol import READY, READY_ROWS
from pepsi.telemetry import Sink, install
from pepsi.worker.handlers import StageFunc, load_handler
from pepsi.worker.messages import Conn
from pepsi.worker.reader import IdReader
from pepsi.worker.runner import StageRunner


def run(config: Config, stage_name: str, dsn: str) -> int:
    """The worker's main loop; returns the exit status."""
    stage = config.stages.get(stage_name)
    func = None if stage is None else _import(config, stage)

    open_connection = partial(
        connect_worker,
        dsn,
        stage_name,
        synchronous_commit=config.postgres.worker_synchronous_commit,
        timeout=config.postgres.connect_timeout,
    )
    conn = open_connection()
    with conn:
        schema.require_current(conn)
        if stage is None:  # not in the file: perhaps a stage added in the database
            try:
                config = with_overlay(config, read_overlay(conn))
            except ConfigError as exc:  # an overlay row that does not parse: refuse (W-7)
                raise WorkerRefused(str(exc)) from None
            stage = config.stages.get(stage_name)
            if stage is None:
                raise WorkerRefused(
                    f"no [stage-{stage_name}] in the configuration", file=_file(config)
                )
            func = _import(config, stage)
        assert func is not None
        # Once, from the file (P-11): `pepsi telemetry on|off` replaces the worker instead.
        sink = install(config, stage)
        # For `pepsi telemetry status`: on means on and OpenTelemetry there. A reconnect too.
        mark_telemetry(conn, sink.enabled)
        open_connection = partial(open_connection, telemetry=sink.enabled)
        runner = StageRunner(config, stage, func, conn, reconnect=open_connection, sink=sink)
        out = sys.stdout.buffer
        out.write((READY_ROWS if runner.takes_rows else READY) + b"\n")
        out.flush()
        reader = IdReader(sys.stdin.fileno())
        try:
            while True:
                ids = reader.read_batch(runner.batch_limit)
                if not ids:
                    return 0
                for lines in runner.answers(ids, reader.rows):
                    out.write(lines)
                    out.flush()
        finally:
            _flush(sink)


def _flush(sink: Sink) -> None:
    """Export what is still buffered before the worker goes (stdin closed, an error)."""
    try:
        sink.shutdown()
    except Exception as exc:  # noqa: BLE001  # telemetry never decides a worker's exit status
        logging.getLogger("pepsi.telemetry").warning("telemetry not flushed: %s", exc)


def _import(config: Config, stage: StageConfig) -> StageFunc:
    """The stage's function; a HANDLER's module may sit next to the configuration file."""
    if config.path is not None:
        sys.path.insert(0, str(config.path.parent))
    return load_handler(stage)


def _loads_json(data: bytes | str) -> Any:
    """psycopg's json loader, without decoding the usual empty state and properties."""
    if data in (b"{}", "{}"):
        return {}  # a new dict each time: a stage may fill it
    return json.loads(data)


def connect_worker(
    dsn: str,
    stage_name: str,
    *,
    synchronous_commit: bool,
    timeout: float = DEFAULT_TIMEOUT,
    telemetry: bool | None = None,
) -> Conn:
    """The worker's connection; a refused one is DatabaseBusy (75) or DatabaseLost (74).

    With `telemetry` True or False, the connection is marked as a worker's
    that reports telemetry, or does not (`mark_telemetry`).
    """
    settings = None if synchronous_commit else {"synchronous_commit": "off"}
    try:
        conn = connect(
            dsn, application_name=f"pepsi-worker:{stage_name}", timeout=timeout, settings=settings
        )
    except DatabaseBusy:
        raise
    except DatabaseUnavailable as exc:  # to the dispatcher, no database is a lost one (74)
        raise DatabaseLost(str(exc), sqlstate=exc.sqlstate) from None
    set_json_loads(_loads_json, conn)
    if telemetry is not None:
        mark_telemetry(conn, telemetry)
    return conn


def mark_telemetry(conn: Conn, on: bool) -> None:
    """Hold the session's shared advisory lock that says whether this worker reports.

    `pepsi telemetry status` counts them in pg_locks: what live workers run
    with, without renaming the connection (`pepsi top` reads its name).
    """
    conn.execute(query("telemetry_worker_mark"), {"on": on})


def _file(config: Config) -> str | None:
    return str(config.path) if config.path else None


def stage_from_env() -> str:
    name = os.environ.get("PEPSI_STAGE")
    if not name:
        raise WorkerRefused("PEPSI_STAGE is not set (the dispatcher sets it for its workers)")
    return name
