"""Which stages the running dispatcher serves, and the messages waiting where it does not.

Every configuration without a DATA_DIR of its own shares one embedded database, which
one dispatcher serves, with its own configuration's stages. A message published to a
stage that configuration lacks waits, pending, and nothing said why. The dispatcher
writes the stages it serves at its start and at each reload (`dispatch_stats.serves`,
migration 0021); `pepsi top`, `pepsi queue status`, the web console and a publisher
read them and name the stages with pending messages that the running dispatcher does
not serve. AMQP queues (`amqp:` stages) are served by the broker's consumers instead.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from pepsi.config.values import is_amqp_stage
from pepsi.db.queries import query

if TYPE_CHECKING:
    import psycopg


Served = tuple[int | None, frozenset[str] | None]  # the dispatcher's pid, its stages


def served(conn: psycopg.Connection[Any]) -> Served:
    """The running dispatcher's backend pid (None: none runs) and the stages it serves
    (None: not known, a dispatcher of a build before it said)."""
    holder = conn.execute(query("dispatcher_lock_holder")).fetchone()
    row = conn.execute(query("dispatch_serves_get")).fetchone()
    stages = None if row is None or row[0] is None else frozenset(str(s) for s in row[0])
    return (None if holder is None else int(holder[0])), stages


async def served_async(conn: psycopg.AsyncConnection[Any]) -> Served:
    """`served`, on an async connection."""
    holder = await (await conn.execute(query("dispatcher_lock_holder"))).fetchone()
    row = await (await conn.execute(query("dispatch_serves_get"))).fetchone()
    stages = None if row is None or row[0] is None else frozenset(str(s) for s in row[0])
    return (None if holder is None else int(holder[0])), stages


def unserved(
    pending: Mapping[str, int], serves: Collection[str] | None, *, running: bool
) -> list[tuple[str, int]]:
    """The stages with pending messages that the running dispatcher does not serve, by
    name: (stage, pending). Nothing when no dispatcher runs (that is said elsewhere) or
    when what it serves is not known."""
    if not running or serves is None:
        return []
    return sorted(
        (stage, n)
        for stage, n in pending.items()
        if n > 0 and stage not in serves and not is_amqp_stage(stage)
    )


def describe(stage: str, pending: int) -> str:
    """One line for one such stage."""
    return (
        f"stage {stage}: {pending} pending message(s) that the running dispatcher does not "
        f"serve (its configuration has no [stage-{stage}]); they wait until one that does runs"
    )
