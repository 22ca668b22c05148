"""Stages for the exactly-once tests (issue 18): each inserts one row per message.

`tx_insert` writes through `msg.db`, in the transaction that records its
outcome (exactly once); `plain_insert` opens its own connection and commits
the row by itself, before the worker records the outcome (at least once).
Both write to `exactly_once_effects`, which the tests create. A message with
a `sleep` property sleeps that long at stage `one` after its insert (unless
it was struck before): a slow
message in flight when the dispatcher is killed is still running in its
orphaned worker after the next dispatcher has given it to another worker.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

from pepsi import Message, stage

INSERT = "INSERT INTO exactly_once_effects (workqueue_id, stage, pid) VALUES (%s, %s, %s)"
_own: list[psycopg.Connection[Any]] = []


def _slow(msg: Message) -> None:
    """Sleep as asked, unless struck before: a worker killed in the sleep struck it,
    and a slow message would soon draw the three strikes that fail it."""
    if msg.stage == "one" and "sleep" in msg.properties and not msg.redelivered:
        time.sleep(float(msg.properties["sleep"]))
        # A run that got this far, recorded on the side (committed at once): the
        # test compares these runs with the rows that were committed.
        _connection().execute(
            "INSERT INTO exactly_once_runs (workqueue_id, pid) VALUES (%s, %s)",
            (msg.id, os.getpid()),
        )


@stage(transactional=True)
def tx_insert(msg: Message) -> None:
    """The row and the advance (or finish) commit together."""
    msg.db.execute(INSERT, (msg.id, msg.stage, os.getpid()))
    _slow(msg)


@stage(transactional=True)
async def tx_insert_async(msg: Message) -> None:
    """The same, as an async stage: msg.db is the worker's synchronous connection."""
    msg.db.execute(INSERT, (msg.id, msg.stage, os.getpid()))


def _connection() -> psycopg.Connection[Any]:
    """The stage's own connection, opened again after the database restarted."""
    if not _own or _own[0].broken or _own[0].closed:
        _own[:] = [psycopg.connect(os.environ["PEPSI_DSN"], autocommit=True)]
    return _own[0]


@stage()
def plain_insert(msg: Message) -> None:
    """The row commits on its own; the outcome is recorded later, by the batch."""
    _connection().execute(INSERT, (msg.id, msg.stage, os.getpid()))
    _slow(msg)
