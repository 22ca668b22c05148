"""What a delivery attempt's replies do to a message: its Split and its reports. Pure.

Per recipient: a `2xx` is delivered; a `4xx`, a timeout or a connection that
could not be made is temporary (the recipient stays, for the stage's retry
schedule); a `5xx` is permanent. Recipients that end differently carry on
alone (`pepsi.Split`), so none is sent twice because another failed.

Reports (RFC 3461, 3464) go, with the null sender, to the envelope sender,
in the same transaction as the outcome (`spawn`):

- failure: for permanent failures, unless the recipient's NOTIFY excludes
  FAILURE; without DSN_STAGE, or for a message that cannot be reported (the
  null sender, a mailing-list copy), the recipients fail instead (kept,
  `failed`, for the failure bouncer);
- delay: once per message, when it has been retried longer than
  DELAY_DSN_AFTER, for recipients whose NOTIFY allows DELAY (the default);
- success: for recipients that asked NOTIFY=SUCCESS, when the next hop took
  the message without the DSN extension (it cannot report for us: "relayed").
  A next hop that has the extension gets the NOTIFY and reports itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pepsi.mail.protocol import dsn
from pepsi.stage import Advance, Defer, Fail, Finish, Message, NewMessage, Part, Split

_ENHANCED = re.compile(r"([245])\.(\d{1,3})\.(\d{1,3})\b")
DELAY_SENT = "delay_dsn_sent"  # state: the delay report went out already
LIST_COPY = "list_copy"  # state: a mailing-list copy, which fails instead of bouncing


@dataclass(frozen=True)
class Result:
    """What the next hop said of one recipient."""

    code: int  # the SMTP reply code; 0 when no server answered (refused, timeout, DNS)
    text: str  # the reply or the error, for state.last_error and the log
    status: str = ""  # its enhanced status code; derived from `code` when not given
    dsn_passed: bool = False  # the next hop took NOTIFY and will report itself

    @property
    def kind(self) -> str:
        if 200 <= self.code < 300:
            return "delivered"
        if self.code >= 500:
            return "permanent"
        return "temporary"

    @property
    def enhanced(self) -> str:
        if self.status:
            return self.status
        found = _ENHANCED.search(self.text)
        if found is not None and found.group(1) == str(self.code)[:1]:
            return found.group(0)
        return {"delivered": "2.0.0", "permanent": "5.0.0"}.get(self.kind, "4.4.1")


@dataclass(frozen=True)
class Context:
    """The message as the decision needs it, and the stage's options."""

    sender: str | None
    recipients: tuple[str, ...]
    arrived: datetime
    smtp: Mapping[str, Any]  # properties.smtp: ret, envid, rcpt: {address: {notify, orcpt}}
    state: Mapping[str, Any]
    header: bytes
    body: bytes
    dsn_stage: str | None
    delay_dsn_after: float
    hostname: str
    now: datetime

    @classmethod
    def of(
        cls, msg: Message, *, dsn_stage: str | None, delay_dsn_after: float, hostname: str
    ) -> Context:
        """A stage's message now (its header block and body read: a report returns them)."""
        return cls(
            sender=msg.sender,
            recipients=msg.recipients,
            arrived=msg.arrived,
            smtp=msg.properties.get("smtp", {}),
            state=msg.state,
            header=msg.header or b"",
            body=msg.body or b"",
            dsn_stage=dsn_stage,
            delay_dsn_after=delay_dsn_after,
            hostname=hostname,
            now=datetime.now(UTC),
        )


def may_report(dsn_stage: str | None, sender: str | None, state: Mapping[str, Any]) -> bool:
    """Whether reports may be sent about a message at all."""
    return (
        dsn_stage is not None
        and bool(sender)  # never to the null sender: no loops
        and not state.get(LIST_COPY)
    )


def reportable(context: Context) -> bool:
    return may_report(context.dsn_stage, context.sender, context.state)


def notify(context: Context, recipient: str) -> tuple[str, ...]:
    """The recipient's NOTIFY; absent: failures and delays (RFC 3461 §4.1)."""
    given = context.smtp.get("rcpt", {}).get(recipient, {}).get("notify")
    return tuple(given) if given else ("FAILURE", "DELAY")


def decide(context: Context, results: Mapping[str, Result]) -> tuple[Split, dict[str, Any]]:
    """The outcome of one attempt, and the state keys to set on the message."""
    groups: dict[str, list[str]] = {"delivered": [], "temporary": [], "permanent": []}
    for recipient in context.recipients:
        groups[results[recipient].kind].append(recipient)
    parts: list[Part] = []
    spawn: list[NewMessage] = []
    state: dict[str, Any] = {}
    if groups["delivered"]:
        parts.append(Part(tuple(groups["delivered"]), Advance()))  # NEXT, or done
        relayed = [
            r for r in groups["delivered"]
            if "SUCCESS" in notify(context, r) and not results[r].dsn_passed
        ]  # fmt: skip
        if relayed and reportable(context):
            spawn.append(_report(dsn.SUCCESS, "relayed", relayed, results, context))
    if groups["temporary"]:
        deferred = groups["temporary"]
        reason = "; ".join(sorted({results[r].text for r in deferred}))
        parts.append(Part(tuple(deferred), Defer(reason)))
        late = context.now - context.arrived > timedelta(seconds=context.delay_dsn_after)
        delayed = [r for r in deferred if "DELAY" in notify(context, r)]
        if late and delayed and not context.state.get(DELAY_SENT) and reportable(context):
            spawn.append(_report(dsn.DELAY, "delayed", delayed, results, context))
            state[DELAY_SENT] = True
    if groups["permanent"]:
        parts += _failed(groups["permanent"], results, context, spawn)
    return Split(tuple(parts), tuple(spawn)), state


def _failed(
    failed: Sequence[str],
    results: Mapping[str, Result],
    context: Context,
    spawn: list[NewMessage],
) -> list[Part]:
    reason = "; ".join(sorted({results[r].text for r in failed}))
    if not reportable(context):
        return [Part(tuple(failed), Fail(reason))]  # kept, failed: the failure bouncer's
    reported = [r for r in failed if "FAILURE" in notify(context, r)]
    if reported:
        spawn.append(_report(dsn.FAILURE, "failed", reported, results, context))
    return [Part(tuple(failed), Finish())]


def _report(
    kind: str,
    action: str,
    recipients: Sequence[str],
    results: Mapping[str, Result],
    context: Context,
) -> NewMessage:
    assert context.dsn_stage is not None
    assert context.sender
    rcpt = context.smtp.get("rcpt", {})
    reports = [
        dsn.Report(r, action, results[r].enhanced, rcpt.get(r, {}).get("orcpt")) for r in recipients
    ]
    original = dsn.Original(
        context.sender, context.header, context.body, context.arrived,
        context.smtp.get("envid"), context.smtp.get("ret"),
    )  # fmt: skip
    return dsn.build(
        kind, original, reports, stage=context.dsn_stage, hostname=context.hostname,
        now=context.now,
    )  # fmt: skip


def failure_report(context: Context, status: str) -> NewMessage | None:
    """The failure report for every recipient, all with `status` (a bounce stage's, after
    retries ran out: 4.4.7); None when the message cannot or need not be reported."""
    wanted = [r for r in context.recipients if "FAILURE" in notify(context, r)]
    if not reportable(context) or not wanted:
        return None
    results = {r: Result(500, "", status) for r in wanted}
    return _report(dsn.FAILURE, "failed", wanted, results, context)
