"""Repairs from the console, in two steps as `pepsi queue` does them.

`POST /repair/preview` reads which rows a repair would touch (`admin.queue_repair.preview`)
and shows a confirmation form carrying that count; `POST /repair/do` runs it
(`admin.queue_repair.repair`, one transaction) only if the count is still the same, then
redirects back with `?done=...`. Resume, retry, move and delete; single messages
(`ids`) or a stage's rows (`scope=all`, or `scope=filter` with the stage page's
filters). Every repair is logged on `pepsi.web` with who, from where, what and how many.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from multidict import MultiDictProxy
from yarl import URL

from pepsi.admin import queue_repair
from pepsi.errors import NoSuchMessage, QueueError, RepairRefused, UnknownStage
from pepsi.web import security
from pepsi.web.app import Console, console_of
from pepsi.web.pages.stage import minutes

log = logging.getLogger("pepsi.web")

SAMPLE = 20  # ids the confirmation page names
FIELDS = ("action", "ids", "stage", "scope", "status", "sender", "failure_class", "older", "to")


@dataclass(frozen=True)
class Asked:
    """A repair as the form asks for it: its request, and the form's own values."""

    request: queue_repair.RepairRequest
    fields: dict[str, str]  # carried on to the confirmation form
    back: str


def _text(form: MultiDictProxy[Any], key: str) -> str:
    value = form.get(key, "")
    return value.strip() if isinstance(value, str) else ""


def safe_back(text: str) -> str:
    """A local path to go back to: never another site (security.local_path)."""
    return security.local_path(text, "/stages")


def asked(form: MultiDictProxy[Any]) -> Asked:
    """The repair a form asks for; QueueError when it makes no sense."""
    fields = {key: _text(form, key) for key in FIELDS}
    action: Any = fields["action"]
    if action not in queue_repair.REPAIRS:
        raise RepairRefused(
            f"no repair named {action!r} (one of {', '.join(queue_repair.REPAIRS)})"
        )
    to = fields["to"] or None if action == "move" else None
    if fields["ids"]:
        try:
            ids = tuple(int(part) for part in fields["ids"].replace(",", " ").split())
        except ValueError:
            raise QueueError(f"ids must be whole numbers, got {fields['ids']!r}") from None
        selection = queue_repair.Selection(ids=ids)
    elif fields["stage"] and fields["scope"] == "all":
        selection = queue_repair.Selection(stage=fields["stage"])
    elif fields["stage"] and fields["scope"] == "filter":
        status: Any = fields["status"] or None
        selection = queue_repair.Selection(
            stage=fields["stage"],
            failure_class=fields["failure_class"] or None,
            status=status,
            sender_key=fields["sender"] or None,
            older_than=minutes(fields["older"]),
        )
    else:
        raise RepairRefused(f"say which messages: ids, or a stage's rows ({action} refused)")
    return Asked(
        queue_repair.RepairRequest(action, selection, to=to), fields, safe_back(_text(form, "back"))
    )


def refused(
    console: Console, request: web.Request, error: QueueError, back: str | None
) -> web.Response:
    """An admin error as a page (never a traceback)."""
    if isinstance(error, NoSuchMessage):
        code = 404
    elif isinstance(error, UnknownStage):
        code = 400
    elif isinstance(error, RepairRefused):
        code = 409
    else:
        code = 400
    response = console.render(request, "repair_error.html", message=str(error), back=back)
    response.set_status(code)
    return response


def describe(request: queue_repair.RepairRequest) -> str:
    chosen = request.selection
    if chosen.ids:
        what = "message " + ", ".join(map(str, chosen.ids))
    else:
        what = f"the rows of stage {chosen.stage} (or failed there)"
        narrowed = [
            f"{label} {value}"
            for label, value in (
                ("status", chosen.status),
                ("failure class", chosen.failure_class),
                ("sender", chosen.sender_key),
                (
                    "older than",
                    None if chosen.older_than is None else f"{chosen.older_than / 60:g} min",
                ),
            )
            if value is not None
        ]
        if narrowed:
            what += " with " + ", ".join(narrowed)
    return f"{request.action} {what}" + (f" to {request.to}" if request.to else "")


async def preview(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    console.require_repair(request)
    form = await request.post()
    back = safe_back(_text(form, "back"))
    try:
        wanted = asked(form)
        plan = await console.db(queue_repair.preview, wanted.request, stages=console.config.stages)
    except QueueError as e:
        return refused(console, request, e, back)
    return console.render(
        request,
        "repair.html",
        action=wanted.request.action,
        what=describe(wanted.request),
        count=plan.count,
        sample=plan.ids[:SAMPLE],
        more=max(0, plan.count - SAMPLE),
        running=len(plan.running),
        fields=wanted.fields,
        back=wanted.back,
    )


async def do(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    user = console.require_repair(request)
    form = await request.post()
    back = safe_back(_text(form, "back"))
    try:
        wanted = asked(form)
        expected = int(_text(form, "expected"))
    except ValueError:
        return refused(console, request, QueueError("the confirmation lacks its count"), back)
    except QueueError as e:
        return refused(console, request, e, back)
    seen: list[int] = []

    def confirm(plan: queue_repair.RepairPlan) -> bool:
        seen.append(plan.count)
        return plan.count == expected

    try:
        done = await console.db(
            queue_repair.repair, wanted.request, stages=console.config.stages, confirm=confirm
        )
    except QueueError as error:
        if not (seen and seen[0] != expected):
            return refused(console, request, error, back)
        changed = RepairRefused(
            f"the number of messages changed since the preview ({expected} then, "
            f"{seen[0]} now): nothing was done; preview it again"
        )
        return refused(console, request, changed, back)
    log.info(
        "web: %s of %d message(s) by %s from %s (%s)",
        wanted.request.action,
        len(done.ids),
        user,
        request.remote,
        describe(wanted.request),
    )
    note = f"{wanted.request.action}: {len(done.ids)} message(s)"
    url = URL(wanted.back)
    kept = [(k, v) for k, v in url.query.items() if k != "done"]
    raise web.HTTPSeeOther(str(url.with_query([*kept, ("done", note)])))


def setup(app: web.Application) -> None:
    app.router.add_post("/repair/preview", preview)
    app.router.add_post("/repair/do", do)
