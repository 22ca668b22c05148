"""The DATA stream and the header block (pepsi.mail.protocol.content): pure, no socket."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import given
from hypothesis import strategies as st

from pepsi.mail.protocol import content
from pepsi.mail.protocol.content import DataCollector


def collect(
    stream: bytes, limit: int = 10_000, step: int | None = None
) -> tuple[bytes | None, bytes]:
    """Feed `stream` as asyncio's StreamReader.readuntil(END) hands it over, with a
    buffer limit of `step` (None: unlimited); the message and what followed its end."""
    collector = DataCollector(limit)
    position = 0
    while position < len(stream):
        found = stream.find(content.END, position)
        end = len(stream) if found < 0 else found + len(content.END)
        if step is not None and end - position - len(content.END) > step:
            # LimitOverrunError: all but the last two bytes of a buffer past the limit
            end = position + step + 1
        chunk, position = stream[position:end], end
        if collector.feed(chunk):
            return collector.message(), stream[position:]
    raise AssertionError("the data never ended")


def test_the_end_is_crlf_dot_crlf_and_what_follows_is_the_next_command() -> None:
    message, rest = collect(b"Subject: x\r\n\r\nhello\r\n.\r\nQUIT\r\n")
    assert message == b"Subject: x\r\n\r\nhello\r\n"
    assert rest == b"QUIT\r\n"


def test_an_empty_message_ends_at_once() -> None:
    assert collect(b".\r\n") == (b"", b"")


def test_dot_stuffed_lines_are_unstuffed() -> None:
    message, _ = collect(b"..leading\r\n..\r\nmid.dle.\r\n...\r\n.\r\n")
    assert message == b".leading\r\n.\r\nmid.dle.\r\n..\r\n"


def test_a_line_ending_with_a_dot_does_not_end_the_data() -> None:
    message, rest = collect(b"end of sentence.\r\nmore\r\n.\r\n")
    assert message == b"end of sentence.\r\nmore\r\n"
    assert rest == b""


def test_smuggling_a_second_message_behind_bare_line_feeds_fails() -> None:
    """`<LF>.<LF>`, `<CR><LF>.<LF>` and `<LF>.<CR><LF>` end nothing: one message."""
    smuggled = b"MAIL FROM:<x@y>\r\nRCPT TO:<v@w>\r\nDATA\r\nSubject: smuggled\r\n\r\nbad\r\n"
    for fake_end in (b"\n.\n", b"\r\n.\n", b"\n.\r\n"):
        stream = b"Subject: one\r\n\r\nhello" + fake_end + smuggled + b".\r\n"
        message, rest = collect(stream)
        assert rest == b""
        assert message is not None
        assert b"Subject: smuggled" in message  # inside the one message, not a second one
        assert message.count(b"\n") == message.count(b"\r\n")  # bare LFs normalized


def test_bare_line_feeds_become_crlf() -> None:
    message, _ = collect(b"a\nb\r\nc\n\r\n.\r\n")
    assert message == b"a\r\nb\r\nc\r\n\r\n"


def test_the_size_limit_is_exact() -> None:
    line = b"x" * 98 + b"\r\n"
    exactly = line * 10  # 1 000 bytes
    assert collect(exactly + b".\r\n", limit=1000)[0] == exactly
    over = exactly + b"y\r\n"
    message, rest = collect(over + b".\r\n", limit=1001)
    assert message is None
    assert rest == b""


def test_an_oversized_message_is_drained_without_being_held() -> None:
    collector = DataCollector(1000)
    for _ in range(100):
        assert not collector.feed(b"z" * 65536)
    assert collector.parts == []
    assert collector.feed(b"\r\n.\r\n")
    assert collector.message() is None


@given(st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))))
def test_any_lines_survive_stuffing_and_any_chunking(lines: list[bytes]) -> None:
    original = b"".join(line + b"\r\n" for line in lines)
    stuffed = b"".join((b"." + line if line.startswith(b".") else line) + b"\r\n" for line in lines)
    for step in (None, 1, 2, 3, 7):
        message, rest = collect(stuffed + b".\r\nNOOP\r\n", step=step)
        assert message == original
        assert rest == b"NOOP\r\n"


def test_header_and_body_split_at_the_empty_line() -> None:
    header, body = content.split_message(b"A: 1\r\nB: 2\r\n folded\r\n\r\nbody\r\n\r\nmore\r\n")
    assert header == b"A: 1\r\nB: 2\r\n folded\r\n"
    assert body == b"body\r\n\r\nmore\r\n"
    assert header + b"\r\n" + body == b"A: 1\r\nB: 2\r\n folded\r\n\r\nbody\r\n\r\nmore\r\n"


def test_a_line_that_is_no_field_starts_the_body() -> None:
    assert content.split_message(b"A: 1\r\nnot a field\r\nx\r\n") == (
        b"A: 1\r\n",
        b"not a field\r\nx\r\n",
    )
    assert content.split_message(b"just text\r\n") == (b"", b"just text\r\n")
    assert content.split_message(b"\r\nbody only\r\n") == (b"", b"body only\r\n")
    assert content.split_message(b"A: 1\r\n") == (b"A: 1\r\n", b"")
    assert content.split_message(b"") == (b"", b"")


def test_extracted_fields_are_unfolded_decoded_and_first_wins() -> None:
    header = (
        b"From: =?utf-8?q?Ren=C3=A9e?= <renee@example.com>\r\n"
        b"Subject: caf\xc3\xa9\r\n  au lait\r\n"
        b"Message-ID:\r\n <abc@example.com>\r\n"
        b"Subject: second\r\n"
    )
    found = content.extract(header)
    assert found.header_from == "Renée <renee@example.com>"
    assert found.subject == "café au lait"
    assert found.message_id == "<abc@example.com>"


def test_extracted_text_is_safe_for_a_row() -> None:
    found = content.extract(b"Subject: a\x00b\x1bc \xff\r\nFrom: " + b"x" * 5000 + b"\r\n")
    assert found.subject == "a b c \xff"  # not UTF-8: read as Latin-1
    assert found.header_from is not None
    assert len(found.header_from) == 4096
    assert content.extract(b"").subject is None


def test_received_names_the_client_the_server_and_a_lone_recipient() -> None:
    when = datetime(2026, 12, 5, 1, 2, 3, tzinfo=UTC)
    one = content.received(
        helo="client.example (evil)\tx",
        peer="192.0.2.1",
        hostname="mx.example.com",
        protocol="ESMTPS",
        queue_id="ABC123",
        recipients=["bob@example.com"],
        tls="TLSv1.3 with cipher TLS_AES_256_GCM_SHA384",
        when=when,
    )
    assert one == (
        b"Received: from client.example??evil??x ([192.0.2.1])\r\n"
        b"\t(using TLSv1.3 with cipher TLS_AES_256_GCM_SHA384)\r\n"
        b"\tby mx.example.com (Pepsi) with ESMTPS id ABC123\r\n"
        b"\tfor <bob@example.com>; Sat, 05 Dec 2026 01:02:03 +0000\r\n"
    )
    many = content.received(
        helo=None, peer=None, hostname="mx", protocol="LMTP", queue_id="Q",
        recipients=["a@x", "b@x"], tls=None, when=when,
    )  # fmt: skip
    assert many == (
        b"Received: from unknown (local)\r\n"
        b"\tby mx (Pepsi) with LMTP id Q; Sat, 05 Dec 2026 01:02:03 +0000\r\n"
    )


def test_a_received_message_as_its_row() -> None:
    from pepsi.mail.protocol import message  # noqa: PLC0415
    from pepsi.mail.protocol.envelope import MailParameters, RcptParameters  # noqa: PLC0415

    arrival = message.Arrival(
        helo="client.test", peer="2001:db8::7", login="alice",
        protocol=message.with_keyword("ESMTP", extended=True, tls=True, authenticated=True),
        tls="TLSv1.3 with cipher X",
    )  # fmt: skip
    built = message.build(
        b"Subject: hi\r\nMessage-ID: <1@x>\r\n\r\nbody\r\n",
        stage="inbox", sender="", recipients={"a@x.org": RcptParameters(("NEVER",))},
        mail=MailParameters(ret="HDRS"), arrival=arrival, hostname="mx", queue_id="Q",
        now=datetime(2026, 12, 5, tzinfo=UTC),
    )  # fmt: skip
    assert (built.stage, built.sender, built.recipients) == ("inbox", "", ("a@x.org",))
    assert (built.origin_user, built.origin_peer) == ("alice", "2001:db8::7")
    assert (built.subject, built.message_id) == ("hi", "<1@x>")
    assert built.body == b"body\r\n"
    assert isinstance(built.header, bytes)
    assert built.header.startswith(b"Received: from client.test ([2001:db8::7])\r\n")
    assert b"with ESMTPSA id Q\r\n\tfor <a@x.org>; " in built.header
    assert built.header.endswith(b"Subject: hi\r\nMessage-ID: <1@x>\r\n")
    assert built.properties == {
        "smtp": {"id": "Q", "ret": "HDRS", "rcpt": {"a@x.org": {"notify": ["NEVER"]}}}
    }
    assert message.with_keyword("LMTP", extended=True, tls=False, authenticated=False) == "LMTP"
    assert message.with_keyword("ESMTP", extended=False, tls=True, authenticated=True) == "SMTP"
