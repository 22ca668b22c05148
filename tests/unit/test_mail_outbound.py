"""The outbound client's pure parts (pepsi.mail.relay.attempt, pepsi.mail.protocol.content):
what DATA sends, and which recipient each reply decides, whether the replies came pipelined
or one by one."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from pepsi.mail.protocol.content import stuff
from pepsi.mail.relay.attempt import Outgoing, Peer, recipient_results
from pepsi.mail.relay.delivery import Result

PEER = Peer("mx.example.org", "127.0.0.1", 25)
MESSAGE = Outgoing(
    "alice@sender.org",
    ("ok@x.org", "later@x.org", "bad@x.org"),
    b"Subject: hi\r\n\r\nHello.\r\n",
    {"rcpt": {"ok@x.org": {"notify": ["SUCCESS"]}}},
)
OK, NEXT, LATER, BAD = (250, b"2.1.0 Ok"), (354, b"go ahead"), (450, b"4.2.0 later"), (550, b"no")


def unstuffed(wire: bytes) -> bytes:
    """What a receiver stores from DATA's lines (RFC 5321 §4.5.2)."""
    assert wire.endswith(b"\r\n.\r\n") or wire == b".\r\n"
    lines = wire[: -len(b".\r\n")].split(b"\r\n")
    return b"\r\n".join(line[1:] if line.startswith(b".") else line for line in lines)


@given(st.lists(st.sampled_from([b"a", b".", b"..", b"\r\n", b"\n", b"\r", b" ", b"x."])))
def test_data_is_dot_stuffed_with_crlf_line_ends(parts: list[bytes]) -> None:
    data = b"".join(parts)
    wire = stuff(data)
    body = wire[: -len(b".\r\n")]
    assert b"\r\n.\r\n" not in b"\r\n" + body  # no line is the lone dot before the end
    assert re.search(rb"\r(?!\n)|(?<!\r)\n", wire) is None  # no bare CR or LF
    expected = re.sub(rb"\r\n|\n|\r", b"\r\n", data)
    if expected and not expected.endswith(b"\r\n"):
        expected += b"\r\n"
    assert unstuffed(wire) == expected


def test_each_recipient_ends_by_its_own_reply_and_the_data_reply() -> None:
    final = (250, b"2.0.0 queued")
    results = recipient_results(PEER, MESSAGE, [OK, OK, LATER, BAD, NEXT], final, dsn=True)
    assert results == {
        "ok@x.org": Result(250, "mx.example.org[127.0.0.1]:25: 250 2.0.0 queued", dsn_passed=True),
        "later@x.org": Result(450, "mx.example.org[127.0.0.1]:25: 450 4.2.0 later"),
        "bad@x.org": Result(550, "mx.example.org[127.0.0.1]:25: 550 no"),
    }


def test_a_refused_mail_from_ends_every_recipient_whatever_followed() -> None:
    refused = (451, b"4.3.0 busy")
    pipelined = [
        refused,
        (503, b"need MAIL"),
        (503, b"need MAIL"),
        (503, b"need MAIL"),
        (503, b"x"),
    ]
    for replies in ([refused], pipelined):
        results = recipient_results(PEER, MESSAGE, replies, None, dsn=False)
        assert {r.code for r in results.values()} == {451}
        assert set(results) == set(MESSAGE.recipients)


def test_a_refused_data_ends_the_accepted_recipients() -> None:
    results = recipient_results(
        PEER, MESSAGE, [OK, OK, OK, BAD, (554, b"no valid")], None, dsn=False
    )
    assert [results[r].code for r in MESSAGE.recipients] == [554, 554, 550]


def test_recipients_without_a_final_reply_have_no_result() -> None:
    # the connection went after DATA's 354, or before the last RCPT's reply
    assert set(recipient_results(PEER, MESSAGE, [OK, OK, LATER, OK, NEXT], None, dsn=False)) == {
        "later@x.org"
    }
    assert set(recipient_results(PEER, MESSAGE, [OK, BAD], None, dsn=False)) == {"ok@x.org"}
