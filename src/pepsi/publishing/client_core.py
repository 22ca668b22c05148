"""What both publishers share: the routes, the call's options, the errors.

A publish is one round trip on a connection of the publisher's pool: one call
of `pepsi.workqueue_publish` in its own transaction (autocommit), committed
with synchronous_commit on before the call returns — the confirm. With
`connection=`, the call joins the caller's transaction instead (the outbox
pattern): the messages exist if and only if that transaction commits, and
their NOTIFY is delivered at that commit.

Lifecycle, as psycopg's pools: the constructor does no I/O; `open()`, a
`with`/`async with` block or the `connect()` class method opens the pool,
checks the schema and reads the overlay. Everything but the I/O (routes,
batches, errors) is here in `PublisherCore` and in `batch.py`, shared by
`sync_client.py` and `async_client.py`; the sync pipeline is the async one on
an event loop thread (DESIGN §9).

Confirms with replication (Q-2, Q-3): `confirm_timeout=` bounds the wait for
the confirm by shutting the connection down, never by cancelling the
statement (`confirm.py`); `retry=` tries a publish again after a failure
that wrote nothing, or whose outcome is unknown when every message is
deduplicated (`retry.py` decides). A connection found broken drains the pool:
after a failover, no connection to the old primary is handed out again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeGuard

import psycopg
from psycopg import pq

from pepsi.admin import serving
from pepsi.config import Config, OverlayRow, load_config, with_overlay
from pepsi.db import connect as db_connect
from pepsi.db import schema
from pepsi.errors import (
    DatabaseLost,
    DatabaseReadOnly,
    DatabaseUnavailable,
    PepsiError,
    classify,
    one_line,
)
from pepsi.publishing import retry as retrying
from pepsi.publishing.confirm import SAFE_AGAIN
from pepsi.publishing.errors import NotConfirmed, NotOpen, PublishFailed, Rejected
from pepsi.publishing.message import OutgoingMessage
from pepsi.publishing.retry import Retry

log = logging.getLogger("pepsi.publish")

REJECTED = "PP001"  # raised by pepsi.workqueue_publish when a stage is full
# psycopg_pool's own reconnect attempts double from 1 s for 5 minutes: after a
# failover the pool could wait many seconds after the new primary took writes.
# Its attempts give up after this instead, and a publish regrows it on demand
# at once (getconn on an empty pool connects).
POOL_RECONNECT_TIMEOUT = 0.5
# After a lost connection, a retried publish waits at most this long for the
# pool before it counts the attempt as "not written" and tries again: each
# try regrows the pool, so the new primary is found within about a second.
RECOVERY_WAIT = 0.5
AnyConn = psycopg.Connection[Any]
AnyAConn = psycopg.AsyncConnection[Any]


def as_message(stage: str | OutgoingMessage, body: Any, fields: dict[str, Any]) -> OutgoingMessage:
    """publish()'s arguments as one message: a stage and fields, or a message made already."""
    if isinstance(stage, OutgoingMessage):
        if body is not None or fields:
            raise TypeError(
                "publish(message) takes the message alone: put the body and fields in "
                "OutgoingMessage(...), or call publish(stage, body, **fields)"
            )
        return stage
    if not isinstance(stage, str):
        raise TypeError(
            f"publish() takes a stage name or an OutgoingMessage first, not {type(stage).__name__}"
        )
    if "recipients" in fields and fields["recipients"] is not None:
        recipients = fields["recipients"]
        if not isinstance(recipients, str | bytes):
            fields["recipients"] = tuple(recipients)
    return OutgoingMessage(stage, body, **fields)


def log_retry(exc: PepsiError, pause: float) -> None:
    # INFO: the CLI shows it (`pepsi ingress --retry`); a library's caller sees it if it asks
    log.info("publish not done (%s); trying again in %.1fs", one_line(exc), pause)


def domain_error(exc: psycopg.Error) -> PepsiError:
    """A database error outside the publish statement as a domain error (DESIGN §4)."""
    return classify(exc) or PublishFailed(f"publish failed: {one_line(exc)}", exc.sqlstate)


def publish_error(exc: psycopg.Error) -> PepsiError:
    """An error of the publish statement: refused, unknown outcome, or the database's."""
    if exc.sqlstate == REJECTED:
        return Rejected(str(exc.diag.message_primary), exc.diag.message_detail)
    domain = domain_error(exc)
    if isinstance(domain, DatabaseLost) and not isinstance(domain, DatabaseReadOnly):
        return NotConfirmed(f"connection lost before the confirm ({one_line(exc)}): {SAFE_AGAIN}")
    return domain


def owns_transaction(conn: AnyConn | AnyAConn) -> bool:
    """Whether the publish statement is its own transaction (its commit is the confirm)."""
    return conn.autocommit and conn.pgconn.transaction_status == pq.TransactionStatus.IDLE


def confirm_timeout_of(given: float | None, default: float | None) -> float | None:
    """A call's `confirm_timeout=`: None keeps the publisher's (None there: wait)."""
    value = default if given is None else given
    if value is not None and not value > 0:
        raise ValueError(f"confirm_timeout must be > 0 seconds or None, not {value!r}")
    return value


