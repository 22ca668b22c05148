"""`pepsi-stage-dkim-sign`: a DKIM-Signature (RFC 6376) on top of the header block.

DOMAIN, SELECTOR, KEY_FILE (an RSA key in PEM, read when the worker starts)
and HEADERS (the fields to sign; From always). The signature covers the
header block and the body as they are stored, relaxed/relaxed; the stage
goes on to NEXT with the new header block (`pepsi.mail.protocol.dkim`).
"""

from __future__ import annotations

from pepsi.config import StageConfig
from pepsi.mail.protocol import dkim
from pepsi.stage import Advance, Message, Needs, stage
from pepsi.stages.mail_options import DkimOptions, read_secret

_SIGNERS: dict[DkimOptions, dkim.Signer] = {}  # by options: a selector or key per address

dkim.install()


@stage(Needs.BODY)
def run(msg: Message) -> Advance:
    header = msg.header or b""
    signature = _signer(msg.options).signature(header + b"\r\n" + (msg.body or b""))
    msg.header = signature + header
    return Advance()


def _signer(config: StageConfig) -> dkim.Signer:
    options: DkimOptions = config.builtin_options
    signer = _SIGNERS.get(options)
    if signer is None:
        pem = read_secret("KEY_FILE", options.key_file)
        signer = _SIGNERS[options] = dkim.Signer(
            options.domain, options.selector, pem, options.headers
        )
    return signer
