"""MAIL and RCPT parameters, paths, replies and the relay policy: pure, no socket."""

from __future__ import annotations

from collections.abc import Callable
from ipaddress import ip_address, ip_network

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pepsi.mail.ingress import policy
from pepsi.mail.protocol import envelope, replies
from pepsi.mail.protocol.envelope import MailParameters, ParameterError, RcptParameters


def mail(*words: str, max_size: int = 1000) -> MailParameters:
    return envelope.mail_parameters(list(words), max_size=max_size)


def refusal(call: Callable[..., object], *args: object, **kwargs: object) -> str:
    with pytest.raises(ParameterError) as info:
        call(*args, **kwargs)
    return str(info.value.reply)


def test_mail_parameters() -> None:
    assert mail() == MailParameters()
    assert mail("size=100", "Body=8bitmime", "SMTPUTF8", "RET=hdrs", "ENVID=a+2Bb") == (
        MailParameters(size=100, body="8BITMIME", smtputf8=True, ret="HDRS", envid="a+b")
    )
    assert mail("AUTH=<>") == MailParameters()  # RFC 4954: accepted, the session's login counts


@pytest.mark.parametrize(
    ("words", "reply"),
    [
        (["SIZE=1001"], "552 5.3.4"),
        (["SIZE=x"], "501 5.5.4"),
        (["BODY=BINARYMIME"], "501 5.5.4"),
        (["RET=ALL"], "501 5.5.4"),
        (["ENVID="], "501 5.5.4"),
        (["ENVID=" + "a" * 101], "501 5.5.4"),
        (["ENVID=a+zz"], "501 5.5.4"),
        (["SMTPUTF8=yes"], "501 5.5.4"),
        (["XFORWARD=1"], "555 5.5.4"),
        (["RET=FULL", "RET=HDRS"], "501 5.5.4"),
        (["=x"], "501 5.5.4"),
    ],
)
def test_mail_parameter_refusals(words: list[str], reply: str) -> None:
    assert refusal(mail, *words).startswith(reply)


def test_rcpt_parameters() -> None:
    assert envelope.rcpt_parameters([]) == RcptParameters()
    assert envelope.rcpt_parameters(["NOTIFY=delay,Success", "ORCPT=RFC822;bob+40x.org"]) == (
        RcptParameters(notify=("SUCCESS", "DELAY"), orcpt="rfc822;bob@x.org")
    )
    assert envelope.rcpt_parameters(["NOTIFY=NEVER"]).notify == ("NEVER",)
    for bad in ("NOTIFY=NEVER,SUCCESS", "NOTIFY=", "NOTIFY=SOMETIMES", "ORCPT=bob@x", "ORCPT=r;"):
        assert refusal(envelope.rcpt_parameters, [bad]).startswith("501 5.5.4")
    assert refusal(envelope.rcpt_parameters, ["FOO=1"]).startswith("555 5.5.4")


@given(st.text(alphabet=st.characters(max_codepoint=127), max_size=60))
def test_xtext_round_trips(text: str) -> None:
    assert envelope.xtext_decode(envelope.xtext_encode(text)) == text


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("<a@b.org>", ("a@b.org", [])),
        ("<>", ("", [])),
        (" <a@b.org> SIZE=10  BODY=8BITMIME", ("a@b.org", ["SIZE=10", "BODY=8BITMIME"])),
        ("<@relay.example,@two.example:a@b.org>", ("a@b.org", [])),
        ("a@b.org SIZE=1", ("a@b.org", ["SIZE=1"])),  # no brackets: taken, as Postfix does
        ("<a@b.org>SIZE=1", None),
        ("<a@b.org", None),
        ("<" + "x" * 300 + "@b.org>", None),
        ("", None),
    ],
)
def test_paths(arg: str, expected: tuple[str, list[str]] | None) -> None:
    assert envelope.split_path(arg) == expected


