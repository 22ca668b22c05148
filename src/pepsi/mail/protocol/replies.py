"""The replies of the SMTP/LMTP server: a code, an enhanced status code (RFC 3463), a text.

Every reply the server writes goes through `Reply`, so each carries an
enhanced code (RFC 2034 asks for one on every reply once ENHANCEDSTATUSCODES
is offered). Replies written by aiosmtpd itself get one from `enhance`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Reply:
    code: int
    status: str  # enhanced status code, e.g. "2.0.0"
    text: str

    def __str__(self) -> str:
        return f"{self.code} {self.status} {self.text}"

    def with_text(self, text: str) -> Reply:
        return Reply(self.code, self.status, text)


SENDER_OK = Reply(250, "2.1.0", "Sender OK")
RECIPIENT_OK = Reply(250, "2.1.5", "Recipient OK")


def queued(workqueue_id: int) -> Reply:
    """The 250 after the commit: the row's id, as Postfix names its queue id."""
    return Reply(250, "2.0.0", f"Queued as {workqueue_id}")


START_DATA = "354 End data with <CR><LF>.<CR><LF>"  # no enhanced code on 354 (RFC 2034)

# Temporary refusals: the client keeps the message and tries again later.
NOT_STORED = Reply(451, "4.3.0", "Temporary failure: the message was not stored, try again later")
STAGE_FULL = Reply(452, "4.3.1", "Insufficient system storage: the queue is full, try again later")
TOO_MANY_RECIPIENTS = Reply(452, "4.5.3", "Too many recipients")
TIMEOUT = Reply(421, "4.4.2", "Timeout exceeded, closing the connection")
TOO_MANY_CONNECTIONS = Reply(421, "4.7.0", "Too many connections, try again later")
CLIENT_TOO_MANY = Reply(421, "4.7.0", "Too many connections from your address, try again later")
SHUTTING_DOWN = Reply(421, "4.3.2", "Service shutting down, try again later")
TLS_FAILED = Reply(454, "4.7.0", "TLS handshake failed")

# Permanent refusals.
TOO_BIG = Reply(552, "5.3.4", "Message size exceeds the fixed limit")
RELAY_DENIED = Reply(554, "5.7.1", "Relay access denied")
AUTH_FAILED = Reply(535, "5.7.8", "Authentication credentials invalid")
AUTH_OK = Reply(235, "2.7.0", "Authentication successful")
BAD_SYNTAX = Reply(501, "5.5.4", "Syntax error in parameters or arguments")
BAD_ADDRESS = Reply(553, "5.1.3", "Malformed or unsupported address")
NOT_ASCII = Reply(553, "5.6.7", "Non-ASCII address without SMTPUTF8")
UNKNOWN_PARAMETER = Reply(555, "5.5.4", "Parameter not recognized or not implemented")
NESTED_MAIL = Reply(503, "5.5.1", "Nested MAIL command")
NEED_MAIL = Reply(503, "5.5.1", "Need MAIL command")
NEED_RCPT = Reply(503, "5.5.1", "Need RCPT command")
BAD_CONTENT = Reply(554, "5.6.0", "Message content rejected")

_CODED = re.compile(r"\d{3}[ -]\d\.\d{1,3}\.\d{1,3}(?: |$)")
# The enhanced code aiosmtpd's own replies get, by reply code.
_DEFAULT_STATUS = {
    220: "", 221: "2.0.0", 235: "2.7.0", 250: "2.0.0", 252: "2.5.0", 334: "", 354: "",
    421: "4.3.0", 451: "4.3.0", 454: "4.7.0", 500: "5.5.2", 501: "5.5.4", 502: "5.5.1",
    503: "5.5.1", 504: "5.5.4", 530: "5.7.0", 535: "5.7.8", 538: "5.7.11", 552: "5.3.4",
    553: "5.1.3", 554: "5.0.0", 555: "5.5.4",
}  # fmt: skip


def enhance(line: str) -> str:
    """`line` (one reply line) with an enhanced status code if it has none and should.

    Greetings (220), AUTH challenges (334) and 354 carry none (RFC 2034).
    """
    if len(line) < 4 or not line[:3].isdigit() or _CODED.match(line):
        return line
    code = int(line[:3])
    status = _DEFAULT_STATUS.get(code, f"{line[0]}.0.0" if line[0] in "245" else "")
    if not status:
        return line
    separator, text = line[3], line[4:]
    if text.startswith("Error: "):  # aiosmtpd's prefix says nothing a code does not
        text = text[len("Error: ") :]
    return f"{line[:3]}{separator}{status} {text}".rstrip()
