"""Accounts: AMQP users, vhosts and permissions; the ingress's AUTH users."""