def test_what_a_row_keeps_is_only_what_was_given() -> None:
    kept = envelope.smtp_properties(
        MailParameters(body="8BITMIME", smtputf8=True, ret="FULL", envid="e1"),
        {
            "a@x.org": RcptParameters(("SUCCESS",), "rfc822;A@x.org"),
            "b@x.org": RcptParameters(),
        },
        queue_id="Q1",
    )
    assert kept == {
        "id": "Q1", "body": "8BITMIME", "smtputf8": True, "ret": "FULL", "envid": "e1",
        "rcpt": {"a@x.org": {"notify": ["SUCCESS"], "orcpt": "rfc822;A@x.org"}},
    }  # fmt: skip
    assert envelope.smtp_properties(MailParameters(body="7BIT"), {}, queue_id="Q") == {"id": "Q"}


def test_every_reply_line_carries_an_enhanced_code() -> None:
    assert replies.enhance("250 OK") == "250 2.0.0 OK"
    assert replies.enhance("503 Error: need RCPT command") == "503 5.5.1 need RCPT command"
    assert replies.enhance("500 Error: bad syntax") == "500 5.5.2 bad syntax"
    assert replies.enhance("250 2.1.0 Sender OK") == "250 2.1.0 Sender OK"  # kept
    assert replies.enhance("220 mx ESMTP") == "220 mx ESMTP"  # greetings carry none
    assert replies.enhance("334 VXNlcm5hbWU6") == "334 VXNlcm5hbWU6"
    assert replies.enhance("354 End data") == "354 End data"
    assert str(replies.STAGE_FULL).startswith("452 4.3.1 ")
    assert str(replies.NOT_STORED).startswith("451 4.3.0 ")


def test_relaying_needs_a_served_domain_or_a_trusted_client() -> None:
    domains = ("example.com", ".lists.example.org")
    assert policy.may_relay_to("bob@Example.COM", domains, trusted=False)
    assert policy.may_relay_to("l@dev.lists.example.org", domains, trusted=False)
    assert not policy.may_relay_to("l@lists.example.org", domains, trusted=False)
    assert not policy.may_relay_to("eve@evil.org", domains, trusted=False)
    assert not policy.may_relay_to("x@example.com.evil.org", domains, trusted=False)
    assert not policy.may_relay_to("x@evil.org", (), trusted=False)  # no DOMAINS: nothing
    assert policy.may_relay_to("eve@evil.org", domains, trusted=True)


def test_peers_and_their_keys() -> None:
    assert policy.peer_address("::ffff:192.0.2.1") == ip_address("192.0.2.1")
    assert policy.peer_address("fe80::1%eth0") == ip_address("fe80::1")
    assert policy.peer_address("") is None
    assert policy.client_key(ip_address("2001:db8:1:2:3:4:5:6")) == "2001:db8:1:2::/64"
    assert policy.client_key(ip_address("192.0.2.1")) == "192.0.2.1"
    assert policy.client_key(None) == "local"
    networks = (ip_network("10.0.0.0/8"),)
    assert policy.in_networks(ip_address("10.1.2.3"), networks)
    assert not policy.in_networks(ip_address("127.0.0.1"), networks)
    assert not policy.in_networks(None, networks)


def test_admission_caps_sessions_in_all_and_per_client() -> None:
    admission = policy.Admission(max_connections=3, per_client=2)
    assert admission.admit("a", exempt=False) is None
    assert admission.admit("a", exempt=False) is None
    assert admission.admit("a", exempt=False) == replies.CLIENT_TOO_MANY
    assert admission.admit("a", exempt=True) is None  # RELAY_NETWORKS: no per-client cap
    assert admission.admit("b", exempt=False) == replies.TOO_MANY_CONNECTIONS
    admission.release("a")
    assert admission.admit("b", exempt=False) is None
    for key in ("a", "a", "b"):
        admission.release(key)
    assert admission.total == 0
    assert not admission.by_client


def test_auth_failures_slow_a_client_down_then_are_forgotten() -> None:
    now = [0.0]
    throttle = policy.AuthThrottle(lambda: now[0])
    assert throttle.delay("a") == 0.0
    delays = []
    for _ in range(8):
        throttle.failed("a")
        delays.append(throttle.delay("a"))
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 16.0, 16.0]
    assert throttle.delay("b") == 0.0  # per client
    now[0] += policy.AUTH_FORGET + 1
    assert throttle.delay("a") == 0.0
    throttle.failed("a")
    throttle.succeeded("a")
    assert throttle.delay("a") == 0.0
