"""The stages list (`/stages`) and a stage's page (`/stage/{name}`): options, workers,
and its messages, filtered and paged by id (keyset: `?after=ID`, no offset, no count)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from aiohttp import web

from pepsi.admin import queue
from pepsi.config.values import is_amqp_stage
from pepsi.errors import QueueError
from pepsi.web.app import Console, console_of

PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
NO_WORKERS = "workers are shown when the console runs in the dispatcher ([pepsi-web] LISTEN)"


@dataclass(frozen=True)
class Filters:
    """The stage page's filters, as given in its query string ('' when not)."""

    status: str = ""
    sender: str = ""
    failure_class: str = ""
    older: str = ""  # minutes

    def where(self, stage: str) -> queue.MessageFilter:
        """The admin filter; QueueError when a value makes no sense."""
        status: Any = self.status or None
        if status is not None and status not in queue.STATUSES:
            raise QueueError(f"no status {self.status!r} (one of {', '.join(queue.STATUSES)})")
        return queue.MessageFilter(
            stage=stage,
            status=status,
            sender_key=self.sender or None,
            failure_class=self.failure_class or None,
            older_than=minutes(self.older),
        )

    def params(self) -> dict[str, str]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v}

    @property
    def any(self) -> bool:
        return bool(self.params())


def minutes(text: str) -> float | None:
    """Seconds in `text` minutes ('' for none); QueueError when it is no age."""
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise QueueError(f"the age must be a number of minutes, got {text!r}") from None
    if not 0 <= value < 10**9:
        raise QueueError(f"the age must be at least 0 minutes, got {text!r}")
    return value * 60


def filters_of(query: Any) -> Filters:
    return Filters(
        status=str(query.get("status", "")).strip(),
        sender=str(query.get("sender", "")).strip(),
        failure_class=str(query.get("failure_class", "")).strip(),
        older=str(query.get("older", "")).strip(),
    )


def stage_url(name: str, **params: str) -> str:
    shown = {k: v for k, v in params.items() if v}
    return f"/stage/{quote(name, safe=':/')}" + (f"?{urlencode(shown)}" if shown else "")


def error_page(
    console: Console, request: web.Request, message: str, status: int = 400
) -> web.Response:
    response = console.render(request, "repair_error.html", message=message, back=None)
    response.set_status(status)
    return response


async def stages(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    read = await console.db(queue.status)
    counts = {s.stage: s for s in read.stages}
    names = list(console.config.stages)
    names += sorted(name for name in counts if name not in console.config.stages)
    rows = [
        {
            "name": name,
            "url": stage_url(name),
            "kind": "stage"
            if name in console.config.stages
            else ("AMQP queue" if is_amqp_stage(name) else "not configured"),
            "counts": dict(counts[name].counts) if name in counts else {},
            "oldest": counts[name].oldest_pending_s if name in counts else None,
        }
        for name in names
    ]
    return console.render(
        request, "stages.html", rows=rows, statuses=queue.STATUSES, failures=read.failures
    )


def options_of(console: Console, name: str) -> list[tuple[str, str]]:
    stage = console.config.stages.get(name)
    if stage is None:
        return []
    shown = []
    for field in dataclasses.fields(stage):
        if field.name in ("name", "builtin_options"):
            continue
        value = getattr(stage, field.name)
        if value is None:
            continue
        shown.append((field.name, str(getattr(value, "value", value))))
    return shown


def workers_of(console: Console, name: str) -> list[dict[str, Any]] | None:
    """The stage's workers when this console runs in the dispatcher; else None."""
    supervisor = getattr(console.dispatcher, "supervisor", None)
    if supervisor is None:
        return None
    pool = getattr(supervisor, "pools", {}).get(name)
    if pool is None:
        return []
    now = time.monotonic()
    shown = []
    for worker in list(pool.workers.values()):
        started = getattr(worker, "started_at", None)
        shown.append(
            {
                "pid": getattr(worker, "pid", None),
                "up": None if started is None else max(0.0, now - started),
                "handled": getattr(worker, "handled", None),
                "inflight": len(getattr(worker, "inflight", ())),
                "state": "stopping"
                if getattr(worker, "stopping", False)
                else ("ready" if getattr(worker, "ready", False) else "starting"),
            }
        )
    return shown


def move_targets(console: Console, *current: str) -> list[str]:
    """Where a move may send messages: the configured stages, and AMQP queues at hand."""
    targets = list(console.config.stages)
    targets += [s for s in current if is_amqp_stage(s) and s not in targets]
    return targets


async def stage(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    name = request.match_info["name"]
    chosen = filters_of(request.query)
    try:
        where = chosen.where(name)
        after = int(request.query["after"]) if request.query.get("after") else None
        size = int(request.query.get("limit") or PAGE_SIZE)
    except ValueError:
        return error_page(console, request, "after and limit must be whole numbers")
    except QueueError as e:
        return error_page(console, request, str(e))
    size = max(1, min(size, MAX_PAGE_SIZE))
    try:
        found = await console.db(queue.list_messages, where, limit=size + 1, after=after)
    except QueueError as e:
        return error_page(console, request, str(e))
    rows = found[:size]
    next_url = None
    if len(found) > size:
        next_url = stage_url(
            name,
            **chosen.params(),
            after=str(rows[-1].id),
            limit=str(size) if size != PAGE_SIZE else "",
        )
    configured = name in console.config.stages
    return console.render(
        request,
        "stage.html",
        name=name,
        configured=configured,
        amqp=is_amqp_stage(name),
        options=options_of(console, name),
        workers=workers_of(console, name),
        no_workers=NO_WORKERS,
        rows=rows,
        filters=chosen,
        statuses=queue.STATUSES,
        after=after,
        first_url=stage_url(name, **chosen.params()),
        next_url=next_url,
        here=request.path_qs,
        targets=move_targets(console, name),
        done=request.query.get("done", ""),
    )


def setup(app: web.Application) -> None:
    app.router.add_get("/stages", stages)
    app.router.add_get("/stage/{name:.+}", stage)
