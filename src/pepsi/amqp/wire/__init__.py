"""The AMQP 0-9-1 wire: frames, methods, content headers and reply codes.

Pure: bytes in, values out, and back. Nothing here knows a queue, a socket or
the database; every other layer of `pepsi.amqp` imports it, it imports none.
"""
