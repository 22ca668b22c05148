"""The overview's warnings: what an operator should look at now.

The MVCC horizon held back too long (`pepsi.admin.horizon`), stages whose
parallelism a connection-limit failure halved (back-pressure, from the
dispatcher serving the console), no dispatcher running, and stages with
pending rows that no running stage serves (`pepsi.admin.serving`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pepsi.admin import serving
from pepsi.admin.horizon import HORIZON_WARN_AFTER, warn_after, warning
from pepsi.admin.watch import top
from pepsi.durations import format_duration
from pepsi.errors import ConfigError


@dataclass(frozen=True)
class Notice:
    kind: str  # horizon, backpressure, dispatcher, ...
    text: str


def warnings(sample: top.Sample, dispatcher: Any) -> list[Notice]:
    out = []
    try:
        threshold = warn_after()
    except ConfigError:
        threshold = HORIZON_WARN_AFTER
    text = warning(sample.horizon, threshold)
    if text is not None:
        out.append(Notice("horizon", text.removeprefix("warning: ")))
    out.extend(backpressure(dispatcher))
    if sample.dispatcher_pid is None and dispatcher is None:
        out.append(Notice("dispatcher", "no dispatcher is running: nothing is processed"))
    pending = {stage: c.get("pending", 0) for stage, c in sample.counts.items()}
    running = sample.dispatcher_pid is not None or dispatcher is not None
    for stage, n in serving.unserved(pending, sample.serves, running=running):
        out.append(Notice("unserved", serving.describe(stage, n)))
    return out


def backpressure(dispatcher: Any) -> list[Notice]:
    """The stages whose parallelism a connection-limit failure (status 75) halved."""
    if dispatcher is None:
        return []
    try:
        supervisor = dispatcher.supervisor
        now = supervisor.clock()
        caps = dict(supervisor.caps)
        pools = supervisor.pools
    except AttributeError:
        return []
    out = []
    for stage, cap in sorted(caps.items()):
        if cap.until <= now:
            continue
        pool = pools.get(stage)
        parallelism = pool.config.parallelism if pool is not None else "?"
        out.append(
            Notice(
                "backpressure",
                f"stage {stage} is held to {cap.workers} worker(s) of {parallelism} for "
                f"{format_duration(cap.until - now)} more: the database's connection limit "
                "was reached (status 75)",
            )
        )
    return out
