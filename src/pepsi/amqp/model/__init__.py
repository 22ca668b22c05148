"""The AMQP model: exchanges, bindings, routing, queue arguments, consumers' credit.

Pure decisions over frozen values, as RabbitMQ 3.x makes them (property-tested).
Imports `wire` only.
"""
