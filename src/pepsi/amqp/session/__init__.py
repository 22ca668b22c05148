"""AMQP connections on asyncio: the listener, the handshake, heartbeats, channels, flow.

A connection knows frames and channels, never queues: each opened channel is handed
to a `ChannelHandler`, which `broker` implements. Imports `auth`, `wire`.
"""
