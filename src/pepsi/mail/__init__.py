"""Mail: the SMTP/LMTP ingress (SPEC M-1 to M-3) and mail out (M-4 to M-6).

Cut as Postfix cuts its programs, with what is said and decided apart from the I/O:

- `protocol/` (pure formats): `replies.py` (every reply with its enhanced status
  code), `envelope.py` (MAIL and RCPT parameters and what a row keeps of them),
  `content.py` (the DATA stream, dot-stuffing both ways, the header block),
  `message.py` (a received message as the row it becomes), `dsn.py` (delivery
  status notifications), `srs.py` and `dkim.py` (sender rewriting, signatures);
- `ingress/` (the server, on aiosmtpd): `policy.py` (who may relay, connection
  admission, the AUTH slow-down: pure), `committer.py` (accepted messages into
  shared commits), `connection.py`, `auth.py`, `session.py` (one SMTP or LMTP
  session), `server.py` (`pepsi ingress --serve`, its listeners and lifetime);
- `relay/` (mail out, for the stages in `pepsi.stages`: relay, dkim, srs, bounce):
  `attempt.py` and `delivery.py` (what the replies say of each recipient and what
  each result makes of a message: pure), `mx.py`, `outbound.py`, `slots.py` (the
  next hops, the SMTP client, its connections per destination).

Imports go one way: `ingress` and `relay` use `protocol`, never each other.
"""
