"""The SMTP session's own constructor against aiosmtpd's (pepsi.mail.ingress.session).

SmtpSession sets what SMTP.__init__ sets without its per-connection reflection;
this test fails when an aiosmtpd release adds state the session would miss.
"""

from __future__ import annotations

import asyncio

from aiosmtpd.smtp import SMTP

from pepsi.config.model import IngressOptions
from pepsi.mail.ingress.connection import Ingress
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
