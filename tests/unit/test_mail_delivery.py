"""Delivery outcomes and their reports (pepsi.mail.relay.delivery, pepsi.mail.protocol.dsn): pure; and the
relay's per-destination slots (files and locks)."""

from __future__ import annotations

import email
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from email import policy
from pathlib import Path
from typing import Any

import pytest

from pepsi.mail.protocol import dsn
from pepsi.mail.relay import delivery
from pepsi.mail.relay.delivery import Context, Result
from pepsi.mail.relay.slots import Slots
from pepsi.stage import Advance, Defer, Fail, Finish, NewMessage, Part

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
HEADER = b"From: Alice <alice@sender.org>\r\nSubject: hello\r\nMessage-ID: <m1@sender.org>\r\n"
BODY = b"Hello.\r\n"
OK = Result(250, "250 2.0.0 Ok: queued")
LATER = Result(451, "mx.example.org: 451 4.7.1 greylisted")
BAD = Result(550, "mx.example.org: 550 5.1.1 <bad@x.org>: no such user here")


def context(**changes: Any) -> Context:
    values: dict[str, Any] = {
        "sender": "alice@sender.org",
        "recipients": ("ok@x.org", "later@x.org", "bad@x.org"),
        "arrived": NOW - timedelta(minutes=5),
        "smtp": {},
        "state": {},
        "header": HEADER,
        "body": BODY,
        "dsn_stage": "dsn",
        "delay_dsn_after": 4 * 3600.0,
        "hostname": "mx.pepsi.test",
        "now": NOW,
    }
    values.update(changes)
    return Context(**values)


RESULTS = {"ok@x.org": OK, "later@x.org": LATER, "bad@x.org": BAD}


def parse(made: NewMessage) -> email.message.EmailMessage:
    assert made.header is not None
    assert made.body is not None
    message = email.message_from_bytes(made.header + b"\r\n" + made.body, policy=policy.default)
    assert isinstance(message, email.message.EmailMessage)
    return message


def status_blocks(report: email.message.EmailMessage) -> list[dict[str, str]]:
    part = next(p for p in report.walk() if p.get_content_type() == "message/delivery-status")
    blocks = []
    for sub in part.get_payload():
        blocks.append({k: str(v) for k, v in sub.items()})
    return blocks


def test_each_recipient_goes_its_own_way_and_the_failure_is_reported() -> None:
    split, state = delivery.decide(context(), RESULTS)
    assert split.parts == (
        Part(("ok@x.org",), Advance()),
        Part(("later@x.org",), Defer(LATER.text)),
        Part(("bad@x.org",), Finish()),
    )
    assert state == {}
    (report,) = split.spawn
    assert (report.stage, report.sender, report.recipients) == ("dsn", "", ("alice@sender.org",))
    parsed = parse(report)
    assert parsed.get_content_type() == "multipart/report"
    assert parsed.get_param("report-type") == "delivery-status"
    assert parsed["Auto-Submitted"] == "auto-replied"
    per_message, per_recipient = status_blocks(parsed)
    assert per_message["Reporting-MTA"] == "dns; mx.pepsi.test"
    assert per_recipient == {
        "Final-Recipient": "rfc822; bad@x.org", "Action": "failed", "Status": "5.1.1",
    }  # fmt: skip
    text = parsed.get_body(("plain",)).get_content()  # type: ignore[union-attr]
    assert "a permanent problem with the address of the recipient" in text
    assert "mx.example.org" not in report.body.decode()  # generic: no host, no remote text
    returned = next(p for p in parsed.walk() if p.get_content_type() == "message/rfc822")
    assert returned.get_payload()[0]["Subject"] == "hello"  # RET absent: the whole message


def test_no_report_to_the_null_sender_or_for_a_list_copy_they_fail_instead() -> None:
    for ctx in (context(sender=""), context(state={"list_copy": True}), context(dsn_stage=None)):
        split, _ = delivery.decide(ctx, RESULTS)
        assert split.spawn == ()
        assert split.parts[-1] == Part(("bad@x.org",), Fail(BAD.text))


