"""Mail out (SPEC M-4): one SMTP attempt to the next hop, MX lookup, connection slots,
and what the replies do to a message (`delivery`, pure).
"""
