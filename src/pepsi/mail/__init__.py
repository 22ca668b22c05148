"""Mail: the SMTP/LMTP ingress (SPEC M-1 to M-3) and delivery.

Cut as Postfix cuts its programs, with the decisions apart from the I/O:

- `replies.py`: every reply the server gives, with its enhanced status code;
- `envelope.py`: MAIL and RCPT parameters (SIZE, BODY, SMTPUTF8, RET, ENVID,
  NOTIFY, ORCPT) and what a row keeps of them;
- `content.py`: the DATA stream (its end, dot-stuffing, bare line feeds) and
  the header block (split, Message-ID/From/Subject, `Received:`);
- `policy.py`: who may relay, connection admission, the AUTH slow-down;
- `message.py`: a received message as the row it becomes;
- `committer.py`: accepted messages into shared commits, outcomes as replies;
- `connection.py`, `auth.py`, `session.py`: one SMTP or LMTP session on
  aiosmtpd's protocol (the plumbing, AUTH, the mail transaction);
- `server.py`: `pepsi ingress --serve`, its listeners and its lifetime.

The first five are pure and tested without a socket. Mail out (SPEC M-4 to
M-6), for the stages in `pepsi.stages` (relay, dkim, srs, bounce):

- `attempt.py`, `delivery.py`, `dsn.py`: what the replies say of each
  recipient, what each result makes of a message, and the delivery status
  notifications (pure);
- `srs.py`, `dkim.py`: sender rewriting and DKIM signatures;
- `mx.py`, `outbound.py`, `slots.py`: the next hops, the SMTP client and its
  connections per destination.
"""
