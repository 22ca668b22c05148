"""Testing a stage in-process: no database, no dispatcher, no worker process.

    from pepsi.testing import make_message, run_stage

    def test_route() -> None:
        msg = make_message(stage="route", next="archive", properties={"kind": "order"})
        ran = run_stage(route, msg)
        assert ran.outcome == "advance" and ran.stage == "archive"
        assert ran.state["routed"] is True

`run_stage` answers with the decision the worker would write for the
message (`pepsi.worker.outcomes`, the worker's own code): advance, finish,
pause, retry or fail, the row's next stage, status, state and timeout.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pepsi.config import StageConfig
from pepsi.stage import Message, NewMessage
from pepsi.worker.outcomes import after_raise, after_return

__all__ = ["AnyStage", "StageRun", "make_message", "run_stage"]


class AnyStage(Container[str]):
    """Every stage name: `run_stage`'s default, so any `advance(to)` is accepted."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and bool(name)


@dataclass(frozen=True)
class StageRun:
    """What the worker would do with the message after the stage ran."""

    outcome: str  # advance, finish, pause, retry or fail (the status line's word)
    stage: str | None  # the row's next stage; None when finished (the row is deleted)
    status: str | None  # pending, paused or failed; None when finished
    state: dict[str, Any]  # the state written back with the outcome
    until: datetime | None  # when a paused (pause or retry) row runs again
    error: str | None  # a failure as the worker logs it
    returned: object = None  # what the stage returned
    raised: Exception | None = field(default=None)  # what the stage raised
    # A Split: each group of recipients with its outcome word, and the messages made
    parts: tuple[tuple[tuple[str, ...], str], ...] = ()
    spawned: tuple[NewMessage, ...] = ()


def make_message(  # one keyword per Message field, all defaulted
    *,
    stage: str = "test",
    body: bytes | str | None = None,
    header: bytes | str | None = None,
    json: Any = None,
    options: StageConfig | None = None,
    next: str | None = None,  # the configuration's own name (NEXT)
    id: int = 1,  # Message's field
    arrived: datetime | None = None,
    state: dict[str, Any] | None = None,
    properties: dict[str, Any] | None = None,
    recipients: tuple[str, ...] | list[str] = (),
    **fields: Any,
) -> Message:
    """A `Message` as a stage receives it, with defaults for what is not given.

    `options` is the stage's configuration (default: a `StageConfig` named
    `stage` with the configuration's defaults and `next`). `json=obj` sets
    the body to `obj` as JSON, as `publish(..., json=obj)` does. Other
    keywords are `Message` fields (`sender`, `message_id`, `origin_user` …).
    """
    if options is None:
        options = StageConfig(name=stage, next=next)
    if json is not None:
        if body is not None:
            raise ValueError("give body= or json=, not both")
        from pepsi.publishing.message import JSON_TYPE, encode_json  # noqa: PLC0415

        body = encode_json(json)
        fields.setdefault("content_type", JSON_TYPE)
    return Message(
        id=id,
        stage=stage,
        arrived=arrived or datetime.now(UTC),
        options=options,
        recipients=tuple(recipients),
        properties=dict(properties or {}),
        state=_json_copy(state or {}),
        _header=_bytes(header),
        _body=_bytes(body),
        **fields,
    )


def run_stage(
    func: Callable[[Message], Any],
    msg: Message,
    *,
    stages: Container[str] | None = None,
    now: Callable[[], datetime] | None = None,
) -> StageRun:
    """Run `func` on `msg` as the worker does and return the worker's decision.

    `stages` are the stages an advance may go to (default: any name); `now`
    is the clock for pauses, retries and MAX_LIFETIME (default: the real one).
    An `async def` stage is run to completion on an event loop of its own.
    """
    clock = now or _utc_now
    targets = AnyStage() if stages is None else stages
    loaded = json.dumps(msg.state) if msg.state else "{}"
    returned: object = None
    raised: Exception | None = None
    try:
        returned = func(msg)
        if inspect.isawaitable(returned):
            returned = asyncio.run(_await(returned))
        decision = after_return(returned, msg, loaded, targets, clock)
    except Exception as exc:  # noqa: BLE001  # the worker's rule: any error is the stage's
        raised = exc
        decision = after_raise(exc, msg, loaded, clock)
    return StageRun(
        outcome=decision.outcome,
        stage=decision.stage,
        status=decision.status,
        state=dict(decision.state or {}),
        until=decision.timeout,
        error=decision.error,
        returned=returned,
        raised=raised,
        parts=tuple((group, part.outcome) for group, part in decision.parts or ()),
        spawned=decision.spawn,
    )


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _utc_now() -> datetime:
    return datetime.now(UTC)


def _bytes(value: bytes | str | None) -> bytes | None:
    return value.encode("utf-8") if isinstance(value, str) else value


def _json_copy(state: dict[str, Any]) -> dict[str, Any]:
    """The state as the worker loads it: a JSON round trip (so tests share no objects)."""
    copied: dict[str, Any] = json.loads(json.dumps(state))
    return copied