def pool_options(config: Config, dsn: str) -> dict[str, Any]:
    """The publishers' pools: [pepsi-postgres] sizes; autocommit connections made as
    every program's are (CONNECT_TIMEOUT, application name: `pepsi.db.connect`)."""
    pg = config.postgres
    params = db_connect.connect_params(
        dsn, application_name="pepsi-publish", timeout=pg.connect_timeout
    )
    return {
        "min_size": pg.pool_min_size,
        "max_size": pg.pool_max_size,
        "kwargs": {"autocommit": True, **params},
        "timeout": pg.connect_timeout,
        "reconnect_timeout": POOL_RECONNECT_TIMEOUT,
        "open": False,
    }


def require_schema(dsn: str, timeout: float) -> None:
    """A publisher's first connection: the schema is this build's, or one domain error."""
    try:
        with db_connect.connect(dsn, application_name="pepsi-publish", timeout=timeout) as c:
            schema.require_current(c)  # SchemaMismatch (78)
    except psycopg.Error as exc:
        raise domain_error(exc) from exc


def config_of(config: Config | Path | str | None) -> Config:
    if isinstance(config, Config):
        return config
    return load_config(Path(config) if config is not None else None)


class PublisherCore:
    """What both publishers share: the routes (configuration + overlay) and the checks."""

    def __init__(
        self,
        config: Config,
        dsn: str,
        *,
        confirm_timeout: float | None = None,
        retry: Retry | bool = False,
    ) -> None:
        self.base = config
        self.current = config
        self.dsn = dsn
        self.opened = False
        self.confirm_timeout = confirm_timeout_of(confirm_timeout, None)
        self.retry = retrying.policy(retry, None)
        self.recovering = False  # a connection was lost and none has worked since
        self.unserved: set[str] = set()  # stages the running dispatcher does not serve, unsaid
        # The stages `publish(stage, body)` goes to the short way (`_lean`); none until open.
        self.lean: frozenset[str] = frozenset()

    def _note_served(self, served: tuple[int | None, frozenset[str] | None]) -> None:
        """At open: the configured stages the running dispatcher does not serve."""
        pid, serves = served
        stages = dict.fromkeys(self.base.stages, 1)
        self.unserved = {s for s, _ in serving.unserved(stages, serves, running=pid is not None)}
        self._relean()

    def _warn_unserved(self, items: Sequence[OutgoingMessage]) -> None:
        """Once per stage: a publish to a stage the running dispatcher does not serve."""
        for stage in self.unserved & {m.stage for m in items}:
            self.unserved.discard(stage)
            log.warning(
                "publishing to stage %s, which the running dispatcher does not serve (its "
                "configuration has no [stage-%s]): the messages wait there",
                stage,
                stage,
            )
            self._relean()

    def _relean(self) -> None:
        """Which stages a bare `publish(stage, body)` may go to without an OutgoingMessage
        and a batch: known, without MAX_LENGTH, no warning due; none if every publish is
        retried (a message id each) or traced (a span each)."""
        if self.retry is not None or self.base.pepsi.share_telemetry:
            self.lean = frozenset()
            return
        stages = self.current.stages.items()
        self.lean = frozenset(
            name
            for name, s in stages
            if name and s.max_length is None and name not in self.unserved
        )

    def _lean(
        self,
        stage: object,
        fields: dict[str, Any],
        connection: object,
        timeout: object,
        retry: object,
    ) -> TypeGuard[str]:
        """Whether a publish() call is only a known stage and a body, on the pool, with the
        publisher's options: the call `batch.single` makes, checked as any other."""
        return (
            type(stage) is str
            and stage in self.lean
            and not fields
            and connection is None
            and timeout is None
            and retry is None
        )

    def _options(
        self, confirm_timeout: float | None, retry: Retry | bool | None, connection: object
    ) -> tuple[float | None, Retry | None]:
        """A call's deadline and retry policy. On the caller's connection there is no
        retry (only the caller can run its work again), and in the caller's transaction
        no deadline either: the confirm is the caller's COMMIT."""
        timeout = confirm_timeout_of(confirm_timeout, self.confirm_timeout)
        if connection is None:
            return timeout, retrying.policy(retry, self.retry)
        if retry:
            raise ValueError("retry= cannot be used with connection= (your connection, your retry)")
        return timeout, None

    def _pool_wait(self, remaining: float) -> float:
        """How long a retried attempt waits for a pool connection: within the deadline, and
        briefly after a lost connection (each new try makes the pool connect again)."""
        wait = min(self.base.postgres.connect_timeout, remaining)
        return min(wait, RECOVERY_WAIT) if self.recovering else wait

    def _lost(self, conn: AnyConn | AnyAConn, exc: BaseException) -> bool:
        """Whether `conn` failed as a failover leaves connections: broken, or on a standby."""
        return conn.broken or isinstance(classify(exc), DatabaseReadOnly)

    @property
    def config(self) -> Config:
        """The configuration with the database overlay, as last read."""
        return self.current

    def _apply(self, overlay: Sequence[OverlayRow]) -> None:
        self.current = with_overlay(self.base, overlay)
        if self.opened:
            self._relean()

    def _needs_refresh(self, messages: Sequence[OutgoingMessage]) -> bool:
        return any(m.stage not in self.current.stages for m in messages)

    def _require_open(self) -> None:
        if not self.opened:
            name = type(self).__name__
            raise NotOpen(f"the {name} is not open: use {name}.connect(), open() or a with block")

    def _unreachable(self) -> DatabaseUnavailable:
        return DatabaseUnavailable(
            f"cannot connect to the database ({db_connect.redact(self.dsn)})"
        )
