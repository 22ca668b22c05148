"""Mail's formats, pure: replies, envelope parameters, message bytes, the row a message
becomes, DSNs (RFC 3464), SRS addresses and DKIM signatures.
"""
