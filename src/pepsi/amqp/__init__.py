"""AMQP 0-9-1 listener (issue 16)."""
