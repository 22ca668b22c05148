"""The broker behind the channels: publish, deliver, consume, expire, dead-letter.

On asyncio and PostgreSQL: the catalogue of exchanges, queues and bindings, the publish
batcher, deliveries from the dispatcher's claim. Imports `session`, `model`, `auth`, `wire`.
"""
