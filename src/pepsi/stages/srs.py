"""`pepsi-stage-srs`: the Sender Rewriting Scheme for forwarded mail (metadata only: it fuses).

The envelope sender of a message from another domain is rewritten into
DOMAIN (SRS0, or SRS1 for one rewritten by a forwarder before), so that the
next hop's SPF check passes and bounces come back here. A recipient that is
one of DOMAIN's SRS addresses (a bounce coming back) is turned back into
the address it stands for, if its hash is valid and it is younger than
MAX_AGE (`pepsi.mail.protocol.srs`). The null sender and senders of DOMAIN stay.
"""

from __future__ import annotations

import time

from pepsi.mail.protocol import srs
from pepsi.stage import Advance, Message, stage
from pepsi.stages.mail_options import SrsOptions

_SECRETS: dict[SrsOptions, bytes] = {}  # by options: per-address settings may differ


@stage
def run(msg: Message) -> Advance:
    options: SrsOptions = msg.options.builtin_options
    secret = _SECRETS.get(options)
    if secret is None:
        secret = _SECRETS[options] = options.secret()
    now = time.time()
    recipients = tuple(
        srs.reverse(r, options.domain, secret, now, options.max_age) or r for r in msg.recipients
    )
    if recipients != msg.recipients:
        msg.recipients = recipients
    sender = msg.sender
    if sender and not _ours(sender, options.domain):
        msg.sender = srs.forward(sender, options.domain, secret, now)
    return Advance()


def _ours(address: str, domain: str) -> bool:
    return address.rpartition("@")[2].lower() == domain.lower()
