"""Subcommands that set up where Pepsi runs: the schema, the embedded database, a dev cluster."""
