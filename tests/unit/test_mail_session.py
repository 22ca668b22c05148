"""The SMTP session's own constructor against aiosmtpd's (pepsi.mail.ingress.session).

SmtpSession sets what SMTP.__init__ sets without its per-connection reflection;
this test fails when an aiosmtpd release adds state the session would miss.
"""

from __future__ import annotations

import asyncio
import logging

import aiosmtpd.smtp
import pytest
from aiosmtpd.smtp import SMTP

from pepsi.config.model import IngressOptions
from pepsi.mail.ingress.connection import Ingress, skip_dropped_command_logs
from pepsi.mail.ingress.session import LmtpSession, SmtpSession


async def _attributes() -> tuple[set[str], SmtpSession, LmtpSession]:
    async def never(name: str, password: bytes) -> bool:
        raise AssertionError("not called")

    ingress = Ingress(
        options=IngressOptions(stage="inbox"),
        stage="inbox",
        hostname="mx.test",
        committer=None,  # type: ignore[arg-type]  # no message is committed here
        check_login=never,
    )
    theirs = SMTP(object(), loop=asyncio.get_running_loop())
    return set(vars(theirs)), SmtpSession(ingress), LmtpSession(ingress)


def test_the_session_sets_everything_aiosmtpd_would() -> None:
    theirs, smtp, lmtp = asyncio.run(_attributes())
    assert theirs - set(vars(smtp)) == set()
    assert set(smtp._smtp_methods) >= {"EHLO", "HELO", "MAIL", "RCPT", "DATA", "QUIT", "AUTH"}
    assert smtp._smtp_methods["MAIL"] == smtp.smtp_MAIL
    assert set(smtp._auth_methods) == {"PLAIN", "LOGIN"}
    assert "LHLO" in lmtp._smtp_methods
    assert "LHLO" not in smtp._smtp_methods
    assert smtp._smtp_methods.get("NOPE") is None  # aiosmtpd's look-up of an unknown verb
    assert dict(smtp._smtp_methods.items())["HELP"] == smtp.smtp_HELP


def test_command_lines_are_sanitized_only_for_a_log_that_keeps_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """aiosmtpd hides AUTH secrets before `mail.log` sees a command line; with the check
    installed it skips that work when the logger drops the line, and only then."""
    sanitized: list[bytes] = []

    def sanitize(text: bytes) -> bytes:
        sanitized.append(text)
        return original(text)

    original = aiosmtpd.smtp.sanitize
    monkeypatch.setattr(aiosmtpd.smtp, "sanitize", sanitize)
    monkeypatch.setattr(aiosmtpd.smtp, "sanitized_log", aiosmtpd.smtp.sanitized_log)
    skip_dropped_command_logs()
    mail_log = logging.getLogger("mail.log")
    line = b"AUTH PLAIN c2VjcmV0\r\n"

    caplog.set_level(logging.WARNING, logger="mail.log")
    aiosmtpd.smtp.sanitized_log(mail_log.info, "%r >> %r", ("127.0.0.1", 25), line)
    aiosmtpd.smtp.sanitized_log(mail_log.debug, "readline: %r", line)
    assert sanitized == []
    assert caplog.records == []

    caplog.set_level(logging.INFO, logger="mail.log")
    aiosmtpd.smtp.sanitized_log(mail_log.info, "%r >> %r", ("127.0.0.1", 25), line)
    aiosmtpd.smtp.sanitized_log(mail_log.debug, "readline: %r", line)  # still below the level
    assert sanitized == [line]
    (record,) = caplog.records
    assert "c2VjcmV0" not in record.getMessage()
    assert "********" in record.getMessage()
