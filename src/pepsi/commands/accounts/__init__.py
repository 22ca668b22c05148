"""Subcommands for who may log in: AMQP users and permissions, mail users, passwords."""
