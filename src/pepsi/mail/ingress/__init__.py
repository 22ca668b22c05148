"""The SMTP/LMTP ingress (SPEC M-1 to M-3): listeners, sessions, AUTH, the shared commit.

I/O on aiosmtpd; what is decided (`policy`) and what is said (`mail.protocol`) live apart.
"""