def test_notify_never_and_a_notify_without_failure_are_obeyed() -> None:
    smtp = {"rcpt": {"bad@x.org": {"notify": ["NEVER"]}}}
    split, _ = delivery.decide(context(smtp=smtp), RESULTS)
    assert split.spawn == ()
    assert split.parts[-1] == Part(("bad@x.org",), Finish())  # reported to nobody, as asked


def test_a_delay_report_once_past_delay_dsn_after() -> None:
    old = context(arrived=NOW - timedelta(hours=5), recipients=("later@x.org",))
    split, state = delivery.decide(old, {"later@x.org": LATER})
    (report,) = split.spawn
    assert state == {"delay_dsn_sent": True}
    _, block = status_blocks(parse(report))
    assert (block["Action"], block["Status"]) == ("delayed", "4.7.1")
    returned = [p.get_content_type() for p in parse(report).walk()]
    assert "text/rfc822-headers" in returned
    again, state = delivery.decide(
        context(arrived=old.arrived, recipients=old.recipients, state={"delay_dsn_sent": True}),
        {"later@x.org": LATER},
    )
    assert again.spawn == ()
    assert state == {}


def test_success_reported_only_when_asked_and_when_the_next_hop_cannot() -> None:
    smtp = {
        "envid": "env 1",
        "rcpt": {"ok@x.org": {"notify": ["SUCCESS"], "orcpt": "rfc822;OK@x.org"}},
    }
    ctx = context(recipients=("ok@x.org",), smtp=smtp)
    split, _ = delivery.decide(ctx, {"ok@x.org": OK})
    (report,) = split.spawn
    per_message, block = status_blocks(parse(report))
    assert per_message["Original-Envelope-Id"] == "env+201"
    assert block["Action"] == "relayed"
    assert block["Original-Recipient"] == "rfc822; OK@x.org"
    passed = {"ok@x.org": Result(250, "ok", dsn_passed=True)}
    assert delivery.decide(ctx, passed)[0].spawn == ()  # the next hop reports itself


def test_statuses_from_replies() -> None:
    assert Result(550, "550 5.7.1 relaying denied").enhanced == "5.7.1"
    assert Result(550, "550 no such user").enhanced == "5.0.0"
    assert Result(450, "450 4.2.0 mailbox busy").enhanced == "4.2.0"
    assert Result(0, "connection refused").enhanced == "4.4.1"
    assert Result(550, "550 4.2.0 inconsistent").enhanced == "5.0.0"  # class must agree
    assert (
        dsn.generic_reason("4.4.7")
        == "a temporary problem with the network or the route to the recipient"
    )


def test_a_bounce_after_retries_reports_every_recipient() -> None:
    made = delivery.failure_report(context(), "4.4.7")
    assert made is not None
    blocks = status_blocks(parse(made))[1:]
    assert [(b["Final-Recipient"], b["Status"]) for b in blocks] == [
        ("rfc822; ok@x.org", "4.4.7"), ("rfc822; later@x.org", "4.4.7"),
        ("rfc822; bad@x.org", "4.4.7"),
    ]  # fmt: skip
    assert delivery.failure_report(context(sender=""), "4.4.7") is None


def test_at_most_limit_connections_per_destination_across_processes(tmp_path: Path) -> None:
    slots = Slots(2, tmp_path)
    first, second = slots.take("example.org"), slots.take("Example.ORG")
    assert first is not None
    assert second is not None
    assert slots.take("example.org") is None  # the limit, whatever the case
    assert slots.take("example.net") is not None  # another destination
    # another process (another worker) sees the same slots taken
    probe = (
        "import sys; from pathlib import Path; from pepsi.mail.relay.slots import Slots; "
        f"print(Slots(2, Path({str(tmp_path)!r})).take('example.org'))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"
    Slots.give_back(first)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() != "None"


def test_a_slot_folder_another_could_use_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "slots"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)  # whoever else can write here could hold every slot
    with pytest.raises(RuntimeError, match=r"relay's slot directory .* is not private"):
        Slots(2, shared)
